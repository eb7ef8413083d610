"""The method registry and the per-architecture table: today's checkpoints unchanged, method lists
checked before any work, one home for each family's facts."""

import hashlib
import json
import warnings
from dataclasses import dataclass

import pytest
import torch

from quant import architectures, checkpoint
from quant import checkpoint_write
from quant import methods as registry
from quant.affine import QuantScheme
from quant.awq import AWQConfig
from quant.gptq import GPTQConfig
from quant.models import load_float_model, load_lazily
from quant.plan import Override, plan_layers
from quant.quantize import quantize_model
from tiny import tiny_llama

# sha256 over every tensor (name, dtype, shape, bytes) and the quantization_config of checkpoints
# written by main's code before the registry (commit 0708032: string methods dispatched with
# startswith/endswith), with the script's settings below: the refactor must not move one bit.
# Same machine class, torch and thread count assumed: CPU float results are not portable bit
# for bit across BLAS builds, so on another platform recompute them with the reference commit.
REFERENCE = {
    "rtn-w4g32": "e7592c5fd4f1908409f8c9b1484a1da8a1bd8fab73d04283912b0e0ab00e1757",
    "rtn-w8pc-sym": "90b0b36ff27a058e3585dca3ec907195d78c0e9a6436f4a6c84d98bf393f2a60",
    "rtn-w4g32-down8": "e05fc94cd620909b86d1d3c5eb9397dcf966837d95b295fd003899b32c41acba",
    "gptq-w4g32": "5286d0ebd7dcf4f9ff29e8c2f24560a008771ae4344ff0241fd1ede95d23b08d",
    "gptq-w4g32-sym-group": "c9b4bed691d4c3ba7608c10cfdcb564366a689edb60fcca10a50e4f866391d50",
    "gptq-untied-lm_head": "b2542f8145ec8f987a0089583e607f6fca4ee62862312231a6d82527ea33f3af",
    "awq-w4g32": "b4dede6880bb9fecc1ddc9294e6a80c4719d6af6699231ebabf5dc2913ec223e",
    "awq+gptq-w4g32": "9f674e6a7da817d31afa78d5eeece9941cfd09d46dbd64627cbdc16bb6539ca8",
}
# case -> (methods, (bits, group, symmetric), GPTQ act-order, overrides, tied embeddings)
CASES = {
    "rtn-w4g32": (["rtn"], (4, 32, False), "weight", [], True),
    "rtn-w8pc-sym": (["rtn"], (8, -1, True), "weight", [], True),
    "rtn-w4g32-down8": (["rtn"], (4, 32, False), "weight", [Override("re:.*down_proj", bits=8)], True),
    "gptq-w4g32": (["gptq"], (4, 32, False), "weight", [], True),
    "gptq-w4g32-sym-group": (["gptq"], (4, 32, True), "group", [], True),
    "gptq-untied-lm_head": (["gptq"], (4, 32, False), "weight", [], False),  # lm_head quantized outside the layers
    "awq-w4g32": (["awq"], (4, 32, False), "weight", [], True),
    "awq+gptq-w4g32": (["awq", "gptq"], (4, 32, False), "weight", [], True),
}


