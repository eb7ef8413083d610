"""Time of a quantized KV cache against the fp16 cache on CPU: eval windows and engine decode,
side by side in one process.

    python -m bench.kv_cpu_speed [--weights float|w4] [--schemes fp16,int8,int4] [--context 1024]
                                 [--random-fill] [--batches 1,8] [--steps 16] [--rounds 2]
                                 [--windows 2] [--threads 1] [--variants reference,folded,native]
                                 [--before COMMIT] [--out FILE]

    # issue 31's long-context target: W4 weights, 4k context, batch 1 and 8 (decode only)
    flock /tmp/lowbit-bench.lock python -m bench.kv_cpu_speed --weights w4 --context 4096 --random-fill \
        --windows 0 --steps 12 --rounds 2 --threads 1
    # lowbit eval --kv's chunked windows (float SmolLM2) and decode after a real 1k prefill
    flock /tmp/lowbit-bench.lock python -m bench.kv_cpu_speed --weights float --windows 6 --batches 1,8 \
        --steps 12 --rounds 2 --threads 1

Weights: SmolLM2-135M-Instruct (``float``: float32, the runtime's CPU dtype) or random W4 g64
weights at its shape through the CPU int4 kernels (``w4``: ``bench.cpu_decode.random_model``).
Caches: fp16 / int8 / int4 (default group 64, residual 128) or ``--schemes``.

* eval windows (float weights): what ``lowbit eval --kv`` runs per window (``evals.kv``'s chunked
  path): a window of 1,024 tokens of the bundled text through a fresh cache, 512 tokens
  prefilled, then chunks of 32, each attending to the cached keys and values; seconds per window;
* engine decode: ``runtime.execution.Executor`` (the engine's step code) on a ``KVCache``,
  ``batch`` sequences of ``context`` random tokens prefilled (``--random-fill``: random keys and
  values stored instead, as a prefill stores them: the same cache without the quadratic prefill),
  then ``steps`` decode steps timed one by one (no block fills in them); the median step.

Compared (variants, each with every cache): by default this tree's decode steps over the
stored codes with scales folded, every row of the batch in one call, by the compiled kernel
(``native``: ``runtime/native/kv_attention.cpp``) and by its PyTorch path (``folded``:
``runtime.cpu_attention`` with ``LOWBIT_NATIVE=0``; the fp16 cache's floats read as stored), and
the same tree reading the cache back dequantized and running SDPA per sequence (``reference``:
``PagedCache.folded_decode`` off), on the same model (``--variants`` picks some); with ``--before COMMIT`` (float weights) that commit's ``runtime``, ``kvquant``
and ``quant`` imported from git as ``*_before`` (``bench/step_time.import_before``) against this
tree. Every (variant, cache) pair runs each window and each round before the next one starts,
the first alternating. The machine is shared (other work may be compiling): ratios of medians
measured together are what count. Everything runs in a worker thread with ``--threads``
intra-op threads (default: 1; on a loaded machine PyTorch's OpenMP threads stepped from the
main thread wait actively for each other: ``bench/step_time.py``). Whether the two variants'
logits (windows) and greedy tokens (decode) are identical is recorded, and the load average
before and after. Prints a summary table (median CPU and wall per step or window, and each
cache's ratio to fp16 in the same variant and to the reference fp16). Writes
bench/results/kv/cpu-speed-<weights>-ctx<context>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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
NATIVE = {"folded": False, "native": True}  # LOWBIT_NATIVE per variant (the others: as set)
VARIANTS = {"reference": "decode steps dequantize the cache and run SDPA per sequence (folded_decode off)",
            "folded": "decode attention over the stored codes, scales folded, PyTorch ops (runtime.cpu_attention, "
                      "LOWBIT_NATIVE=0)",
            "native": "the same by the compiled kernel (runtime/native/kv_attention.cpp)"}
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


def fill_random(cache, context: int, slots: list[int], seed: int = 0) -> None:
    """Every layer of ``slots`` holds ``context`` positions of random keys and values (stored as a
    prefill stores them): the decode steps after it read the same cache a real prompt would leave
    of that length, without prefilling ``batch x context`` tokens through the model. The first
    layer is quantized and stored; the others get copies of its tensors (same pages, same bytes
    to read per layer: the steps cost what they would; 30x faster to fill)."""
    g = torch.Generator().manual_seed(seed)
    store = getattr(cache, "store_sequence", cache.write_sequence)  # an earlier tree's cache: store and read
    copies = hasattr(getattr(cache, "pool", None), "layer") and len(cache.groups.layers) == 1
    for layer in range(1 if copies else cache.num_layers):
        for s in slots:
            k, v = (torch.randn(cache.kv_heads, context, cache.head_dim, generator=g).to(cache.dtype) for _ in "kv")
            store(layer, s, 0, k, v)
    for layer in range(1, cache.num_layers if copies else 1):
        for dst, src in zip(cache.pool.layer(layer), cache.pool.layer(0)):
            for d, t in zip(dst, src):
                if d is not None:
                    d.copy_(t)
        cache.residual_k[layer].copy_(cache.residual_k[0])
        cache.residual_v[layer].copy_(cache.residual_v[0])
    for s in slots:
        cache.advance(s, context)


@contextlib.contextmanager
def native_kernels(on: bool | None):
    """LOWBIT_NATIVE for a variant's steps (None: as the environment has it); read at each call."""
    before = os.environ.get("LOWBIT_NATIVE")
    if on is not None:
        os.environ["LOWBIT_NATIVE"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LOWBIT_NATIVE", None)
        else:
            os.environ["LOWBIT_NATIVE"] = before


def decode_steps(package, model, scheme, batch: int, context: int, steps: int, folded: bool | None = None,
                 random_fill: bool = False) -> tuple[list[float], list]:
    """Seconds of each of ``steps`` decode steps after ``batch`` prompts of ``context`` tokens, and the
    greedy tokens, on the engine's step code over a ``KVCache``. ``folded`` False: decode steps
    dequantize the cache and run SDPA (``PagedCache.folded_decode``; None: the tree's default);
    ``random_fill``: the prompts' keys and values are random (:func:`fill_random`)."""
    cache = model.new_cache(context + steps, batch, scheme, lockstep=False)
    if folded is not None:
        cache.folded_decode = cache.folded_decode and folded
    executor = package.execution.Executor(model.decoder, cache, False)
    g = torch.Generator().manual_seed(0)
    slots = [cache.add_sequence() for _ in range(batch)]
    for s in slots:
        cache.reserve(s, context)
    if random_fill:
        fill_random(cache, context, slots)
        tokens = torch.randint(0, model.decoder.cfg.vocab_size, (batch,), generator=g).tolist()
    else:
        prompts = [torch.randint(0, model.decoder.cfg.vocab_size, (context,), generator=g).tolist() for _ in slots]
        tokens = executor.prefill(slots, [0] * batch, prompts).argmax(-1).tolist()
        for s in slots:
            cache.advance(s, context)
    out, times = [tokens], []
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


def summary(label: str, times: dict) -> list[str]:
    """Table rows: each (variant, cache)'s median CPU and wall, its ratio to fp16 in the same variant
    and to the first variant's fp16 (the reference path's)."""
    first = next(iter(times))[0]
    base = {v: medians(t) for (v, n), t in times.items() if n == "fp16" and t}
    rows = [f"{label:<10} {'variant':<10} {'cache':<6} {'cpu s':>8} {'wall s':>8} {'cpu/fp16':>9} "
            f"{'wall/fp16':>9} {'cpu/ref fp16':>13}"]
    for (v, n), t in times.items():
        if not t:
            continue
        m = medians(t)
        own, ref = base.get(v), base.get(first)
        rows.append(f"{label:<10} {v:<10} {n:<6} {m['cpu_s']:>8.4f} {m['wall_s']:>8.4f} "
                    f"{m['cpu_s'] / own['cpu_s']:>9.2f} {m['wall_s'] / own['wall_s']:>9.2f} "
                    f"{m['cpu_s'] / ref['cpu_s']:>13.2f}")
    return rows


def load_models(args, tmp: Path) -> dict:
    """The variants compared: name -> (runtime package, kvquant module, model, folded decode)."""
    import kvquant
    import runtime
    import runtime.execution  # noqa: F401 (the Executor, as package.execution)

    if args.weights == "w4":
        from bench.cpu_decode import SHAPES, random_model

        model = random_model(SHAPES["smollm2-135m"], quantized=True)
    else:
        model = runtime.load("smollm2-135m")
    if args.before is None:  # this tree: decode steps dequantized, on the stored codes by PyTorch or compiled
        every = {"reference": (runtime, kvquant, model, False), "folded": (runtime, kvquant, model, True),
                 "native": (runtime, kvquant, model, True)}
        return {v: every[v] for v in args.variants.split(",")}
    if args.weights != "float":
        raise SystemExit("--before compares float weights only (the earlier tree loads its own model)")
    before = import_before(args.before, tmp, ("runtime", "kvquant", "quant"))
    import kvquant_before
    import runtime_before.execution  # noqa: F401

    return {"before": (before, kvquant_before, before.load("smollm2-135m"), None),
            "after": (runtime, kvquant, model, None)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="an earlier commit to compare with (default: this tree's folded decode "
                                     "against its dequantize-and-SDPA reference)")
    ap.add_argument("--variants", default="reference,folded,native",
                    help="this tree's variants compared (reference, folded: PyTorch, native: compiled)")
    ap.add_argument("--weights", choices=("float", "w4"), default="float",
                    help="float: SmolLM2-135M-Instruct; w4: random W4 g64 weights at its shape (CPU kernels)")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (0: PyTorch's default)")
    ap.add_argument("--windows", type=int, default=2, help="eval windows (float weights only; 0: none)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--random-fill", action="store_true",
                    help="decode after random keys and values instead of a prefill (long contexts)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    code_version = commit()
    names = args.schemes.split(",")
    if "fp16" not in names:
        raise SystemExit("--schemes must include fp16 (every ratio is over it)")

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        variants = load_models(args, Path(tmp))
        models = {v: m for v, (_, _, m, _) in variants.items()}
        schemes = {v: {n: kv.parse_kv(n) for n in names} for v, (_, kv, _, _) in variants.items()}
        threads = args.threads or None
        pairs = [(v, n) for n in names for v in variants]
        first, last = list(variants)[0], list(variants)[-1]

        spans = []
        if args.weights == "float" and args.windows:
            protocol = Protocol(window=WINDOW, stride=STRIDE, tokens=STRIDE * (args.windows + 1))
            text_ids = tokenize_text(models[last].tokenizer, load_text("default"), protocol)
            spans = [(a, b) for a, b, _ in windows(len(text_ids), protocol)][:args.windows]
        eval_s = {p: [] for p in pairs}
        same_logits = {n: True for n in names}
        for w, (a, b) in enumerate(spans):
            logits = {}
            for v, n in pairs[w % 2:] + pairs[:w % 2]:  # alternate who goes first
                with native_kernels(NATIVE.get(v)):
                    secs, logits[v, n] = in_worker(lambda: time_window(models[v], schemes[v][n], text_ids[a:b]),
                                                   threads)
                eval_s[v, n].append(secs)
                print(f"window {w} {v} {n}: {secs[0]:.2f} s (CPU {secs[1]:.2f} s)", flush=True)
            for n in names:
                same_logits[n] &= torch.equal(logits[first, n], logits[last, n])

        decode, tables = {}, summary("eval", eval_s) if spans else []
        for batch in [int(b) for b in args.batches.split(",") if b]:
            step_s = {p: [] for p in pairs}
            same_tokens = {n: True for n in names}
            for r in range(args.rounds):
                tokens = {}
                for v, n in pairs[r % 2:] + pairs[:r % 2]:
                    pkg, _, model, folded = variants[v]
                    with native_kernels(NATIVE.get(v)):
                        times, tokens[v, n] = in_worker(lambda: decode_steps(
                            pkg, model, schemes[v][n], batch, args.context, args.steps, folded, args.random_fill),
                            threads)
                    step_s[v, n] += times
                    print(f"decode batch {batch} round {r} {v} {n}: {medians(times)}", flush=True)
                for n in names:
                    same_tokens[n] &= tokens[first, n] == tokens[last, n]
            decode[f"batch {batch}"] = {
                "step_s": {f"{v} {n}": t for (v, n), t in step_s.items()},
                "median_step": {f"{v} {n}": medians(t) for (v, n), t in step_s.items()},
                "vs_fp16": {v: ratios({n: step_s[v, n] for n in names}) for v in variants},
                f"tokens_identical_{first}_{last}": same_tokens,
            }
            tables += summary(f"decode b{batch}", step_s)[int(bool(tables)):]

    weights = ("random W4 g64 asymmetric weights at SmolLM2-135M's shape (bench.cpu_decode.random_model, CPU "
               "int4 kernels)" if args.weights == "w4" else "SmolLM2-135M-Instruct, float32 weights")
    result = {
        "benchmark": f"quantized KV cache time vs the fp16 cache on CPU: eval windows and engine decode, {weights}",
        "compared": {v: VARIANTS[v] for v in variants} if args.before is None
                    else f"{first}: commit {args.before}; {last}: this tree",
        "protocol": {
            "eval": f"windows of {WINDOW} tokens (stride {STRIDE}) of the bundled text, {WINDOW - STRIDE} prefilled, "
                    f"then chunks of {CHUNK}; (wall, CPU) seconds per window",
            "decode": f"Executor decode steps over a KVCache after {args.context}-token "
                      + ("random keys and values (stored as a prefill stores them)" if args.random_fill
                         else "random prompts prefilled")
                      + f"; {args.steps} steps x {args.rounds} rounds per cache; (wall, CPU) seconds per step, medians",
            "order": "every (variant, cache) pair runs a window or round before the next starts, the first "
                     "alternating; each in a worker thread",
            "intra_op_threads": threads or torch.get_num_threads(),
            "machine": "shared 2-core CPU: other sessions may have been compiling or testing at the same time",
            "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
        },
        "schemes": {n: s.to_dict() for n, s in schemes[last].items()},
        "eval": {
            "window_s": {f"{v} {n}": t for (v, n), t in eval_s.items()},
            "median_window": {f"{v} {n}": medians(t) for (v, n), t in eval_s.items()} if spans else None,
            "vs_fp16": {v: ratios({n: eval_s[v, n] for n in names}) for v in variants} if spans else None,
            f"logits_identical_{first}_{last}": same_logits if spans else None,
        },
        "decode": decode,
        "before": args.before,
        "weights": args.weights,
        "context": args.context,
        **provenance("cpu"),
        "commit": code_version,
    }
    out = args.out or ROOT / "bench" / "results" / "kv" / f"cpu-speed-{args.weights}-ctx{args.context}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result["summary"] = tables
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(tables))
    print(f"load average before {load_before}, after {os.getloadavg()}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
