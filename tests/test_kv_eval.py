"""The transformers KV cache, the runtime with a quantized cache, KV-perplexity and KV memory."""

from __future__ import annotations

import pytest
import torch

import runtime
from bench.kv import hf_session
from bench.kv_memory import ModelShape, capacity_table, memory_row
from evals.kv import ChunkProtocol, kv_perplexity, runtime_session
from evals.perplexity import Protocol, perplexity
from kvquant import KVScheme, parse_kv
from kvquant.hf import QuantizedKVCache
from tests.cli_runner import run
from tests.tiny import TEXT, save_model, tiny_llama

INT4 = parse_kv("int4-g16-r32")  # the tiny model's heads have 32 channels
INT2 = parse_kv("int2-g16-r32")


@pytest.fixture(scope="module")
def tiny():
    model, tok = tiny_llama(hidden=128, layers=2)  # 4 heads of 32, 2 KV heads
    return model, tok


@pytest.fixture(scope="module")
def tiny_dir(tiny, tmp_path_factory):
    return save_model(*tiny, tmp_path_factory.mktemp("kv") / "m")


@pytest.fixture(scope="module")
def ids(tiny):
    return torch.tensor(tiny[1](TEXT).input_ids)[:180]


PROTOCOL = Protocol(window=96, stride=48, tokens=180)


def test_kv_perplexity_with_an_unquantized_cache_is_the_ordinary_perplexity(tiny_dir, ids):
    rt = runtime.load(tiny_dir)
    plain = perplexity(rt.logits, ids, PROTOCOL, progress=False)
    through_cache = kv_perplexity(runtime_session(rt, KVScheme()), ids, PROTOCOL, ChunkProtocol(chunk=5),
                                  progress=False)
    assert through_cache.tokens_scored == plain.tokens_scored == 179
    assert through_cache.ppl == pytest.approx(plain.ppl, rel=1e-5)


def test_quantized_caches_cost_perplexity_in_order_of_bits(tiny_dir, ids):
    rt = runtime.load(tiny_dir)
    ppl = {name: kv_perplexity(runtime_session(rt, scheme), ids, PROTOCOL, ChunkProtocol(chunk=7), progress=False).ppl
           for name, scheme in [("fp16", KVScheme()), ("int8", parse_kv("int8-r32")), ("int4", INT4), ("int2", INT2)]}
    # Attention really reads the quantized keys and values: every scheme moves the number,
    # and fewer bits move it more.
    assert ppl["int8"] != ppl["fp16"]
    assert abs(ppl["int8"] / ppl["fp16"] - 1) < abs(ppl["int4"] / ppl["fp16"] - 1) < abs(ppl["int2"] / ppl["fp16"] - 1)
    assert abs(ppl["int8"] / ppl["fp16"] - 1) < 1e-3


def test_transformers_cache_reads_what_the_runtime_cache_reads(tiny, tiny_dir, ids):
    model, _ = tiny
    rt = runtime.load(tiny_dir)
    x = ids[None, :100]
    for scheme in (KVScheme(), INT4, parse_kv("fp8-r32"), parse_kv("k4v2-g16-r32")):
        ours = runtime_session(rt, scheme)(100)
        theirs = hf_session(model, lambda s=scheme: QuantizedKVCache(model.config, s))(100)
        for a, b in [(0, 40), (40, 41), (41, 77), (77, 100)]:  # blocks of 32 fill inside chunks
            torch.testing.assert_close(theirs(x[:, a:b]).float(), ours(x[:, a:b]).float(), atol=2e-4, rtol=1e-4)


def test_generate_with_the_transformers_cache(tiny):
    model, tok = tiny
    prompt = tok("Anne Elliot walked", return_tensors="pt").input_ids
    args = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=tok.eos_token_id)
    plain = model.generate(prompt, **args)
    cache = QuantizedKVCache(model.config, KVScheme(residual=16))
    assert torch.equal(model.generate(prompt, past_key_values=cache, **args), plain)
    assert cache.get_seq_length() == plain.shape[1] - 1  # the last token is never fed back
    cache = QuantizedKVCache(model.config, INT4)
    out = model.generate(prompt, past_key_values=cache, **args)
    assert out.shape == plain.shape
    quantized = cache.layers[0].quantized_keys
    assert quantized.data.dtype == torch.int32 and quantized.data.shape[1] == (plain.shape[1] - 1) // 32


def test_transformers_cache_refuses_another_models_states(tiny):
    model, _ = tiny
    other, _ = tiny_llama(hidden=128, layers=3, num_key_value_heads=4)
    cache = QuantizedKVCache(model.config, INT4)
    x = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="2 KV heads x head_dim 32.*different shapes"):
        other(x, past_key_values=cache, use_cache=True)
    deeper, _ = tiny_llama(hidden=128, layers=3)
    with pytest.raises(ValueError, match="model of 2 layers, got layer 2"):
        deeper(x, past_key_values=QuantizedKVCache(model.config, INT4), use_cache=True)
    with pytest.raises(ValueError, match="does not divide head_dim 32"):
        QuantizedKVCache(model.config, parse_kv("int4"))


def test_runtime_load_takes_a_kv_scheme_and_generates_with_it(tiny_dir):
    rt = runtime.load(tiny_dir, kv="int4-g16-r32")
    assert rt.kv_scheme == INT4
    assert len(list(rt.generate("Anne", max_new_tokens=40, stop_at_eos=False))) == 40
    assert runtime.load(tiny_dir).kv_scheme == KVScheme()
    with pytest.raises(ValueError, match="does not divide head_dim 32"):
        runtime.load(tiny_dir, kv="int4-g64")


