"""lowbit's calibrated methods on SmolLM2-135M: perplexity, wall time, peak memory.

    python bench/calibrated.py [--methods gptq awq awq+gptq] [--out bench/results/calibrated-cpu.json]

Each method runs in a fresh child process (so its peak RSS is its own) on the
protocol of the GPTQ/AWQ issue: 4-bit, group 64, asymmetric, lm_head kept,
128 x 512 calibration tokens from the bundled non-evaluation novels (seed 0),
perplexity with the evaluation protocol on the bundled Persuasion. Wall time
covers the whole `quantize` (loading the model, calibration, saving).
`bench/peers.py` measures llm-compressor on the same samples and tokens.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def one(method: str, tokens: int) -> dict:
    from evals.perplexity import Protocol, perplexity, tokenize_text
    from evals.texts import load_text
    from lowbit import pipeline
    from lowbit.recipe import parse_recipe
    import runtime

    with tempfile.TemporaryDirectory() as tmp:
        recipe = parse_recipe({"model": "smollm2-135m", "output": f"{tmp}/ckpt", "dtype": "bfloat16",
                               "weights": {"method": method, "bits": 4, "group_size": 64, "symmetric": False}})
        start = time.perf_counter()
        ckpt = pipeline.quantize(recipe, device="cpu", progress=False)
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        model = runtime.load(ckpt)
        protocol = Protocol(tokens=tokens)
        ids = tokenize_text(model.tokenizer, load_text("default"), protocol)
        ppl = perplexity(model.logits, ids, protocol, progress=False).ppl
    return {"tool": "lowbit", "method": method, "ppl": ppl, "quantize_s": seconds, "peak_rss_bytes": peak,
            "protocol": protocol.describe()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="*", default=["gptq", "awq", "awq+gptq"])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "calibrated-cpu.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.tokens)))
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    rows = []
    for method in args.methods:
        out = subprocess.run([sys.executable, __file__, "--one", method, "--tokens", str(args.tokens)],
                             capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"commit": commit, "device": "cpu (2 cores)", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
