"""KV-cache quantization on SmolLM2-135M: quality against the fp16 cache, memory, peers.

    python -m bench.kv [--tokens 2048] [--chunk 32] [--out bench/results/kv/perplexity.json]

Every cache runs the same chunked path (``evals.kv``): the bundled Persuasion text
in windows of 1,024 tokens with stride 512 (each token scored once); each window
goes through a fresh cache, its first 512 tokens in one forward and the rest in
chunks of ``--chunk`` tokens, so the scored tokens attend to cached keys and values.

* lowbit's schemes run in lowbit's runtime against its fp16 cache (same path);
* transformers' ``QuantizedCache`` with the quanto and HQQ backends (group 64,
  residual 128, transformers' default axes) runs in the transformers model against
  a ``DynamicCache`` through the same path, when ``optimum-quanto`` / ``hqq`` are
  installed (bench-only dependencies: ``pip install optimum-quanto hqq``); a backend
  that cannot be imported is recorded as unavailable with the reason;
* bytes per token of each scheme (scales included), computed from the layout and
  measured on an allocated CPU cache, and how many concurrent sequences fit a
  memory budget (the count allocated and counted).

Runs on CPU; the JSON keeps the raw numbers, protocol, device, versions and commit.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable

import torch

from bench.kv_memory import ModelShape, capacity_table, format_bytes, memory_row
from bench.results_file import write_result
from evals.kv import ChunkProtocol, NewSession, Step, kv_perplexity, runtime_session
from evals.perplexity import Protocol, tokenize_text
from evals.provenance import commit, provenance
from evals.texts import load_text
from kvquant import KVScheme, parse_kv
from quant import models

ROOT = Path(__file__).resolve().parent.parent
# int2-g16: INT2 with groups of 16 (tokens per key group, channels per value group), 0.25x fp16
LOWBIT_SCHEMES = ["fp16", "int8", "int4", "int2", "int2-g16", "fp8"]
PEERS = [("quanto", 4), ("quanto", 2), ("hqq", 4), ("hqq", 2), ("hqq", 8)]
TARGETS = {"int8": 0.1, "int4-g64-r128": 0.6, "int2-g64-r128": 25.0, "int2-g16-r128": 25.0}  # max Δppl %, issue 4
BUDGET = 1 << 30
CONTEXTS = [2048, 8192, 32768]


def timed_ppl(new_session, token_ids, protocol, chunks) -> tuple[float, float]:
    start = time.perf_counter()
    ppl = kv_perplexity(new_session, token_ids, protocol, chunks, progress=False).ppl
    return ppl, time.perf_counter() - start


def hf_session(model, make_cache: Callable[[], object]) -> NewSession:
    """Sessions of a transformers causal LM with the cache ``make_cache()`` returns."""

    def new_session(length: int) -> Step:
        cache = make_cache()

        @torch.inference_mode()
        def step(ids: torch.Tensor) -> torch.Tensor:
            return model(ids.to(model.device), past_key_values=cache, use_cache=True).logits

        return step

    return new_session


def peer_cache(backend: str, bits: int, config):
    from transformers import QuantizedCache

    return QuantizedCache(backend, config, nbits=bits, q_group_size=64, residual_length=128)


def peer_available(backend: str, config) -> str | None:
    """None when transformers can build the backend's cache here, else why not."""
    try:
        peer_cache(backend, 4, config)
        return None
    except Exception as e:  # ImportError from transformers when the backend package is missing
        return f"{type(e).__name__}: {e}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--skip-peers", action="store_true", help="Only lowbit's caches.")
    ap.add_argument("--peers-from", type=Path, help="Take the transformers rows (fp16 baseline, quanto, HQQ) from an "
                    "earlier result on the same protocol instead of running them again (marked with its commit).")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kv" / "perplexity.json")
    args = ap.parse_args()

    code_version = commit()  # read before the long run, so later commits cannot mislabel it
    import runtime

    protocol = Protocol(window=1024, stride=512, tokens=args.tokens)
    chunks = ChunkProtocol(chunk=args.chunk)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model = runtime.load("smollm2-135m")
    token_ids = tokenize_text(model.tokenizer, load_text("default"), protocol)
    rows = []

    def record(row):
        rows.append(row)
        partial = {"rows": rows, "protocol": {**protocol.to_dict(), "chunk": chunks.chunk}, "commit": code_version,
                   "complete": False}
        args.out.with_suffix(".partial.json").write_text(json.dumps(partial, indent=2))
        delta = "" if row.get("delta_ppl_pct") is None else f" ({row['delta_ppl_pct']:+.3f}%)"
        print(f"{row['cache']}: {row.get('ppl', row.get('unavailable'))}{delta}", flush=True)

    base = None
    for name in LOWBIT_SCHEMES:
        scheme = parse_kv(name)
        ppl, secs = timed_ppl(runtime_session(model, scheme), token_ids, protocol, chunks)
        base = base or ppl
        record({"cache": f"lowbit {scheme.name}", "runner": "lowbit runtime", "scheme": scheme.to_dict(),
                "ppl": ppl, "baseline_ppl": base, "delta_ppl_pct": 100 * (ppl / base - 1), "seconds": secs})

    if args.peers_from:
        for _ in range(240):  # an earlier run may still be finishing (its file appears when it does)
            if args.peers_from.exists():
                break
            time.sleep(5)
        earlier = json.loads(args.peers_from.read_text())
        if earlier["protocol"]["tokens"] != protocol.tokens or earlier["protocol"].get("chunk", args.chunk) != args.chunk:
            raise SystemExit(f"{args.peers_from} ran another protocol")
        for row in earlier["rows"]:
            if row["runner"] == "transformers":
                record({**row, "reused_from": {"file": args.peers_from.name, "commit": earlier["commit"]}})
    else:
        run_peers(args, record, token_ids, protocol, chunks)
    finish(args, model, rows, protocol, chunks, token_ids, code_version)