def checkpoint_digest(out) -> str:
    h = hashlib.sha256()
    for name, t in sorted(checkpoint.read_tensors(out).items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    h.update(json.dumps(checkpoint.read_config(out)["quantization_config"], sort_keys=True).encode())
    return h.hexdigest()


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoints_from_todays_recipes_stay_bit_identical(tmp_path, case):
    """As the pipeline runs them: calibrated chains read the layers lazily, the plan takes its
    act-order from the rounding method, GPTQ's dampening is pinned (its default may move)."""
    names, (bits, group, symmetric), actorder, overrides, tie = CASES[case]
    source, tok = tiny_llama(hidden=64, layers=2, tie=tie)
    source.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    chain = registry.chain(names)
    settings = {"gptq": GPTQConfig(actorder=actorder, dampening=0.1), "awq": AWQConfig()}
    settings = {m.name: settings[m.name] for m in chain if m.name in settings}
    calibrated = any(m.needs_data for m in chain)
    model, tok, lazy = load_lazily(tmp_path / "model") if calibrated else (*load_float_model(tmp_path / "model"), None)
    rounding = chain[-1]
    scheme = QuantScheme(bits, group, symmetric, rounding.actorder(settings.get(rounding.name, rounding.settings())))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_layers(model, scheme, ["lm_head"] if tie else [], overrides)
    ids = torch.randint(0, source.config.vocab_size, (16, 32), generator=torch.Generator().manual_seed(3))
    quantized, _ = quantize_model(model, plan, names, samples=ids if calibrated else None, scale_dtype=torch.bfloat16,
                                  progress=False, lazy=lazy, **settings)
    out = checkpoint_write.save(model, quantized, tmp_path / "ckpt", tokenizer=tok, dtype=torch.bfloat16)
    assert checkpoint_digest(out) == REFERENCE[case]


# ------------------------------------------------------------------ the registry

def test_method_lists_are_checked_before_any_work():
    assert [m.name for m in registry.chain(["awq"])] == ["awq", "rtn"]  # no rounding method listed: RTN rounds
    assert [m.name for m in registry.chain("awq+gptq")] == ["awq", "gptq"]  # the older one-string form
    for names, message in [
        (["gptq", "rtn"], "rtn cannot follow gptq: gptq rounds the weights, so a second rounding method"),
        (["rtn", "awq"], "awq cannot follow rtn: rtn rounds the weights, so a layer step"),
        (["awq", "awq", "gptq"], "method awq is listed twice"),
        (["awq", "spinquant"], "unknown method 'spinquant'; known methods: awq, gptq, rtn"),
        ([], "expected a non-empty list"),
    ]:
        with pytest.raises(registry.MethodError, match=message):
            registry.chain(names)
    model, _ = tiny_llama(hidden=64, layers=1)
    plan = plan_layers(model, QuantScheme(4, 32), ["lm_head"])
    with pytest.raises(registry.MethodError, match="cannot follow"):  # from the Python API too, before any work
        quantize_model(model, plan, ["gptq", "awq"], samples=torch.zeros(1, 4, dtype=torch.long), progress=False)


def test_settings_must_fit_their_method():
    chain = registry.chain(["awq", "gptq"])
    assert registry.check_settings(chain, {})["gptq"] == GPTQConfig()
    with pytest.raises(registry.MethodError, match="settings for gptq, which the method list \\(awq, rtn\\)"):
        registry.check_settings(registry.chain(["awq"]), {"gptq": GPTQConfig()})
    with pytest.raises(registry.MethodError, match="settings for awq must be a AWQConfig, got GPTQConfig"):
        registry.check_settings(chain, {"awq": GPTQConfig()})


def test_every_method_declares_what_the_pipeline_needs():
    for name, m in registry.REGISTRY.items():
        assert m.name == name and m.stage in registry.STAGES and m.settings() is not None
        assert (m.prepare_layer if m.stage == "layer" else m.round_linear or m.round_layer) is not None
    assert registry.get("rtn").needs_data is False and registry.get("rtn").statistics is None
    assert registry.get("gptq").statistics == "hessian" and registry.get("awq").stage == "layer"


def count_hessians(monkeypatch) -> list:
    import quant.sequential as seq

    calls = []
    real = seq.add_gram
    monkeypatch.setattr(seq, "add_gram", lambda total, x, *a: (calls.append(x.shape), real(total, x, *a)))
    return calls


@pytest.mark.parametrize("names, hessians", [(["awq"], False), (["gptq"], True), (["awq", "gptq"], True)])
def test_the_pipeline_builds_hessians_only_for_a_method_that_reads_them(monkeypatch, names, hessians):
    calls = count_hessians(monkeypatch)
    model, _ = tiny_llama(hidden=64, layers=1)
    plan = plan_layers(model, QuantScheme(4, 32), ["lm_head"])
    ids = torch.randint(0, model.config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
    quantized, stats = quantize_model(model, plan, names, samples=ids, awq=AWQConfig(search_samples=4), progress=False)
    assert set(quantized) == set(plan)
    assert bool(calls) == hessians
    assert all(("output_rel_error" in s) == hessians for s in stats.values())


@dataclass(frozen=True)
class HalfSettings:
    shrink: float = 0.5


def test_a_new_method_is_one_declaration(monkeypatch):
    """A rounding method declared outside the pipeline runs through it: it asks for the Hessian,
    gets each Linear's (square, input-wide), and its settings arrive by its name."""
    from quant import rtn
    from quant.methods import Method

    seen = {}

    def round_linear(weight, scheme, settings, scale_dtype, H, name):
        seen[name] = (tuple(H.shape), settings.shrink)
        return rtn.quantize_weight(weight * settings.shrink, scheme, scale_dtype)

    half = Method("half", HalfSettings, needs_data=True, stage="round", statistics="hessian", round_linear=round_linear)
    monkeypatch.setitem(registry.REGISTRY, "half", half)
    model, _ = tiny_llama(hidden=64, layers=1)
    plan = plan_layers(model, QuantScheme(8, -1, True), ["lm_head"])
    before = {n: model.get_submodule(n).weight.detach().clone() for n in plan}
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    quantized, _ = quantize_model(model, plan, ["awq", "half"], samples=ids, half=HalfSettings(0.25),
                                  awq=AWQConfig(search_samples=4, clip=False), progress=False)
    assert set(seen) == {f"model.layers.0.{n.split('layers.0.')[1]}" for n in plan}
    assert all(shape[0] == shape[1] == model.get_submodule(n).in_features and s == 0.25
               for n, (shape, s) in seen.items())
    down = "model.layers.0.mlp.down_proj"  # AWQ scaled its columns; the method then halved and halved it
    assert quantized[down].dequantize(torch.float32).abs().max() < before[down].abs().max()


# ------------------------------------------------------------------ one home for each family

def test_one_entry_per_supported_family_and_the_runtime_reads_the_same_list():
    import runtime

    assert runtime.SUPPORTED_MODEL_TYPES == architectures.SUPPORTED_MODEL_TYPES
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "phi3", "mixtral", "qwen3_moe",
            "qwen2_moe"} <= set(architectures.SUPPORTED_MODEL_TYPES)
    with pytest.raises(architectures.UnsupportedModelError, match="model_type 'gpt2' is not supported; lowbit runs "
                                                                  "llama, mistral, qwen2, qwen3, gemma2, "):
        architectures.architecture("gpt2")
    with pytest.raises(runtime.UnsupportedModelError, match="'gpt2'"):  # the runtime raises the same error
        runtime.check_supported({"model_type": "gpt2"})


@pytest.mark.parametrize("kind", ["llama", "llama-bias", "qwen2", "qwen2-sliding", "qwen3", "mistral", "mistral-sliding"])
def test_each_family_entry_matches_the_transformers_model(kind):
    """The table's layout, biases, q/k norms and windows are what transformers builds for that family."""
    import runtime
    from tiny import tiny_model

    model, _ = tiny_model(kind)
    config = model.config.to_dict()
    arch = architectures.architecture_of(model)
    prefix, layers = architectures.decoder_layers(model)
    assert prefix == "model.layers" and layers is model.model.layers
    layer = layers[0]
    arch.check_layer(layer)
    attn = layer.self_attn
    assert arch.qkv_bias(config) == (attn.q_proj.bias is not None)
    assert arch.o_bias(config) == (attn.o_proj.bias is not None)
    assert arch.mlp_bias(config) == (layer.mlp.down_proj.bias is not None)
    assert arch.qk_norm == hasattr(attn, "q_norm")
    windows = arch.sliding_windows(config, len(layers))
    assert (8 in windows) == kind.endswith("sliding")  # tiny.py's sliding kinds use windows of 8
    cfg = runtime.check_supported(config)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == architectures.attention_shape(config)
    assert cfg.sliding_windows == windows


def test_kv_cache_and_planner_read_the_attention_shape_as_the_runtime_does():
    from evals import planner
    from kvquant import KVScheme
    from kvquant.hf import QuantizedKVCache
    from tiny import tiny_model

    model, _ = tiny_model("qwen3")  # head_dim set apart from hidden / heads
    config = model.config.to_dict()
    assert architectures.attention_shape(config) == (2, 2, 16) == planner.attention_shape(config)
    cache = QuantizedKVCache(model.config, KVScheme())
    assert len(cache.layers) == 2 and (cache.layers[0].kv_heads, cache.layers[0].head_dim) == (2, 16)
    with pytest.raises(planner.PlanError, match="the config has no 'num_hidden_layers'"):
        planner.attention_shape({"num_attention_heads": 4, "hidden_size": 64})


def test_an_unsupported_model_is_refused_by_name_before_calibration():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).eval()
    plan = {"transformer.h.0.mlp.c_fc": QuantScheme(4, 32)}
    with pytest.raises(architectures.UnsupportedModelError, match="model_type 'gpt2' is not supported"):
        quantize_model(model, plan, ["gptq"], samples=torch.zeros(1, 4, dtype=torch.long), progress=False)