def test_memory_is_measured_on_allocated_caches():
    shape = ModelShape(num_layers=30, kv_heads=3, head_dim=64)  # SmolLM2-135M
    row = memory_row(parse_kv("int4"), shape, context=2048)
    assert row["vs_fp16"] <= 0.3
    assert row["bytes_per_token"] < row["measured_bytes_per_token"] < 1.1 * row["bytes_per_token"] + 30 * 3 * 2 * 128 * 64 * 2 / 2048
    schemes = [KVScheme(), parse_kv("int8"), parse_kv("int4")]
    rows = capacity_table(schemes, shape, budget_bytes=64 << 20, contexts=[1024])
    fits = {r["scheme"]: r for r in rows}
    assert fits["fp16"]["sequences"] == 2  # 23040 B/token x 1024 tokens (+ a residual block) per sequence
    assert fits["int4-g64-r128"]["sequences"] >= 3 * fits["fp16"]["sequences"]
    for r in rows:
        assert r["measured_bytes"] <= r["budget_bytes"] < r["measured_bytes"] + r["bytes_per_sequence"]


# ------------------------------------------------------------- recipe and CLI


def kv_recipe(path, model_dir, **kv_cache):
    import yaml

    path.write_text(yaml.safe_dump({
        "model": str(model_dir), "output": str(path.parent / "ckpt"), "dtype": "float32",
        "weights": {"method": "rtn", "bits": 8, "group_size": -1, "symmetric": True},
        "kv_cache": kv_cache,
    }))
    return path


@pytest.fixture(scope="module")
def kv_ckpt(tiny_dir, tmp_path_factory):
    recipe = kv_recipe(tmp_path_factory.mktemp("q") / "r.yaml", tiny_dir, bits=4, group_size=16, residual=32)
    result = run("quantize", recipe)
    assert result.exit_code == 0, result.output
    return recipe.parent / "ckpt"


def test_the_recipes_kv_scheme_is_saved_and_used_by_default(kv_ckpt):
    import json

    manifest = json.loads((kv_ckpt / "lowbit_manifest.json").read_text())
    assert manifest["kv_cache"] == {"bits": 4, "type": "int", "group_size": 16, "residual": 32, "value_bits": 4,
                                    "family": "kivi"}
    assert runtime.load(kv_ckpt).kv_scheme == INT4
    assert runtime.load(kv_ckpt, kv="int2").kv_scheme == INT2  # a name keeps the saved group and residual
    assert runtime.load(kv_ckpt, kv="fp16").kv_scheme == KVScheme(group_size=16, residual=32)


def test_eval_reports_kv_perplexity_next_to_the_fp16_cache(kv_ckpt, tmp_path, monkeypatch):
    import json

    # the fp16 cache's perplexity against the plain one at float32 precision: the reference Linears (the CPU
    # kernels' bf16 rounding differs between the cache's 8-row chunks and the 64-row windows)
    monkeypatch.setenv("LOWBIT_DISABLE", "cpu")
    out = tmp_path / "r.json"
    args = ["eval", kv_ckpt, "--no-baseline", "--tokens", 150, "--window", 64, "--stride", 32, "--kv-chunk", 8]
    result = run(*args, "--json", out)
    assert result.exit_code == 0, result.output
    r = json.loads(out.read_text())
    assert r["kv_cache"]["name"] == "int4-g16-r32"
    assert r["kv_baseline_ppl"] == pytest.approx(r["ppl"], rel=1e-5)  # the fp16 cache reproduces perplexity
    assert r["kv_ppl"] != r["kv_baseline_ppl"]
    assert r["kv_delta_ppl_pct"] == pytest.approx(100 * (r["kv_ppl"] / r["kv_baseline_ppl"] - 1))
    assert r["kv_bytes_per_token"] < 0.5 * r["kv_baseline_bytes_per_token"]
    assert "chunks of 8" in r["kv_protocol"]["description"] and "int4-g16-r32" in result.output
    result = run(*args, "--kv", "fp16", "--json", out)
    assert result.exit_code == 0 and json.loads(out.read_text())["kv_ppl"] is None


def test_generate_takes_a_kv_scheme(kv_ckpt):
    result = run("generate", kv_ckpt, "--prompt", "Anne", "--max-new-tokens", 40, "--kv", "int2")
    assert result.exit_code == 0, result.output
    assert "KV cache int2-g16-r32" in result.output


def test_bad_kv_settings_are_clear_errors(kv_ckpt, tiny_dir, tmp_path):
    result = run("generate", kv_ckpt, "--prompt", "Anne", "--kv", "int3")
    assert result.exit_code != 0 and "unknown KV cache scheme 'int3'" in result.output
    result = run("quantize", kv_recipe(tmp_path / "r.yaml", tiny_dir, bits=3))
    assert result.exit_code != 0 and "kv_cache.bits: must be one of 16, 8, 4, 2" in result.output
    result = run("quantize", kv_recipe(tmp_path / "r.yaml", tiny_dir, bits=4, residual=100))
    assert result.exit_code != 0 and "kv_cache: KV cache residual 100 is not a multiple of group_size 64" in result.output
    result = run("quantize", kv_recipe(tmp_path / "r.yaml", tiny_dir, bits=4, gruop_size=16))
    assert result.exit_code != 0 and "kv_cache.gruop_size: unknown key (did you mean 'group_size'?)" in result.output
    result = run("quantize", kv_recipe(tmp_path / "r.yaml", tiny_dir, bits=2))  # group 64, heads of 32
    assert result.exit_code != 0 and "kv_cache: KV cache group_size 64 does not divide head_dim 32" in result.output
