"""The memory planner: KV bytes as the runtime allocates them, weights from headers or config, the CLI."""

import json

import pytest
import torch

from evals import planner
from kvquant import KVScheme, parse_kv
from kvquant.memory import max_tokens, sequence_bytes
from runtime.cache import KVCache
from cli_runner import run
from tiny import save_model, tiny_llama

SCHEMES = ["fp16", "int8", "int4-g32-r64", "int2-g32-r64", "fp8"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model, tokenizer = tiny_llama(hidden=128)  # 4 heads of 32 channels, 2 KV heads
    return save_model(model, tokenizer, tmp_path_factory.mktemp("plan") / "tiny")


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("tokens", [1, 63, 64, 200])
def test_sequence_bytes_are_what_the_runtime_cache_allocates(name, tokens):
    scheme = parse_kv(name)
    cache = KVCache(3, 1, 2, 32, tokens, torch.float16, "cpu", scheme=scheme)
    table = cache.block_table.numel() * cache.block_table.element_size()
    assert sequence_bytes(scheme, 3, 2, 32, tokens, torch.float16) == cache.nbytes() - table


@pytest.mark.parametrize("name", SCHEMES)
def test_max_tokens_is_the_longest_context_that_fits(name):
    scheme = parse_kv(name)
    budget = 1_000_000
    n = max_tokens(scheme, 3, 2, 32, budget)
    assert n > 0 and sequence_bytes(scheme, 3, 2, 32, n) <= budget < sequence_bytes(scheme, 3, 2, 32, n + 1)
    assert max_tokens(scheme, 3, 2, 32, 10) == 0  # not even the residual block fits


def test_memory_sizes_read_decimal_and_binary_units():
    assert planner.parse_memory("24GB") == 24 * 10**9
    assert planner.parse_memory("24GiB") == 24 * 2**30
    assert planner.parse_memory("1.5 mb") == 1_500_000
    assert planner.parse_memory("4096") == 4096
    with pytest.raises(planner.PlanError, match="24GiB"):
        planner.parse_memory("24 gigs")


def test_config_estimate_matches_the_stored_weights(model_dir, tmp_path):
    """Without safetensors the weights come from the config: for a float Llama they must be exact."""
    config = json.loads((model_dir / "config.json").read_text())
    estimated, source = planner.config_weight_bytes(config)
    assert estimated == planner.safetensors_weight_bytes(model_dir)
    assert "config" in source


def test_plan_fits_more_sequences_with_fewer_kv_bits(model_dir):
    budget = planner.safetensors_weight_bytes(model_dir) + 5_000_000
    p = planner.plan(str(model_dir), budget, 256, SCHEMES)
    rows = {r["scheme"]: r for r in p["schemes"]}
    assert p["weights"]["source"] == "safetensors headers"
    seqs = [rows[s]["max_sequences"] for s in ("fp16", "int8", "int4-g32-r64", "int2-g32-r64")]
    assert seqs == sorted(seqs) and seqs[0] < seqs[-1]
    for r in rows.values():
        scheme = parse_kv(r["scheme"])
        per_seq = sequence_bytes(scheme, 2, 2, 32, 256)
        # the counts are exact: one more sequence, or a longer context, would not fit
        assert r["max_sequences"] * per_seq <= p["free_for_kv_bytes"] < (r["max_sequences"] + 1) * per_seq
        assert sequence_bytes(scheme, 2, 2, 32, r["max_context"]) <= p["free_for_kv_bytes"]


def test_a_scheme_the_heads_cannot_take_is_named_not_planned(model_dir):
    p = planner.plan(str(model_dir), 10**9, 128, ["int4-g64"])  # head_dim 32
    assert "group_size 64 does not divide head_dim 32" in p["schemes"][0]["error"]


def test_plan_command_prints_and_writes_json(model_dir, tmp_path):
    out = tmp_path / "plan.json"
    result = run("plan", model_dir, "--memory", "64MB", "--context", "300", "--json", out)
    assert result.exit_code == 0, result.output
    assert "int4" in result.output and "longest sequence" in result.output
    data = json.loads(out.read_text())
    assert data["commit"] and data["versions"]["lowbit"]
    assert [r["scheme"] for r in data["schemes"]] == ["fp16", "int8", "int4-g64-r128", "int2-g64-r128", "fp8",
                                                      "k8v4-g64-r128", "k4v2-g64-r128"]  # every family's listed names
    int8 = next(r for r in data["schemes"] if r["scheme"] == "int8")
    assert {"kv_bytes_per_token", "max_sequences", "max_context"} <= int8.keys()
    # 64 MB holds far more than the tiny model's 512 positions: the longest sequence is the model's limit
    assert int8["max_context"] == 512 < int8["max_context_memory"]
    assert "512*" in result.output and "at most 512 positions" in result.output and "--reserve" in result.output


def test_plan_from_a_bare_config_quantized(tmp_path, model_dir):
    """A config alone (no weights): a compressed-tensors 4-bit config is planned at about 4 bits per Linear weight."""
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"config_groups": {"group_0": {"weights": {
        "num_bits": 4, "group_size": 32, "symmetric": True}}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    float_bytes, _ = planner.config_weight_bytes({k: v for k, v in config.items() if k != "quantization_config"})
    q_bytes, source = planner.config_weight_bytes(config)
    assert "4-bit g32" in source and q_bytes < float_bytes / 2
    result = run("plan", tmp_path / "config.json", "--memory", "1GB")
    assert result.exit_code == 0, result.output
    assert "estimated from the config" in result.output


def test_plan_bad_input_fails_clearly(tmp_path):
    result = run("plan", tmp_path, "--memory", "1GB")
    assert result.exit_code != 0 and "no config.json" in result.output
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    result = run("plan", tmp_path, "--memory", "1GB")
    assert result.exit_code != 0 and "num_hidden_layers" in result.output
    result = run("plan", tmp_path, "--memory", "lots")
    assert result.exit_code != 0 and "cannot read memory size" in result.output
