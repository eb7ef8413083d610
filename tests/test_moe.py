"""Mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE) as tiny random transformers models:
runtime against transformers, float and quantized; the checkpoint in transformers + compressed-
tensors and in the layout vLLM reads; calibration of every expert; the engine; the planner."""

import json

import pytest
import torch

import runtime
from evals import planner
from quant import checkpoint
from quant import checkpoint_write
from quant.affine import QuantScheme
from quant.architectures import MissingConfigKey
from quant.moe import CalibrationMoE, route, routed_counts, set_statistics, unfuse_experts
from quant.plan import plan_layers
from quant.quantize import quantize_model
from runtime.engine import Engine
from runtime.moe import SparseMoE
from runtime.sampling import SamplingParams
from tiny import save_model, tiny_model

KINDS = ("mixtral", "qwen3_moe", "qwen2_moe")
W4 = QuantScheme(4, 32, True)  # symmetric: transformers 5.23 cannot load asymmetric experts


def token_ids(model, rows=2, length=13, seed=1):
    return torch.randint(0, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(seed))


def fake_quantized(model, quantized):
    """The (unfused) float model with each quantized weight replaced by its dequantized value."""
    for name, qw in quantized.items():
        model.get_submodule(name).weight = torch.nn.Parameter(qw.dequantize(torch.float32), requires_grad=False)
    return model


def quantize_and_save(kind, tmp_path, methods="rtn", scheme=W4, samples=None, **settings):
    model, tok = tiny_model(kind)
    unfuse_experts(model)
    plan = plan_layers(model, scheme, ["lm_head"])
    quantized, stats = quantize_model(model, plan, methods, samples=samples, progress=False, **settings)
    out = checkpoint_write.save(model, quantized, tmp_path / "ckpt", tokenizer=tok, manifest={"layers": stats})
    return model, quantized, stats, out


