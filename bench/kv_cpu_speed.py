"""Time of a quantized KV cache against the fp16 cache on CPU: eval windows and engine decode,
this tree against an earlier commit, side by side in one process.

    python -m bench.kv_cpu_speed [--before 664c777] [--threads 1] [--windows 2] [--context 1024]
                                 [--batches 1,8] [--steps 16] [--rounds 2] [--out FILE]

SmolLM2-135M-Instruct (float32 weights, the runtime's CPU dtype), fp16 / int8 / int4 caches
(default group 64, residual 128):

* eval windows: what ``lowbit eval --kv`` runs per window (``evals.kv``'s chunked path): a window
  of 1,024 tokens of the bundled text through a fresh cache, 512 tokens prefilled, then chunks of
  32, each attending to the cached keys and values; wall seconds per window;
* engine decode: ``runtime.execution.Executor`` (the engine's step code) on a ``KVCache``,
  ``batch`` sequences of ``context`` random tokens prefilled, then ``steps`` decode steps timed
  one by one (no block fills in them); the median step.

The earlier commit's ``runtime``, ``kvquant`` and ``quant`` are imported from git as
``*_before`` (``bench/step_time.import_before``), so both run on the same weights in this
process, in alternating order: every (version, cache) pair runs each window and each round
before the next one starts. The machine is shared (other work may be compiling): ratios of
medians measured together are what count. Everything runs in a worker thread with ``--threads``
intra-op threads (default: 1; on a loaded machine PyTorch's OpenMP threads stepped from the
main thread wait actively for each other: ``bench/step_time.py``). The logits of every window
and the tokens of every decode must be identical before and after (checked and recorded).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.step_time import import_before
from evals.kv import chunked_logits_fn, runtime_session
from evals.perplexity import Protocol, tokenize_text, windows
from evals.provenance import commit, provenance
from evals.texts import load_text

ROOT = Path(__file__).resolve().parent.parent


SCHEMES = ("fp16", "int8", "int4")
WINDOW, STRIDE, CHUNK = 1024, 512, 32  # lowbit eval's protocol and --kv-chunk default


def in_worker(fn, threads: int | None):
    """``fn()`` in a worker thread with ``threads`` intra-op threads (None: PyTorch's default)."""
    result = {}

    def run():
        if threads:
            torch.set_num_threads(threads)
        result["value"] = fn()

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return result["value"]


def time_window(model, scheme, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Seconds and logits of one window through a fresh cache, as ``lowbit eval --kv`` runs it."""
    fn = chunked_logits_fn(runtime_session(model, scheme), WINDOW - STRIDE, CHUNK)
    start, cpu = time.perf_counter(), time.process_time()
    logits = fn(ids[None])
    return (time.perf_counter() - start, time.process_time() - cpu), logits


def decode_steps(package, model, scheme, batch: int, context: int, steps: int) -> tuple[list[float], list]:
    """Seconds of each of ``steps`` decode steps after ``batch`` prompts of ``context`` tokens, and the
    greedy tokens, on the engine's step code over a ``KVCache``."""
    cache = model.new_cache(context + steps, batch, scheme, lockstep=False)
    executor = package.execution.Executor(model.decoder, cache, False)
    g = torch.Generator().manual_seed(0)
    slots = [cache.add_sequence() for _ in range(batch)]
    for s in slots:
        cache.reserve(s, context)
    prompts = [torch.randint(0, model.decoder.cfg.vocab_size, (context,), generator=g).tolist() for _ in slots]
    tokens = executor.prefill(slots, [0] * batch, prompts).argmax(-1).tolist()
    out, times = [tokens], []
    for s in slots:
        cache.advance(s, context)
    for i in range(steps):
        for s in slots:
            cache.reserve(s, context + i + 1)
        start, cpu = time.perf_counter(), time.process_time()
        logits = executor.decode(tokens, [context + i] * batch)
        times.append((time.perf_counter() - start, time.process_time() - cpu))
        tokens = logits.argmax(-1).tolist()
        out.append(tokens)
        for s in slots:
            cache.advance(s, 1)
    return times, out


def medians(times: list[tuple[float, float]]) -> dict:
    """Median wall and CPU seconds (the process's: with one intra-op thread, the work itself, however
    often the shared machine took the core away)."""
    return {"wall_s": statistics.median(w for w, _ in times), "cpu_s": statistics.median(c for _, c in times)}


def ratios(times: dict, over: str = "fp16") -> dict:
    """Each cache's median over the fp16 cache's, wall and CPU."""
    base = medians(times[over])
    return {name: {k: v / base[k] for k, v in medians(t).items()} for name, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="664c777", help="the commit to compare with")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (0: PyTorch's default)")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    code_version = commit()
    import kvquant
    import runtime
    import runtime.execution  # noqa: F401 (the Executor, as package.execution)

    with tempfile.TemporaryDirectory() as tmp:
        before = import_before(args.before, Path(tmp), ("runtime", "kvquant", "quant"))
        import kvquant_before
        import runtime_before.execution  # noqa: F401
        versions = {"before": (before, kvquant_before), "after": (runtime, kvquant)}
        models = {v: pkg.load("smollm2-135m") for v, (pkg, _) in versions.items()}
        schemes = {v: {n: kv.parse_kv(n) for n in SCHEMES} for v, (_, kv) in versions.items()}
        threads = args.threads or None
        pairs = [(v, n) for n in SCHEMES for v in versions]

        protocol = Protocol(window=WINDOW, stride=STRIDE, tokens=STRIDE * (args.windows + 1))
        text_ids = tokenize_text(models["after"].tokenizer, load_text("default"), protocol)
        spans = [(a, b) for a, b, _ in windows(len(text_ids), protocol)][:args.windows]  # 0: decode only
        eval_s = {p: [] for p in pairs}
        same_logits = {n: True for n in SCHEMES}
        for w, (a, b) in enumerate(spans):
            logits = {}
            for v, n in pairs[w % 2:] + pairs[:w % 2]:  # alternate who goes first
                secs, logits[v, n] = in_worker(lambda: time_window(models[v], schemes[v][n], text_ids[a:b]), threads)
                eval_s[v, n].append(secs)
                print(f"window {w} {v} {n}: {secs[0]:.2f} s (CPU {secs[1]:.2f} s)", flush=True)
            for n in SCHEMES:
                same_logits[n] &= torch.equal(logits["before", n], logits["after", n])

        decode = {}
        for batch in [int(b) for b in args.batches.split(",")]:
            step_s = {p: [] for p in pairs}
            same_tokens = {n: True for n in SCHEMES}
            for r in range(args.rounds):
                tokens = {}
                for v, n in pairs[r % 2:] + pairs[:r % 2]:
                    pkg = versions[v][0]
                    times, tokens[v, n] = in_worker(
                        lambda: decode_steps(pkg, models[v], schemes[v][n], batch, args.context, args.steps), threads)
                    step_s[v, n] += times
                    print(f"decode batch {batch} round {r} {v} {n}: {medians(times)}", flush=True)
                for n in SCHEMES:
                    same_tokens[n] &= tokens["before", n] == tokens["after", n]
            decode[f"batch {batch}"] = {
                "step_s": {f"{v} {n}": t for (v, n), t in step_s.items()},
                "median_step": {f"{v} {n}": medians(t) for (v, n), t in step_s.items()},
                "vs_fp16": {v: ratios({n: step_s[v, n] for n in SCHEMES}) for v in versions},
                "tokens_identical_before_after": same_tokens,
            }

    result = {
        "benchmark": "quantized KV cache time vs the fp16 cache on CPU: eval windows and engine decode, "
                     "SmolLM2-135M-Instruct (float32 weights)",
        "protocol": {
            "eval": f"windows of {WINDOW} tokens (stride {STRIDE}) of the bundled text, {WINDOW - STRIDE} prefilled, "
                    f"then chunks of {CHUNK}; (wall, CPU) seconds per window",
            "decode": f"Executor decode steps over a KVCache after {args.context}-token random prompts; "
                      f"{args.steps} steps x {args.rounds} rounds per cache; (wall, CPU) seconds per step, medians",
            "order": "every (version, cache) pair runs a window or round before the next starts, the first "
                     "alternating; each in a worker thread",
            "intra_op_threads": threads or torch.get_num_threads(),
            "machine": "shared 2-core CPU: other sessions may have been compiling or testing at the same time",
        },
        "schemes": {n: s.to_dict() for n, s in schemes["after"].items()},
        "eval": {
            "window_s": {f"{v} {n}": t for (v, n), t in eval_s.items()},
            "median_window": {f"{v} {n}": medians(t) for (v, n), t in eval_s.items()} if spans else None,
            "vs_fp16": {v: ratios({n: eval_s[v, n] for n in SCHEMES}) for v in versions} if spans else None,
            "logits_identical_before_after": same_logits if spans else None,
        },
        "decode": decode,
        "before": args.before,
        **provenance("cpu"),
        "commit": code_version,
    }
    out = args.out or ROOT / "bench" / "results" / f"kv-cpu-speed-{code_version}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"eval": result["eval"]["vs_fp16"], **{k: d["vs_fp16"] for k, d in decode.items()}}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