def test_a_recipe_in_either_form_gives_the_same_checkpoint_and_says_its_methods(tmp_path):
    """`method: awq+gptq` (older recipes) and `methods: [awq, gptq]` run the same pipeline; the
    manifest keeps the list and `lowbit inspect` names it."""
    from lowbit import pipeline
    from lowbit.inspection import inspect_text
    from lowbit.recipe_parse import parse_recipe
    from tiny import save_model

    from tiny import TEXT

    model_dir = save_model(*tiny_llama(hidden=64), tmp_path / "model")
    (tmp_path / "text.txt").write_text(TEXT * 10)  # the bundled novels would take longer to tokenize than to quantize
    tensors = {}
    for form, methods in (("old", {"method": "awq+gptq"}), ("new", {"methods": ["awq", "gptq"]})):
        recipe = parse_recipe({"model": str(model_dir), "output": str(tmp_path / form), "dtype": "float32",
                               "calibration": {"text": str(tmp_path / "text.txt"), "samples": 8, "seq_len": 32},
                               "weights": {**methods, "bits": 4, "group_size": 32, "awq": {"search_samples": 4}}})
        out = pipeline.quantize(recipe, device="cpu", progress=False)
        tensors[form] = checkpoint.read_tensors(out)
        manifest = checkpoint.verify(out)
        assert manifest["recipe"]["weights"]["methods"] == ["awq", "gptq"]
        assert manifest["recipe"]["weights"]["awq"]["search_samples"] == 4
        assert "(awq+gptq)" in inspect_text(out)
    assert tensors["old"].keys() == tensors["new"].keys()
    assert all(torch.equal(tensors["old"][k], tensors["new"][k]) for k in tensors["old"])
    assert any(k.endswith("weight_packed") for k in tensors["new"])