@pytest.mark.parametrize("kind", KINDS)
def test_runtime_logits_equal_transformers_in_float32(kind, tmp_path):
    model, tok = tiny_model(kind)
    ids = token_ids(model)
    expected = model(ids).logits
    loaded = runtime.load(save_model(model, tok, tmp_path / "m"))
    sparse = [m for m in loaded.decoder.modules() if isinstance(m, SparseMoE)]
    assert sparse and all(isinstance(m.gate, torch.nn.Linear) for m in sparse)  # really a MoE, router in float
    torch.testing.assert_close(loaded.logits(ids), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_unfused_model_keeps_transformers_output_and_hub_names(kind, tmp_path):
    model, tok = tiny_model(kind)
    ids = token_ids(model)
    expected = model(ids).logits
    saved = set(checkpoint.read_tensors(save_model(model, tok, tmp_path / "m")))  # transformers' own layout
    unfuse_experts(model)
    assert set(model.state_dict()) == saved  # one Linear per expert, named as on the Hub
    torch.testing.assert_close(model(ids).logits, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_checkpoint_runtime_and_transformers_agree(kind, tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model, quantized, _, out = quantize_and_save(kind, tmp_path)
    config = checkpoint.read_config(out)["quantization_config"]
    tensors = checkpoint.read_tensors(out)
    routers = [n for n in config["ignore"] if n.endswith(".gate")]
    assert routers and all(tensors[f"{n}.weight"].is_floating_point() for n in routers)  # routers stay float
    experts = [n for n in quantized if ".experts." in n]
    assert experts and all(f"{n}.weight_packed" in tensors for n in experts)  # every expert quantized
    # one re: target per sparse block, which also matches the names vLLM probes (.0.gate_proj)
    targets = [t for g in config["config_groups"].values() for t in g["targets"] if t.startswith("re:")]
    assert targets and all(".experts" in t for t in targets)
    vllm_probe = experts[0].rsplit(".", 2)[0] + ".0.gate_proj"
    assert checkpoint.linear_schemes({"quantization_config": config}, [vllm_probe])

    ids = token_ids(model)
    expected = fake_quantized(model, quantized)(ids).logits
    torch.testing.assert_close(runtime.load(out, linear_backend="reference").logits(ids), expected, atol=1e-4, rtol=1e-4)  # float32 precision
    for options in ({}, {"quantization_config": CompressedTensorsConfig(dequantize=True)}):
        theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **options).eval()
        with torch.no_grad():
            torch.testing.assert_close(theirs(ids).logits, expected, atol=1e-4, rtol=1e-4)


def test_asymmetric_experts_are_warned_about(tmp_path):
    model, _ = tiny_model("mixtral")
    unfuse_experts(model)
    with pytest.warns(UserWarning, match="transformers 5.23 cannot load asymmetric MoE experts"):
        plan_layers(model, QuantScheme(4, 32, False), ["lm_head"])


def calibration_samples(model, n=32, length=32):
    """Random tokens, as the held-out ones: a random model has no text distribution to learn."""
    return token_ids(model, n, length, seed=7)


def logits_error(kind, quantized, ids):
    reference, _ = tiny_model(kind)
    unfuse_experts(reference)
    with torch.no_grad():
        expected = reference(ids).logits
        got = fake_quantized(reference, quantized)(ids).logits
    return float((got - expected).norm() / expected.norm())


@pytest.mark.parametrize("kind", ("mixtral", "qwen2_moe"))
def test_gptq_calibrates_every_expert_and_beats_rtn(kind, tmp_path):
    model, tok = tiny_model(kind)
    samples = calibration_samples(model)
    _, rtn, _, _ = quantize_and_save(kind, tmp_path / "rtn", scheme=QuantScheme(3, 32, True))
    _, gptq, stats, _ = quantize_and_save(kind, tmp_path / "gptq", "gptq", QuantScheme(3, 32, True), samples)
    experts = [n for n in gptq if ".experts." in n]
    assert experts and all("output_rel_error" in stats[n] and "rounded_by" not in stats[n] for n in experts)
    held_out = token_ids(model, rows=8, length=32, seed=5)
    assert logits_error(kind, gptq, held_out) < logits_error(kind, rtn, held_out)


class NeverPicks(torch.nn.Module):
    """Mixtral's routing (softmax, top k, renormalized) with one expert's logit at -inf."""

    def __init__(self, router, expert: int):
        super().__init__()
        self.weight, self.top_k, self.expert = router.weight, router.top_k, expert

    def forward(self, x):
        logits = torch.nn.functional.linear(x, self.weight)
        logits[:, self.expert] = float("-inf")
        weights, chosen = route(logits, self.top_k, normalize=True)
        return logits, weights, chosen


def test_routed_statistics_round_an_unreached_expert_by_rtn():
    """With a router that never picks expert 7, "routed" statistics give it no Hessian: it is
    rounded by RTN and says so; "all" calibrates it on every token."""
    model, _ = tiny_model("mixtral")
    for layer in model.model.layers:
        layer.mlp.gate = NeverPicks(layer.mlp.gate, 7)
    unfuse_experts(model, statistics="routed")
    samples = calibration_samples(model)
    counts = routed_counts(model, samples)
    assert all(c[7] == 0 for c in counts.values()) and all(c[:7].sum() > 0 for c in counts.values())
    plan = plan_layers(model, W4, ["lm_head"])
    _, stats = quantize_model(model, plan, "gptq", samples=samples, progress=False)
    unreached = [n for n in stats if ".experts.7." in n]
    assert unreached and all(stats[n]["rounded_by"].startswith("rtn") for n in unreached)
    set_statistics(model, "all")
    assert all(m.statistics == "all" for m in model.modules() if isinstance(m, CalibrationMoE))


def test_engine_greedy_equals_generate_and_transformers(tmp_path):
    model, tok = tiny_model("mixtral", initializer_range=0.3)
    loaded = runtime.load(save_model(model, tok, tmp_path / "m"), kv="fp16-r16")
    prompts = [token_ids(model, 1, n, seed=n)[0].tolist() for n in (5, 17, 9)]
    expected = [model.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    alone = [[t.id for t in loaded.generate(p, max_new_tokens=8, stop_at_eos=False)] for p in prompts]
    requests = Engine(loaded, max_batch=2, max_len=64).generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert alone == expected
    assert [r.output_ids for r in requests] == expected


def test_sparse_and_dense_expert_paths_agree():
    """The dense path (what a CUDA graph captures) gives the sparse path's output."""
    model, tok = tiny_model("qwen2_moe")
    from runtime.model import Decoder, DecoderConfig

    cfg = DecoderConfig.from_hf(model.config.to_dict())
    block = Decoder(cfg).model.layers[0].mlp
    torch.nn.init.normal_(block.gate.weight)
    x = torch.randn(2, 7, cfg.hidden_size)
    flat = x.reshape(-1, cfg.hidden_size)
    weights, chosen = route(block.gate(flat), block.top_k, block.normalize)
    torch.testing.assert_close(block.dense(flat, weights, chosen), block.sparse(flat, weights, chosen),
                               atol=1e-5, rtol=1e-5)


MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                "vocab_size": 32000, "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
                "tie_word_embeddings": False}


def test_plan_counts_every_expert_of_a_mixtral_8x7b_shaped_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    p = planner.plan(str(tmp_path), memory=120 << 30, context=4096)
    assert p["weights"]["bytes"] == pytest.approx(46.70e9 * 2, rel=0.002)  # Mixtral-8x7B: 46.7 B parameters
    assert p["attention"] == {"layers": 32, "kv_heads": 8, "head_dim": 128, "max_position_embeddings": 32768,
                              "layer_types": [{"layers": 32, "window": None}]}  # no sliding_window set


def test_a_moe_config_without_routing_keys_is_named():
    config = {k: v for k, v in MIXTRAL_8X7B.items() if k != "num_experts_per_tok"}
    with pytest.raises(MissingConfigKey, match="num_experts_per_tok"):
        runtime.check_supported(config)


def test_quantized_experts_through_the_w4_kernels(tmp_path, kernels_on_cpu, monkeypatch):
    """Each expert's tokens through the Triton W4 kernels (the interpreter on CPU; M = 1 takes the
    GEMV, more the tl.dot path) give the dense reference's logits."""
    import triton  # noqa: F401  (tests/conftest.py set TRITON_INTERPRET before any import of it)

    from runtime.kernels import quant_matmul
    from runtime.linear import use_backend

    if not quant_matmul.interpreting() and not torch.cuda.is_available():
        pytest.skip("no GPU, and triton was imported before TRITON_INTERPRET=1 was set")
    _, _, _, out = quantize_and_save("mixtral", tmp_path)
    device = "cpu" if quant_matmul.interpreting() else "cuda"
    loaded = runtime.load(out, device=device, dtype=torch.float16, linear_backend="reference")
    ids = torch.tensor([[5, 17, 33, 2, 90, 41]])
    reference = loaded.logits(ids)
    use_backend(loaded.decoder, "triton")
    calls, real = [], quant_matmul.quant_matmul
    monkeypatch.setattr(quant_matmul, "quant_matmul", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    through_kernels = loaded.logits(ids)
    assert calls  # the kernels ran
    torch.testing.assert_close(through_kernels, reference, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", KINDS)
def test_each_moe_entry_matches_the_transformers_model(kind):
    """Experts, top k, renormalization, widths and which layers are sparse: as transformers builds them."""
    from quant.architectures import architecture_of

    model, _ = tiny_model(kind)
    config = model.config.to_dict()
    moe = architecture_of(model).experts.shape(config, len(model.model.layers))
    for i, layer in enumerate(model.model.layers):
        sparse = hasattr(layer.mlp, "experts")
        assert moe.sparse[i] == sparse
        if sparse:
            experts = layer.mlp.experts
            assert (moe.num_experts, 2 * moe.width) == tuple(experts.gate_up_proj.shape[:2])
            assert moe.top_k == layer.mlp.gate.top_k
            assert moe.normalize == getattr(layer.mlp.gate, "norm_topk_prob", True)
            shared = getattr(layer.mlp, "shared_expert", None)
            assert moe.shared_width == (shared.gate_proj.out_features if shared else 0)
    assert any(moe.sparse) and (kind != "qwen3_moe" or not all(moe.sparse))  # tiny qwen3_moe has a dense layer


def test_a_moe_model_is_calibrated_layer_by_layer_from_disk(tmp_path):
    """load_lazily unfuses on the meta device, so the files' per-expert tensors fill one layer at a
    time: the same quantized weights as the model loaded whole."""
    from quant import models

    model, tok = tiny_model("mixtral")
    src = save_model(model, tok, tmp_path / "src")
    samples = calibration_samples(model, n=8)
    results = []
    for lazily in (True, False):
        loaded = models.load_lazily(src) if lazily else None
        assert (loaded is not None) == lazily
        m, _, lazy = loaded or (*models.load_float_model(src), None)
        plan = plan_layers(m, W4, ["lm_head"])
        results.append(quantize_model(m, plan, "gptq", samples=samples, progress=False, lazy=lazy)[0])
    lazy_q, whole_q = results
    assert set(lazy_q) == set(whole_q) and any(".experts.7.w2" in n for n in lazy_q)
    assert all(torch.equal(lazy_q[n].q, whole_q[n].q) for n in lazy_q)


def test_a_layer_holds_few_hessians_at_once(monkeypatch):
    """Each expert's xᵀx is freed once its readers are rounded: at most two are alive at any time
    (the one being filled and the one just finished), not one per expert."""
    import weakref

    from quant import sequential

    alive, most = [], [0]
    original = sequential.add_gram

    def counting(total, x, blocks=4):
        if not any(ref() is total for ref in alive):
            alive.append(weakref.ref(total))
        alive[:] = [ref for ref in alive if ref() is not None]
        most[0] = max(most[0], len(alive))
        original(total, x, blocks)

    monkeypatch.setattr(sequential, "add_gram", counting)
    model, _ = tiny_model("mixtral")
    unfuse_experts(model)
    plan = plan_layers(model, W4, ["lm_head"])
    quantize_model(model, plan, "gptq", samples=calibration_samples(model, n=4), progress=False)
    assert 1 <= most[0] <= 2  # 8 experts x (gate/up input, down input) per layer without the freeing
