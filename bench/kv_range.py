"""Choose how much of each group's range the INT2 KV grid spans, on text no result is reported on.

    python -m bench.kv_range [--tokens 4096] [--bits 2] [--out bench/results/kv/int2-range-ratio.json]

Sweeps ``kvquant.scheme.RANGE_RATIO`` (keys, values) for one bit width and scores each pair
with KV-perplexity (``evals.kv``: windows of 1,024, stride 512, 512 tokens prefilled, then
chunks of 32) on the calibration text, the five bundled non-evaluation Austen novels, never
on Persuasion or the Python source the results are reported on. The pair with the lowest
perplexity is what ``RANGE_RATIO`` should hold; ``bench/kv.py`` then measures it on Persuasion.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from bench.results_file import write_result
from evals.provenance import commit, provenance

ROOT = Path(__file__).resolve().parent.parent


KEY_RATIOS = [1.0, 0.9, 0.85]
VALUE_RATIOS = [1.0, 0.9, 0.85, 0.8]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--bits", type=int, default=2, choices=[2, 4])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kv" / "int2-range-ratio.json")
    args = ap.parse_args()

    code_version = commit()
    import runtime
    from evals.kv import ChunkProtocol, kv_perplexity, runtime_session
    from evals.perplexity import Protocol, tokenize_text
    from kvquant import KVScheme, scheme as kv_scheme
    from quant.calibration import load_calibration_text

    protocol, chunks = Protocol(window=1024, stride=512, tokens=args.tokens), ChunkProtocol(chunk=32)
    model = runtime.load("smollm2-135m")
    token_ids = tokenize_text(model.tokenizer, load_calibration_text("default"), protocol)

    def ppl(scheme):
        return kv_perplexity(runtime_session(model, scheme), token_ids, protocol, chunks, progress=False).ppl

    base = ppl(KVScheme())
    scheme = KVScheme(bits=args.bits)
    rows = []
    for k, v in itertools.product(KEY_RATIOS, VALUE_RATIOS):
        kv_scheme.RANGE_RATIO[args.bits] = (k, v)
        p = ppl(scheme)
        rows.append({"key_ratio": k, "value_ratio": v, "ppl": p, "delta_ppl_pct": 100 * (p / base - 1)})
        print(f"keys {k:.2f} values {v:.2f}: {p:.4f} ({rows[-1]['delta_ppl_pct']:+.2f}%)", flush=True)
    best = min(rows, key=lambda r: r["ppl"])
    result = {
        "benchmark": f"INT{args.bits} KV range ratio sweep, SmolLM2-135M-Instruct (float32 weights)",
        "scheme": scheme.name,
        "text": "calibration text (five non-evaluation Austen novels, bundled), from its start",
        "protocol": {**protocol.to_dict(), "description": protocol.describe(), "chunks": chunks.describe(protocol)},
        "fp16_cache_ppl": base,
        "rows": rows,
        "best": best,
        **provenance("cpu"),
        "commit": code_version,
    }
    write_result(args.out, result)
    print(f"best: keys {best['key_ratio']} values {best['value_ratio']} ({best['delta_ppl_pct']:+.2f}%)")


if __name__ == "__main__":
    main()
