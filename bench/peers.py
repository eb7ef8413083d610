"""llm-compressor's GPTQ and AWQ on lowbit's calibration samples and evaluation tokens.

Runs in a separate environment that has llm-compressor (never a lowbit
dependency), with lowbit importable for the shared samples, protocol and scoring:

    python -m venv /tmp/lcvenv && /tmp/lcvenv/bin/pip install torch==2.13.0 'llmcompressor==0.14.*'
    PYTHONPATH=. /tmp/lcvenv/bin/python bench/peers.py gptq --out bench/results/peer-llmc-gptq.json

It quantizes SmolLM2-135M (4-bit, group 64, asymmetric, lm_head kept; the same
128 x 512 tokens lowbit calibrates on, seed 0), times the whole call, and scores
the result with lowbit's perplexity protocol on the same tokens. The lowbit
side is `bench/calibrated.py`; the two print one table together.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

from evals.perplexity import Protocol, hf_logits_fn, perplexity, tokenize_text
from evals.texts import load_text
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("method", choices=["gptq", "awq", "awq+gptq"])
    ap.add_argument("--tokens", type=int, default=Protocol().tokens)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import datasets
    import llmcompressor
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(source)
    samples = calibration_samples(tokenizer, load_calibration_text("default"), 128, 512, seed=0)
    ds = datasets.Dataset.from_dict({"input_ids": samples.tolist(), "attention_mask": torch.ones_like(samples).tolist()})

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    oneshot(model=model, dataset=ds, recipe=recipe_for(args.method), max_seq_length=512, num_calibration_samples=128)
    seconds = time.perf_counter() - start
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    protocol = Protocol(tokens=args.tokens)
    ids = tokenize_text(tokenizer, load_text("default"), protocol)
    ppl = perplexity(hf_logits_fn(model), ids, protocol, progress=False).ppl
    result = {"tool": f"llm-compressor {llmcompressor.__version__}", "method": args.method, "ppl": ppl,
              "quantize_s": seconds, "peak_rss_bytes": peak_rss, "protocol": protocol.describe(),
              "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
