"""Speed by phase and the diagnosis, on a tiny random model (CPU): what is timed, what is counted, what is said."""

import json

import pytest
import torch

import runtime
from evals import diagnose as dg
from evals import speed
from kvquant import KVScheme
from kvquant.memory import stored_bytes
from cli_runner import run


@pytest.fixture(scope="module")
def model(model_dir):
    return runtime.load(model_dir)


def test_the_timed_loop_generates_what_the_runtime_generates(model):
    """The timings are of real work: batched greedy decoding gives each sequence Model.generate's tokens."""
    prompts = speed.random_prompts(model, speed.Workload(12, 6, 2))
    ttft, itls, ids = speed.run_request(model, prompts, 6)
    assert ttft > 0 and len(itls) == 5 and all(t > 0 for t in itls)
    for row in range(2):
        gen = model.generate(prompts[row].tolist(), max_new_tokens=6, stop_at_eos=False)
        list(gen)
        assert ids[row].tolist() == gen.ids


def test_measure_reports_consistent_rates(model):
    t = speed.measure(model, speed.Workload(16, 5, 3), repeats=2)
    assert t.prefill_tokens_per_s == pytest.approx(3 * 16 / t.ttft_s)
    assert t.decode_tokens_per_s == pytest.approx(3 / t.itl_s)
    assert t.kv == "fp16" and t.repeats == 2
    weights = sum(p.numel() * p.element_size() for p in model.decoder.parameters())
    assert t.peak_memory_bytes > weights  # the process's peak resident set holds at least the weights
    d = t.to_dict()
    assert {"batch", "prompt_len", "output_len", "ttft_s", "itl_s", "prefill_tokens_per_s", "decode_tokens_per_s"} <= d.keys()


def test_a_workload_longer_than_the_context_is_refused(model):
    with pytest.raises(ValueError, match="exceed the model's context"):
        speed.measure(model, speed.Workload(500, 100))
    with pytest.raises(ValueError, match="at least 1"):
        speed.Workload(0, 4)


def test_prefill_flops_count_every_matmul_and_the_causal_triangle(model):
    cfg = model.decoder.cfg
    weights = sum(p.numel() for n, p in model.decoder.named_parameters() if p.ndim == 2 and "embed" not in n)
    weights += cfg.vocab_size * cfg.hidden_size  # the tied head multiplies by the embedding
    flops = dg.prefill_flops(model, 2, 10)
    attention = 2 * cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * (10 * 11 // 2)
    assert flops["linear"] == 2 * 2 * 10 * weights
    assert flops["attention"] == attention
    assert flops["total"] == flops["linear"] + attention


def test_decode_bytes_count_weights_as_held_and_the_cache_read(model):
    w_bytes, held = dg.weight_bytes_per_step(model, batch=1)
    cfg = model.decoder.cfg
    params = sum(p.numel() * p.element_size() for p in model.decoder.parameters())  # the tied head once
    embed = cfg.vocab_size * cfg.hidden_size * 4
    # every weight once; of the embedding only one row, but the tied head reads all of it
    assert w_bytes == params - embed + cfg.hidden_size * 4 + embed
    scheme = KVScheme(bits=8)
    kv = dg.kv_bytes_per_step(model, scheme, 2, prompt_len=100, output_len=3)
    per_step = [stored_bytes(scheme, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, c, model.dtype) for c in (100, 101)]
    assert kv == pytest.approx(2 * sum(per_step) / 2)


def test_ceilings_are_measured(model):
    c = dg.measure_ceilings("cpu")
    assert c["copy_bytes_per_s"] > 1e8 and c["matmul_flops_per_s"] > 1e8
    assert "matmul" in c["method"]


def test_diagnosis_names_the_dominant_phase_and_a_lever(model):
    ceilings = {"copy_bytes_per_s": 1e10, "matmul_flops_per_s": 1e10, "method": "given"}
    long_output = dg.diagnose(model, speed.Workload(4, 40), ceilings=ceilings)
    assert long_output["dominant_phase"] == "decode"
    assert long_output["decode"]["seconds"] > long_output["prefill"]["seconds"]
    assert "decode takes" in long_output["advice"][0] and "decode step reads" in long_output["advice"][1]
    prompt_only = dg.diagnose(model, speed.Workload(64, 1), ceilings=ceilings)
    assert prompt_only["dominant_phase"] == "prefill"
    assert "prefill takes 100%" in prompt_only["advice"][0] and "GFLOP" in prompt_only["advice"][1]
    assert "shorter prompt" in " ".join(prompt_only["advice"])


def test_decode_advice_follows_the_bytes():
    """The lever named is the one the numbers point to: weights, the KV cache, or per-step overhead."""
    cfg = type("Cfg", (), {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64})()
    fake_model = type("M", (), {"decoder": type("D", (), {"cfg": cfg})()})()
    base = {"weights_held_as": "weights as stored"}
    weights = dg._decode_advice({**base, "weight_bytes_per_step": 9e8, "kv_bytes_per_step": 1e8,
                                 "achieved_bytes_per_s": 8e9, "fraction_of_copy_ceiling": 0.8}, {}, fake_model)
    assert "fewer weight bits" in weights[1] and "larger batch" in weights[1]
    kv = dg._decode_advice({**base, "weight_bytes_per_step": 1e8, "kv_bytes_per_step": 9e8,
                            "achieved_bytes_per_s": 8e9, "fraction_of_copy_ceiling": 0.8}, {}, fake_model)
    assert "fewer KV bits" in kv[1] and "int4 0.28x" in kv[1]
    overhead = dg._decode_advice({**base, "weight_bytes_per_step": 1e8, "kv_bytes_per_step": 1e8,
                                  "achieved_bytes_per_s": 1e8, "fraction_of_copy_ceiling": 0.05}, {}, fake_model)
    assert "overhead" in overhead[1]


def test_speed_and_diagnose_commands_write_json_with_provenance(model_dir, tmp_path):
    out = tmp_path / "speed.json"
    result = run("speed", model_dir, "--batch", "1,2", "--prompt-len", "8", "--output-len", "3", "--kv", "int8",
                 "--json", out)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [(r["batch"], r["kv"]) for r in data["rows"]] == [(1, "int8"), (2, "int8")]
    assert data["device"]["type"] == "cpu" and data["commit"] and data["versions"]["torch"]
    out = tmp_path / "diag.json"
    result = run("diagnose", model_dir, "--prompt-len", "16", "--output-len", "4", "--json", out)
    assert result.exit_code == 0, result.output
    assert "ceilings: copy" in result.output and "takes" in result.output
    data = json.loads(out.read_text())
    assert data["dominant_phase"] in ("prefill", "decode") and data["ceilings"]["matmul_flops_per_s"] > 0
    assert data["device"]["type"] == "cpu" and data["commit"] and "greedy decode" in data["protocol"]
    result = run("speed", model_dir, "--batch", "0")
    assert result.exit_code != 0 and "positive integers" in result.output
