"""llm-compressor's GPTQ and AWQ, and Intel's AutoRound, on lowbit's calibration samples and
evaluation tokens.

One row of `bench/calibrated.py`, which runs it in an environment that has
llm-compressor (never a lowbit dependency), with lowbit importable for the
shared samples, protocol and scoring:

    /tmp/lcvenv/bin/python -m bench.peers gptq [--bits 4]
    /tmp/lcvenv/bin/python -m bench.peers gptq:dampening=0.1,calibration.bos=false

It quantizes SmolLM2-135M (4-bit, group 64 (``--group``), asymmetric, lm_head kept; the same
128 x 512 tokens lowbit calibrates on, seed 0, begun with the BOS where the
tokenizer adds one, as lowbit's are; ``calibration.bos`` forces either way), times the whole job (loading, calibrating, quantizing), scores
the result on the texts and protocols of `bench/scoring.py` and prints one JSON
line. ``dampening`` sets GPTQ's (llm-compressor's default is 0.01).

``autoround`` runs Intel's ``auto-round`` package (its SignRound algorithm, on CPU) on the
same windows: ``autoround:iters=50,batch_size=4,calibration.samples=32`` (its defaults: 200
iterations, batch 8, lr 1/iters; ``calibration.samples`` / ``calibration.seq_len`` cut the
windows on a busy machine, as lowbit's recipe does). Its fake-quantized model is scored.

It also scores any saved checkpoint as an outside user would, loaded by
transformers and compressed-tensors (lowbit's loader not involved), in the
dtype the checkpoint names or in float32:

    /tmp/lcvenv/bin/python -m bench.peers --score-checkpoint DIR [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import yaml

from bench.scoring import TEXTS, parse_texts, peak_rss_bytes, score_texts
from evals.perplexity import hf_logits_fn
from quant.calibration import calibration_samples, load_calibration_text
from quant.models import resolve

SCHEME = {"type": "int", "symmetric": False, "strategy": "group"}
METHODS = ("gptq", "awq", "awq+gptq", "autoround")
SETTINGS = ("dampening", "calibration.bos", "calibration.samples", "calibration.seq_len", "iters", "batch_size",
            "lr", "seed")


def parse_method(spec: str) -> tuple[str, dict]:
    """``gptq:dampening=0.1,calibration.bos=false`` -> ("gptq", {"dampening": 0.1, "calibration.bos": False})."""
    name, _, options = spec.partition(":")
    settings = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in options.split(",") if o)}
    if name not in METHODS or set(settings) - set(SETTINGS):
        raise SystemExit(f"{spec}: methods are {', '.join(METHODS)}, settings {', '.join(SETTINGS)}")
    return name, settings


def recipe_for(method: str, bits: int, group: int, settings: dict):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    groups = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": bits, "group_size": group, **SCHEME}}}
    gptq = {"dampening_frac": settings["dampening"]} if "dampening" in settings else {}
    if method == "gptq":
        return [GPTQModifier(config_groups=groups, ignore=["lm_head"], **gptq)]
    if method == "awq":
        return [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    return [AWQModifier(), GPTQModifier(config_groups=groups, ignore=["lm_head"], **gptq)]


def run_autoround(model, tokenizer, samples: torch.Tensor, bits: int, group: int, settings: dict) -> str:
    """AutoRound on ``model`` in place (its blocks end up holding the dequantized weights, which
    is what gets scored); returns its version. ``settings``: iters, batch_size, lr, seed (else its own;
    seed 42, which draws its batches)."""
    import auto_round
    from auto_round import AutoRound

    tuned = {k: settings[k] for k in ("iters", "lr", "seed") if k in settings}
    batch = settings.get("batch_size", 8)
    rounder = AutoRound(model, tokenizer=tokenizer, bits=bits, group_size=group,
                        sym=SCHEME["symmetric"], dataset=list(samples.split(batch)), nsamples=samples.shape[0],
                        seqlen=samples.shape[1], batch_size=batch, device_map="cpu", **tuned)
    rounder.quantize()
    return auto_round.__version__


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
    ap.add_argument("--group", type=int, default=64)
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
    count, seq_len = settings.get("calibration.samples", 128), settings.get("calibration.seq_len", 512)
    samples = calibration_samples(tokenizer, load_calibration_text("default"), count, seq_len, seed=0,
                                  bos=settings.get("calibration.bos"))

    start, cpu_start = time.perf_counter(), time.process_time()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    if method == "autoround":
        tool = f"auto-round {run_autoround(model, tokenizer, samples, args.bits, args.group, settings)}"
    else:
        ds = datasets.Dataset.from_dict({"input_ids": samples.tolist(),
                                         "attention_mask": torch.ones_like(samples).tolist()})
        oneshot(model=model, dataset=ds, recipe=recipe_for(method, args.bits, args.group, settings),
                max_seq_length=seq_len, num_calibration_samples=count)
        tool = f"llm-compressor {llmcompressor.__version__}"
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = peak_rss_bytes()
    scores = score_texts(hf_logits_fn(model), tokenizer, parse_texts(args.texts))
    row = {"tool": tool, "method": args.method, "bits": args.bits, "group_size": args.group,
           "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),  # AutoRound's amp may change it
           "quantize_s": seconds, "quantize_cpu_s": cpu_seconds, "load_average": os.getloadavg(),
           "peak_rss_bytes": peak, "scores": scores, "torch": torch.__version__}
    print(json.dumps(row))


if __name__ == "__main__":
    main()
