"""llm-compressor's GPTQ and AWQ on lowbit's calibration samples and evaluation tokens.

One row of `bench/calibrated.py`, which runs it in an environment that has
llm-compressor (never a lowbit dependency), with lowbit importable for the
shared samples, protocol and scoring:

    PYTHONPATH=. /tmp/lcvenv/bin/python bench/peers.py gptq [--bits 4]
    PYTHONPATH=. /tmp/lcvenv/bin/python bench/peers.py gptq:dampening=0.1,calibration.bos=false

It quantizes SmolLM2-135M (4-bit, group 64, asymmetric, lm_head kept; the same
128 x 512 tokens lowbit calibrates on, seed 0, begun with the BOS where the
tokenizer adds one, as lowbit's are; ``calibration.bos`` forces either way), times the whole job (loading, calibrating, quantizing), scores
the result on the texts and protocols of `bench/scoring.py` and prints one JSON
line. ``dampening`` sets GPTQ's (llm-compressor's default is 0.01).

It also scores any saved checkpoint as an outside user would, loaded by
transformers and compressed-tensors (lowbit's loader not involved), in the
dtype the checkpoint names or in float32:

    PYTHONPATH=. /tmp/lcvenv/bin/python bench/peers.py --score-checkpoint DIR [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import yaml

from bench.scoring import TEXTS, parse_texts, peak_rss_bytes, score_texts
from evals.perplexity import hf_logits_fn
from quant.calibration import calibration_samples, load_calibration_text
from quant.models import resolve

SCHEME = {"type": "int", "symmetric": False, "strategy": "group", "group_size": 64}
METHODS = ("gptq", "awq", "awq+gptq")
SETTINGS = ("dampening", "calibration.bos")


def parse_method(spec: str) -> tuple[str, dict]:
    """``gptq:dampening=0.1,calibration.bos=false`` -> ("gptq", {"dampening": 0.1, "calibration.bos": False})."""
    name, _, options = spec.partition(":")
    settings = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in options.split(",") if o)}
    if name not in METHODS or set(settings) - set(SETTINGS):
        raise SystemExit(f"{spec}: methods are {', '.join(METHODS)}, settings {', '.join(SETTINGS)}")
    return name, settings


def recipe_for(method: str, bits: int, settings: dict):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    groups = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": bits, **SCHEME}}}
    gptq = {"dampening_frac": settings["dampening"]} if "dampening" in settings else {}
    if method == "gptq":
        return [GPTQModifier(config_groups=groups, ignore=["lm_head"], **gptq)]
    if method == "awq":
        return [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    return [AWQModifier(), GPTQModifier(config_groups=groups, ignore=["lm_head"], **gptq)]


def allow_cpu_only():
    """llm-compressor 0.14's AWQ pins its cached activations for faster host-to-GPU copies,
    which raises on a machine without an accelerator. Pinning changes no value, so on such a
    machine skip it: the peer then runs on CPU exactly as it would otherwise compute."""
    if torch.cuda.is_available():
        return
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None


def score_checkpoint(path: str, dtype: str, texts: dict[str, int]) -> dict:
    """Perplexity of a saved checkpoint through transformers + compressed-tensors."""
    import compressed_tensors
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto" if dtype == "auto" else getattr(torch, dtype))
    loaded_as = str(next(model.parameters()).dtype).removeprefix("torch.")
    return {"tool": f"transformers {transformers.__version__} + compressed-tensors {compressed_tensors.__version__}",
            "checkpoint": path, "dtype": loaded_as, "torch": torch.__version__,
            "scores": score_texts(hf_logits_fn(model), AutoTokenizer.from_pretrained(path), texts)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("method", nargs="?", help="gptq, awq or awq+gptq, with optional settings: gptq:dampening=0.1")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--texts", nargs="*", default=[f"{t}={n}" for t, n in TEXTS.items()])
    ap.add_argument("--score-checkpoint", metavar="DIR", help="Score this checkpoint instead of quantizing.")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = ap.parse_args()
    if args.score_checkpoint:
        print(json.dumps(score_checkpoint(args.score_checkpoint, args.dtype, parse_texts(args.texts))))
        return
    if not args.method:
        ap.error("give a method, or --score-checkpoint DIR")
    method, settings = parse_method(args.method)

    import datasets
    import llmcompressor
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    allow_cpu_only()
    source = resolve("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(source)
    samples = calibration_samples(tokenizer, load_calibration_text("default"), 128, 512, seed=0,
                                  bos=settings.get("calibration.bos"))
    ds = datasets.Dataset.from_dict({"input_ids": samples.tolist(), "attention_mask": torch.ones_like(samples).tolist()})

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    oneshot(model=model, dataset=ds, recipe=recipe_for(method, args.bits, settings), max_seq_length=512,
            num_calibration_samples=128)
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    scores = score_texts(hf_logits_fn(model), tokenizer, parse_texts(args.texts))
    row = {"tool": f"llm-compressor {llmcompressor.__version__}", "method": args.method, "bits": args.bits,
           "quantize_s": seconds, "peak_rss_bytes": peak, "scores": scores, "torch": torch.__version__}
    print(json.dumps(row))


if __name__ == "__main__":
    main()
