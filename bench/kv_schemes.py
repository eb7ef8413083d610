"""KV-perplexity of every KV-cache family's schemes on SmolLM2-135M, two texts (prose and code).

    python -m bench.kv_schemes [--tokens 2048] [--chunk 32] [--schemes fp16,int8,...]
                               [--out bench/results/kv/schemes.json]

Every scheme runs the same chunked path as ``lowbit eval --kv`` (``evals.kv``): windows of
1,024 tokens with stride 512 (each token scored once), each window through a fresh cache of
lowbit's runtime, its first 512 tokens in one forward and the rest in chunks of ``--chunk``
tokens, so the scored tokens attend to the cached (quantized) keys and values. Texts: the
bundled Persuasion (prose) and CPython's argparse.py (code), neither used for calibration.
The change in perplexity is against the fp16 cache on the same text and path. Bytes per
token are per layer and KV head at SmolLM2's head_dim 64, scales included.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.results_file import write_result
from evals.kv import ChunkProtocol, kv_perplexity, runtime_session
from evals.perplexity import Protocol, tokenize_text
from evals.provenance import commit, provenance
from evals.texts import load_text
from kvquant import bytes_per_token, parse_kv
from kvquant import schemes as kv_families

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ("persuasion", "code")
# besides every family's listed names: the other useful K/V split, and k4v2's reverse (values wider than keys)
EXTRA = ("k8v2", "k2v4")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--schemes", default=",".join([*kv_families.listed_names(), *EXTRA]))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kv" / "schemes.json")
    args = ap.parse_args()
    code_version = commit()  # read before the long run, so later commits cannot mislabel it
    command = "python -m bench.kv_schemes " + " ".join(f"--{k} {v}" for k, v in vars(args).items() if k != "out")
    import runtime

    protocol = Protocol(window=1024, stride=512, tokens=args.tokens)
    chunks = ChunkProtocol(chunk=args.chunk)
    model = runtime.load("smollm2-135m")
    cfg = model.decoder.cfg
    names = [n for n in args.schemes.split(",") if n]
    if "fp16" in names:
        names.remove("fp16")
    rows = []
    for text in TEXTS:
        token_ids = tokenize_text(model.tokenizer, load_text(text), protocol)
        base = None
        for name in ["fp16", *names]:
            scheme = parse_kv(name)
            start = time.perf_counter()
            ppl = kv_perplexity(runtime_session(model, scheme), token_ids, protocol, chunks, progress=False).ppl
            base = base or ppl
            rows.append({"text": text, "scheme": scheme.name, "family": scheme.family, "settings": scheme.to_dict(),
                         "ppl": ppl, "delta_ppl_pct": 100 * (ppl / base - 1),
                         "bytes_per_token_per_head": bytes_per_token(scheme, 1, 1, cfg.head_dim),
                         "vs_fp16_bytes": bytes_per_token(scheme, 1, 1, cfg.head_dim)
                         / bytes_per_token(parse_kv("fp16"), 1, 1, cfg.head_dim),
                         "seconds": time.perf_counter() - start, "tokens_scored": int(token_ids.numel()) - 1})
            print(f"{text} {scheme.name}: {ppl:.4f} ({rows[-1]['delta_ppl_pct']:+.3f}%)", flush=True)
            args.out.with_suffix(".partial.json").write_text(json.dumps(rows, indent=2))
    result = {
        "benchmark": "KV-cache schemes of every family, SmolLM2-135M-Instruct (float32 weights), prose and code",
        "protocol": {**protocol.to_dict(), "description": protocol.describe(), **chunks.to_dict(),
                     "chunks": chunks.describe(protocol), "texts": {"persuasion": "persuasion.txt (bundled prose)",
                                                                     "code": "CPython 3.11.7 argparse.py (bundled)"},
                     "baseline": "the fp16 cache on the same text and path",
                     "machine": "shared 2-core machine (timings are not a benchmark of speed)"},
        "command": command,
        "rows": rows,
        **provenance("cpu"),
        "commit": code_version,
    }
    write_result(args.out, result)
    args.out.with_suffix(".partial.json").unlink(missing_ok=True)
    print(markdown(result))


def markdown(result: dict) -> str:
    """One row per scheme: bytes vs fp16 and the perplexity change on each text."""
    texts = list(dict.fromkeys(r["text"] for r in result["rows"]))
    lines = ["| scheme | family | bytes/token vs fp16 | " + " | ".join(f"Δ ppl {t}" for t in texts) + " |",
             "|---|---|---|" + "---|" * len(texts)]
    for name in dict.fromkeys(r["scheme"] for r in result["rows"]):
        rows = {r["text"]: r for r in result["rows"] if r["scheme"] == name}
        first = next(iter(rows.values()))
        lines.append(f"| {name} | {first['family']} | {first['vs_fp16_bytes']:.3f}x | "
                     + " | ".join(f"{rows[t]['delta_ppl_pct']:+.2f}%" if t in rows else "" for t in texts) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
