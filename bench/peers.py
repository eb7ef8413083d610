"""llm-compressor's GPTQ and AWQ on lowbit's calibration samples and evaluation tokens.

One row of `bench/calibrated.py`, which runs it in an environment that has
llm-compressor (never a lowbit dependency), with lowbit importable for the
shared samples, protocol and scoring:

    PYTHONPATH=. /tmp/lcvenv/bin/python bench/peers.py gptq

It quantizes SmolLM2-135M (4-bit, group 64, asymmetric, lm_head kept; the same
128 x 512 tokens lowbit calibrates on, seed 0), times the whole job (loading,
calibrating, quantizing), scores the result on the texts of `bench/scoring.py`
and prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.scoring import peak_rss_bytes, score_texts
from evals.perplexity import hf_logits_fn
from quant.calibration import calibration_samples, load_calibration_text
from quant.models import resolve

SCHEME = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64}


def recipe_for(method: str):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    groups = {"group_0": {"targets": ["Linear"], "weights": SCHEME}}
    if method == "gptq":
        return [GPTQModifier(config_groups=groups, ignore=["lm_head"])]
    if method == "awq":
        return [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    if method == "awq+gptq":
        return [AWQModifier(), GPTQModifier(config_groups=groups, ignore=["lm_head"])]
    raise SystemExit(f"unknown method {method}")


def allow_cpu_only():
    """llm-compressor 0.14's AWQ pins its cached activations for faster host-to-GPU copies,
    which raises on a machine without an accelerator. Pinning changes no value, so on such a
    machine skip it: the peer then runs on CPU exactly as it would otherwise compute."""
    if torch.cuda.is_available():
        return
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("method", choices=["gptq", "awq", "awq+gptq"])
    args = ap.parse_args()

    import datasets
    import llmcompressor
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    allow_cpu_only()
    source = resolve("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(source)
    samples = calibration_samples(tokenizer, load_calibration_text("default"), 128, 512, seed=0)
    ds = datasets.Dataset.from_dict({"input_ids": samples.tolist(), "attention_mask": torch.ones_like(samples).tolist()})

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    oneshot(model=model, dataset=ds, recipe=recipe_for(args.method), max_seq_length=512, num_calibration_samples=128)
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    row = {"tool": f"llm-compressor {llmcompressor.__version__}", "method": args.method, "quantize_s": seconds,
           "peak_rss_bytes": peak, "texts": score_texts(hf_logits_fn(model), tokenizer), "torch": torch.__version__}
    print(json.dumps(row))


if __name__ == "__main__":
    main()
