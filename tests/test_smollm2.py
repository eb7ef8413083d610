"""End to end on the real default model, SmolLM2-135M (converted once from the bundled GGUF)."""

import pytest
import torch

import runtime
from evals.perplexity import Protocol
from lowbit import pipeline
from lowbit.recipe_parse import parse_recipe
from quant import models

pytestmark = pytest.mark.slow
PROTOCOL = Protocol(window=512, stride=256, tokens=2048)


@pytest.fixture(scope="module")
def smollm2():
    try:
        return models.resolve("smollm2-135m")
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_runtime_matches_transformers_on_the_real_model(smollm2):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ours = runtime.load(smollm2)
    ids = ours.tokenizer("Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(ours.logits(ids), expected, atol=2e-3, rtol=1e-3)
    assert ours.logits(ids)[0, -1].argmax() == expected[0, -1].argmax()


def quantize_and_eval(tmp_path, **weights):
    recipe = parse_recipe({"model": "smollm2-135m", "output": str(tmp_path / "ckpt"), "dtype": "bfloat16",
                           "weights": {"method": "rtn", **weights}})
    ckpt = pipeline.quantize(recipe, progress=False)
    return pipeline.evaluate(str(ckpt), protocol=PROTOCOL, progress=False)


def test_rtn_8bit_is_within_half_a_percent(smollm2, tmp_path):
    r = quantize_and_eval(tmp_path, bits=8, group_size=-1, symmetric=True)
    assert r["baseline"] == "smollm2-135m" and r["tokens"] == 2048
    assert abs(r["delta_ppl_pct"]) < 0.5, r
    assert 8.0 < r["bits_per_weight"] < 8.1


def test_rtn_4bit_group64_costs_perplexity_and_saves_bytes(smollm2, tmp_path):
    r = quantize_and_eval(tmp_path, bits=4, group_size=64, symmetric=False)
    assert 5 < r["delta_ppl_pct"] < 60, r  # RTN 4-bit loses a clear, bounded amount on a 135M model
    assert abs(r["bits_per_weight"] - (4 + 16 / 64 + 4 / 64)) < 1e-6  # bf16 scale + 4-bit zero per 64
    assert r["bytes_on_disk"] < 0.3 * r["baseline_bytes_on_disk"]
    from runtime.selfcheck import kernel_table

    model = runtime.load(tmp_path / "ckpt")  # what lowbit doctor reports: every W4 Linear on the CPU kernel
    rows = [row for row in kernel_table(model.decoder, model.dtype) if row["kernel"] == "quant_matmul"]
    assert rows and all(row["runs"] == "cpu-int4" for row in rows), rows
