"""Gemma 2, Gemma 3 and Phi-3: what lowbit plans for real-shaped configs, and what quantization costs the
tiny random models the tests build.

    python bench/families.py [--out bench/results/families-cpu.json]

* ``lowbit plan`` (``evals.planner``) on google/gemma-3-27b-it's and a Phi-3-mini-128k-shaped
  config.json: bytes per token per KV scheme at 32k context in 80 GB;
* per family, a tiny random model (``tests/tiny.py``) with a few outlier input channels (as trained
  models have, ``with_outlier_channels``): logit mean squared error against the float model, through
  W4 g32 checkpoints of RTN, AWQ (then RTN), GPTQ and AWQ+GPTQ (16 calibration samples of 32 random
  tokens, 2 x 32 held-out tokens);
* per family and KV scheme, the largest logit error of a cached forward (19 tokens prefilled, then
  one at a time to 40) against the same W4 model without a cache, as a share of the largest logit.

Deterministic (seeded); CPU only. The test suite asserts the orderings (tests/test_architectures_gemma.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tiny models and the test configs, one copy

from evals.provenance import commit, provenance  # noqa: E402

FAMILIES = ["gemma2", "gemma3", "phi3"]
METHODS = ["rtn", "awq", "gptq", "awq+gptq"]


def plans() -> dict:
    from evals import planner
    from test_architectures_gemma import GEMMA3_27B, PHI3_MINI_128K

    out = {}
    for name, config in (("gemma-3-27b-it", GEMMA3_27B), ("phi-3-mini-128k-shaped", PHI3_MINI_128K)):
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "config.json").write_text(json.dumps(config))
            p = planner.plan(d, planner.parse_memory("80GB"), 32768, ["fp16", "int8", "int4-g32", "int2-g32", "fp8"])
        out[name] = {"attention": p["attention"], "weights": p["weights"],
                     "kv_bytes_per_token": {r["scheme"]: r.get("kv_bytes_per_token") for r in p["schemes"]},
                     "sequences_of_32k_in_80GB": {r["scheme"]: r.get("max_sequences") for r in p["schemes"]}}
    return out


def quality(kind: str, work: Path) -> dict:
    import torch

    import runtime
    from test_architectures_gemma import KV_SCHEMES, ids_for, quantized_checkpoint, with_outlier_channels
    from tiny import tiny_model

    model = with_outlier_channels(tiny_model(kind, seed=4)[0])
    held_out = ids_for(model, n=2, length=32, seed=11)
    with torch.no_grad():
        reference = model(held_out).logits
    mse = {}
    for methods in METHODS:
        out, _, _ = quantized_checkpoint(kind, work, methods, outliers=True)
        mse[methods] = float((runtime.load(out).logits(held_out) - reference).pow(2).mean())
    (work / "plain").mkdir()
    out, _, _ = quantized_checkpoint(kind, work / "plain")
    ids = ids_for(model, n=2, length=40)
    kv = {}
    for name in KV_SCHEMES:
        rt = runtime.load(out, kv=name)
        expected = rt.logits(ids)
        cache = rt.new_cache(40, batch=2)
        with torch.inference_mode():
            got = [rt.decoder(ids[:, :19], cache, 0)] + [rt.decoder(ids[:, p:p + 1], cache, p) for p in range(19, 40)]
        kv[name] = float((torch.cat(got, 1) - expected).abs().max() / expected.abs().max())
    return {"logit_mse_vs_float": mse, "kv_cached_logit_error_share": kv}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "families-cpu.json")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    code_version = commit()
    result = {"benchmark": "Gemma 2 / Gemma 3 / Phi-3: lowbit plan on real shapes, quantization error on tiny models",
              "plans": plans(), "tiny": {}}
    with tempfile.TemporaryDirectory() as d:
        for kind in FAMILIES:
            (Path(d) / kind).mkdir()
            result["tiny"][kind] = quality(kind, Path(d) / kind)
            print(kind, json.dumps(result["tiny"][kind]), flush=True)
    result.update(provenance("cpu"), commit=code_version)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
