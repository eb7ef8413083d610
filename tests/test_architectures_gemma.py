"""Gemma 2, Gemma 3 and Phi-3: quantized, loaded and served as transformers runs them.

Tiny random models from transformers configs (lowbit_testing/tiny_models.py: soft-caps, windows, a query
scalar and local/global RoPE chosen so that each binds). The float runtime against transformers, greedy tokens
included, is in tests/test_runtime.py (its KINDS); here: the family table, Gemma's (1 + w) norms under
AWQ, quantized checkpoints in both runtimes, every KV scheme, calibration, and the engine.
"""

import pytest
import torch

import runtime
from kvquant import KVScheme, parse_kv
from quant import architectures, checkpoint_write
from quant.affine import QuantScheme
from quant.awq import apply_scale, scale_mappings
from quant.plan import plan_layers
from quant.quantize import quantize_model
from runtime.linear import QuantLinear
from bench.families import GEMMA3_27B, KV_SCHEMES, PHI3_MINI_128K
from lowbit_testing.tiny_models import ids_for, quantized_checkpoint, save_model, tiny_model, with_outlier_channels

FAMILIES = ["gemma2", "gemma3", "phi3"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_each_family_entry_matches_the_transformers_model(kind):
    model, _ = tiny_model(kind)
    config = model.config.to_dict()
    arch = architectures.architecture_of(model)
    prefix, layers = architectures.decoder_layers(model)
    assert prefix == "model.layers"
    arch.check_layer(layers[0])  # every Linear and norm the entry names exists
    linears = {n for n, m in layers[0].named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears == set(arch.linears)
    cfg = runtime.check_supported(config)
    types = config.get("layer_types") or ["full_attention"] * len(layers)
    assert cfg.sliding_windows == tuple(model.config.sliding_window if t == "sliding_attention" else None
                                        for t in types)
    if kind.startswith("gemma"):
        assert cfg.sliding_windows.count(8) >= 1 and None in cfg.sliding_windows  # local and global layers
        assert arch.norm_offset == 1.0 and cfg.embed_scale == 64 ** 0.5 and cfg.tie_embeddings
    assert (cfg.attn_softcap, cfg.final_softcap) == ((2.0, 3.0) if kind == "gemma2" else (None, None))
    assert (cfg.local_rope is not None) == (kind == "gemma3")


def test_awq_scales_fold_into_gemmas_one_plus_weight_norms_exactly():
    """AWQ divides a norm's output channels by s: Gemma's norm scales by (1 + w), so w must become
    (1 + w) / s - 1, not w / s. The layer's output is unchanged in float."""
    model, _ = tiny_model("gemma3")
    layer = model.model.layers[0]
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(0))
    position_embeddings = model.model.rotary_emb(x, torch.arange(12)[None], "sliding_attention")
    with torch.no_grad():
        before = layer(x, position_embeddings=position_embeddings, attention_mask=None)
        g = torch.Generator().manual_seed(1)
        for mapping in scale_mappings(layer, architectures.architecture_of(model)):
            if not isinstance(mapping.prev, torch.nn.Linear):
                apply_scale(mapping, layer, torch.rand(64, generator=g) + 0.5)
        after = layer(x, position_embeddings=position_embeddings, attention_mask=None)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", FAMILIES)
def test_quantized_checkpoint_runs_in_lowbit_and_in_transformers_alike(tmp_path, kind):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    out, model, _ = quantized_checkpoint(kind, tmp_path)
    ids = ids_for(model)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = theirs(ids).logits
        float_logits = model(ids).logits  # RTN leaves the float model as it was
    rt = runtime.load(out, linear_backend="reference")  # compared at float32 precision
    # qkv, o, gate_up, down per layer: joined at load (Phi-3: stored so)
    assert sum(isinstance(m, QuantLinear) for m in rt.decoder.modules()) == len(theirs.model.layers) * 4
    torch.testing.assert_close(rt.logits(ids), expected, atol=1e-4, rtol=1e-4)
    assert (float_logits - expected).abs().max() > 1e-3  # quantization changed the logits: not float against float


@pytest.mark.parametrize("kind", FAMILIES)
def test_every_kv_scheme_through_the_cache_stays_within_its_tolerance(tmp_path, kind):
    """Prefill 19 tokens, then decode one at a time past block boundaries (blocks of 16, windows of 8):
    each scheme's logits against the same quantized model run without a cache."""
    out, model, _ = quantized_checkpoint(kind, tmp_path)
    ids = ids_for(model, n=2, length=40)
    errors = {}
    for name, tolerance in KV_SCHEMES.items():
        rt = runtime.load(out, kv=name, linear_backend="reference")  # the cache's error alone
        expected = rt.logits(ids)
        cache = rt.new_cache(40, batch=2)
        with torch.inference_mode():
            got = [rt.decoder(ids[:, :19], cache, 0)]
            got += [rt.decoder(ids[:, p:p + 1], cache, p) for p in range(19, 40)]
        errors[name] = float((torch.cat(got, 1) - expected).abs().max() / expected.abs().max())
        assert errors[name] <= tolerance, (name, errors)
    assert errors["int8-r16"] < errors["int4-g16-r16"] < errors["int2-g16-r16"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_awq_and_gptq_lower_the_output_error_of_rtn(tmp_path, kind):
    """GPTQ (after AWQ, and alone) lowers every family's summed layer output error against RTN's;
    AWQ then RTN, GPTQ and AWQ+GPTQ checkpoints give logits nearer the float model's than RTN's, on
    held-out tokens."""
    model = with_outlier_channels(tiny_model(kind, seed=4)[0])
    held_out = ids_for(model, n=2, length=32, seed=11)
    with torch.no_grad():
        reference = model(held_out).logits
    errors = {}
    for methods in ("rtn", "gptq", "awq+gptq", "awq"):
        out, _, stats = quantized_checkpoint(kind, tmp_path, methods, outliers=True)
        errors[methods] = float((runtime.load(out).logits(held_out) - reference).pow(2).mean())
        if "gptq" in methods:
            assert sum(s["output_rel_error"] for s in stats.values()) < \
                sum(s["output_rel_error_rtn"] for s in stats.values()), methods
    assert max(errors["awq"], errors["gptq"], errors["awq+gptq"]) < errors["rtn"], errors


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_engines_greedy_output_equals_transformers_generate(tmp_path, kind):
    from runtime.engine import Engine
    from runtime.sampling import SamplingParams

    model, tok = tiny_model(kind)
    rt = runtime.load(save_model(model, tok, tmp_path / kind), kv="fp16-r16")
    prompts = [ids_for(model, length=n, seed=n)[0].tolist() for n in (5, 21, 12)]
    requests = Engine(rt, max_batch=2, max_len=64).generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    for prompt, request in zip(prompts, requests):
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                            pad_token_id=tok.eos_token_id)
        assert request.output_ids == hf[0, len(prompt):].tolist()


def test_gemma2_refuses_the_attention_kernels_it_cannot_run(tmp_path):
    """The Triton attention kernels have no soft-capping: a Gemma 2 model picks the reference at load,
    and forcing the kernels fails at once, saying why."""
    model, tok = tiny_model("gemma2")
    rt = runtime.load(save_model(model, tok, tmp_path / "g"), kv="fp16-r16")
    assert rt.decoder.cfg.attn_softcap == 2.0
    rt.decoder.attention_kernels = True
    with pytest.raises(ValueError, match="soft-capping.*reference"):
        list(rt.generate([5, 6, 7], max_new_tokens=2))


def test_longrope_switches_to_the_long_factors_past_the_original_context():
    """Positions below original_max_position_embeddings rotate as transformers' short factors,
    positions past it as its long factors (a forward that long, where transformers uses them all)."""
    model, _ = tiny_model("phi3-longrope")
    cfg = runtime.check_supported(model.config.to_dict())
    from runtime.model import Decoder

    ours = Decoder(cfg).ropes[0]
    x = torch.zeros(1)
    positions = torch.arange(100)
    cos, sin = ours.cos_sin(positions.float(), torch.float32)
    hf = model.model.rotary_emb
    short = hf(x, positions[None, :64])
    long = hf(x, positions[None])  # 100 > 64 positions: transformers takes the long factors
    torch.testing.assert_close(cos[:64], short[0][0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin[64:], long[1][0, 64:], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(long[0][0, :64], short[0][0])  # the two factor sets really differ


def tiny_gemma3_multimodal():
    """A Gemma3ForConditionalGeneration whose text decoder is tiny_model("gemma3")'s: (it, the text model, tokenizer)."""
    import transformers as tf

    text, tok = tiny_model("gemma3")
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, image_size=32, patch_size=16)
    config = tf.Gemma3Config(text_config=text.config.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                             boi_token_index=1, eoi_token_index=1, image_token_index=1)
    config.text_config._attn_implementation = "eager"
    full = tf.Gemma3ForConditionalGeneration(config).eval()
    full.model.language_model.load_state_dict(text.model.state_dict())
    return full, text, tok


def test_a_gemma3_multimodal_checkpoint_runs_its_text_decoder(tmp_path):
    """Gemma3ForConditionalGeneration keeps the text decoder under model.language_model: lowbit reads
    the text config and weights and leaves the vision tower unread."""
    full, text, tok = tiny_gemma3_multimodal()
    rt = runtime.load(save_model(full, tok, tmp_path / "mm"))
    ids = ids_for(text)
    with torch.no_grad():
        torch.testing.assert_close(rt.logits(ids), text(ids).logits, atol=1e-4, rtol=1e-4)


def test_a_quantized_gemma3_multimodal_checkpoint_runs_in_lowbit_and_in_transformers_alike(tmp_path):
    """GPTQ on the text decoder (vision tower and projector left in float): the checkpoint names its
    Linears under model.language_model, and lowbit finds them there."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForImageTextToText

    full, text, tok = tiny_gemma3_multimodal()
    plan = plan_layers(full, QuantScheme(4, 32, symmetric=False), ["lm_head", "re:.*vision_tower.*"])
    assert all(n.startswith("model.language_model.layers.") for n in plan)
    quantized, _ = quantize_model(full, plan, "gptq", samples=ids_for(text, n=8, length=16, seed=0), progress=False)
    out = checkpoint_write.save(full, quantized, tmp_path / "q", tokenizer=tok, dtype=torch.float32)
    ids = ids_for(text)
    theirs = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs(ids).logits
    torch.testing.assert_close(runtime.load(out, linear_backend="reference").logits(ids), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "gemma"}, "'gemma' is not supported; lowbit runs .*gemma2, gemma3_text, gemma3, phi3"),
    ({"model_type": "gemma3", "vision_config": {}}, "text_config"),
    ({"model_type": "gemma2", "hidden_activation": "relu", "num_hidden_layers": 1, "num_attention_heads": 2,
      "hidden_size": 8}, "relu"),
])
def test_an_unknown_family_or_feature_is_one_clear_error(config, message):
    with pytest.raises(architectures.UnsupportedModelError, match=message):
        runtime.check_supported(config)


def test_a_layer_missing_a_module_is_named_before_calibration():
    model, _ = tiny_model("gemma2")
    for layer in model.model.layers:
        del layer.pre_feedforward_layernorm
    plan = plan_layers(model, QuantScheme(4, 32), ["lm_head"])
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(architectures.UnsupportedModelError, match="model.layers.0: a gemma2 decoder layer needs the "
                                                                  "modules pre_feedforward_layernorm"):
        quantize_model(model, plan, ["gptq"], samples=ids_for(model, n=2, length=8), progress=False)
    assert not calls  # before any forward


@pytest.mark.parametrize("model_type, config_class", [("gemma2", "Gemma2Config"), ("gemma3_text", "Gemma3TextConfig")])
def test_family_defaults_are_the_transformers_config_defaults(model_type, config_class):
    """Gemma 3's config.json leaves out vocab_size and the RoPE bases: lowbit fills in what transformers would."""
    import transformers

    theirs = getattr(transformers, config_class)()
    for key, value in architectures.architecture(model_type).config_defaults:
        if key in ("rope_theta", "rope_local_base_freq"):
            params = theirs.rope_parameters
            got = (params.get("sliding_attention" if key == "rope_local_base_freq" else "full_attention") or params)
            got = got["rope_theta"]
        else:
            got = theirs._sliding_window_pattern if key == "sliding_window_pattern" else getattr(theirs, key)
        assert got == value, key


def test_real_shaped_configs_read_as_transformers_reads_them():
    gemma = runtime.check_supported(GEMMA3_27B)
    assert (gemma.num_layers, gemma.num_kv_heads, gemma.head_dim, gemma.vocab_size) == (62, 16, 128, 262_208)
    assert gemma.sliding_windows[:6] == (1024,) * 5 + (None,) and gemma.sliding_windows.count(None) == 10
    assert gemma.rope == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert gemma.local_rope == {"rope_type": "default", "rope_theta": 1e4}
    assert gemma.query_scale == pytest.approx((128 / 168) ** 0.5) and gemma.tie_embeddings
    phi = runtime.check_supported(PHI3_MINI_128K)
    assert phi.rope["original_max_position_embeddings"] == 4096 and phi.fused_projections and not phi.tie_embeddings


@pytest.mark.parametrize("config, shape", [(GEMMA3_27B, (62, 16, 128)), (PHI3_MINI_128K, (32, 32, 96))])
def test_lowbit_plan_reads_gemma3_27b_and_phi3_shaped_configs(tmp_path, config, shape):
    import json

    from evals import planner

    (tmp_path / "config.json").write_text(json.dumps(config))
    result = planner.plan(str(tmp_path), planner.parse_memory("80GB"), 32768, ["fp16", "int8", "int4-g32"])
    assert tuple(result["attention"][k] for k in ("layers", "kv_heads", "head_dim")) == shape
    fp16 = result["schemes"][0]
    # keys and values, 2 bytes each, in every layer (at most: sliding layers may keep only their window)
    assert 0 < fp16["kv_bytes_per_token"] <= 2 * shape[0] * shape[1] * shape[2] * 2
    assert 0 < result["schemes"][2]["kv_bytes_per_token"] < fp16["kv_bytes_per_token"] / 3