def run_peers(args, record, token_ids, protocol, chunks):
    from transformers import DynamicCache

    hf_model, _ = models.load_float_model(models.resolve("smollm2-135m"))
    config = hf_model.config
    hf_base, secs = timed_ppl(hf_session(hf_model, lambda: DynamicCache(config=config)), token_ids, protocol, chunks)
    record({"cache": "transformers DynamicCache (fp16 baseline)", "runner": "transformers", "ppl": hf_base,
            "baseline_ppl": hf_base, "delta_ppl_pct": 0.0, "seconds": secs})
    for backend, bits in [] if args.skip_peers else PEERS:
        label = f"transformers QuantizedCache {backend} int{bits}"
        why = peer_available(backend, config)
        if why:
            record({"cache": label, "runner": "transformers", "unavailable": why})
            continue
        try:
            ppl, secs = timed_ppl(hf_session(hf_model, lambda b=backend, n=bits: peer_cache(b, n, config)),
                                  token_ids, protocol, chunks)
        except Exception as e:  # a backend that imports but fails on this machine is a result too
            record({"cache": label, "runner": "transformers", "unavailable": f"{type(e).__name__}: {e}"})
            continue
        record({"cache": label, "runner": "transformers", "backend": backend, "bits": bits, "q_group_size": 64,
                "residual_length": 128, "ppl": ppl, "baseline_ppl": hf_base,
                "delta_ppl_pct": 100 * (ppl / hf_base - 1), "seconds": secs})


def finish(args, model, rows, protocol, chunks, token_ids, code_version):
    shape = ModelShape.of(model.decoder.cfg)
    schemes = [parse_kv(n) for n in LOWBIT_SCHEMES]
    memory = [memory_row(s, shape, context=4096) for s in schemes]
    capacity = capacity_table([KVScheme(), parse_kv("int8"), parse_kv("int4"), parse_kv("int2")], shape, BUDGET, CONTEXTS)

    by_name = {r["cache"]: r for r in rows}
    targets = {name: {"max_delta_ppl_pct": bound, "delta_ppl_pct": by_name[f"lowbit {name}"]["delta_ppl_pct"],
                      "met": by_name[f"lowbit {name}"]["delta_ppl_pct"] <= bound} for name, bound in TARGETS.items()}
    int4_ratio = next(m["vs_fp16"] for m in memory if m["scheme"] == "int4-g64-r128")
    targets["int4 bytes/token vs fp16"] = {"max": 0.3, "value": int4_ratio, "met": int4_ratio <= 0.3}
    result = {
        "benchmark": "kv-cache quantization, SmolLM2-135M-Instruct (float32 weights), Persuasion",
        "protocol": {**protocol.to_dict(), "description": protocol.describe(), **chunks.to_dict(),
                     "chunks": chunks.describe(protocol), "text": "persuasion.txt (bundled)",
                     "tokens_scored": int(token_ids.numel()) - 1},
        "rows": rows,
        "memory": {"model": {"layers": shape.num_layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim},
                   "scale_and_residual_dtype": "float16", "bytes_per_token": memory,
                   "capacity_budget_bytes": BUDGET, "capacity": capacity},
        "targets": targets,
        **provenance("cpu"),
        "commit": code_version,
        "peer_versions": peer_versions(),
    }
    write_result(args.out, result)
    args.out.with_suffix(".partial.json").unlink(missing_ok=True)
    print(markdown(result))


def peer_versions() -> dict:
    import importlib.metadata as md

    out = {}
    for dist in ("optimum-quanto", "hqq"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def markdown(result: dict) -> str:
    lines = ["| cache | runs in | perplexity | Δ vs its fp16 cache |", "|---|---|---|---|"]
    for r in result["rows"]:
        if "unavailable" in r:
            lines.append(f"| {r['cache']} | {r['runner']} | unavailable: {r['unavailable']} | |")
        else:
            lines.append(f"| {r['cache']} | {r['runner']} | {r['ppl']:.4f} | {r['delta_ppl_pct']:+.3f}% |")
    lines += ["", "| scheme | bytes/token (computed) | vs fp16 | measured at 4096 tokens (with residual block) |",
              "|---|---|---|---|"]
    for m in result["memory"]["bytes_per_token"]:
        lines.append(f"| {m['scheme']} | {m['bytes_per_token']:.0f} | {m['vs_fp16']:.3f}x | "
                     f"{m['measured_bytes_per_token']:.0f} |")
    cap = result["memory"]["capacity"]
    schemes = list(dict.fromkeys(c["scheme"] for c in cap))
    lines += ["", f"Sequences that fit a {format_bytes(result['memory']['capacity_budget_bytes'])} KV budget "
              "(allocated and counted):", "", "| context | " + " | ".join(schemes) + " |",
              "|---|" + "---|" * len(schemes)]
    for ctx in sorted({c["context"] for c in cap}):
        lines.append(f"| {ctx} | " + " | ".join(str(c["sequences"]) for c in cap if c["context"] == ctx) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
