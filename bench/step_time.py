"""Wall time of an engine step on CPU, as ratios measured side by side in one process: this tree
against an earlier commit's runtime, and stepping from the main thread against a worker thread.

    python -m bench.step_time [--before e74c6dd] [--batch 8] [--steps 20] [--rounds 5] [--json OUT]

A secondary figure (the GPU numbers are what the engine is for): a tiny Llama (hidden 128, 4
layers, fp32) on the PyTorch reference path, ``batch`` requests decoding. The earlier commit's
``runtime`` package is taken from git into a temporary directory and imported as
``runtime_before`` (its imports rewritten), so both engines run in this process on the same
weights, in alternating rounds (the machine is shared: only ratios of medians mean anything).
Also times one packed prefill of ``batch`` prompts. Writes ``bench/results/engine/step-time-<commit>.json``.

Before and after are compared with 1 intra-op thread, and again from a worker thread: on a
loaded machine PyTorch's OpenMP threads, stepped from the main thread, wait actively for each
other and make a step 10-100x slower and erratic (``main_thread_over_worker_thread``; the same
main thread with ``OMP_WAIT_POLICY=PASSIVE`` or ``OMP_NUM_THREADS=1`` is as fast as a worker).
"""

from __future__ import annotations

import argparse
import importlib
import io
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.results_file import write_result
from evals.provenance import commit

ROOT = Path(__file__).resolve().parent.parent


def import_before(rev: str, into: Path, packages: tuple[str, ...] = ("runtime",)):
    """``runtime`` at ``rev`` as the package ``runtime_before`` (the others: this tree's), or each
    of ``packages`` at ``rev`` as ``<name>_before``, their imports of each other rewritten."""
    archive = subprocess.run(["git", "archive", rev, *packages], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    for name in packages:
        (into / name).rename(into / f"{name}_before")
    for name in packages:
        for path in (into / f"{name}_before").rglob("*.py"):
            text = path.read_text()
            for other in packages:
                text = re.sub(rf"\b{other}(?=[. ])", f"{other}_before", text).replace(f"{other}_before_before",
                                                                                    f"{other}_before")
            path.write_text(text)
    sys.path.insert(0, str(into))
    return importlib.import_module(f"{packages[0]}_before")


def decoding_engine(package, model_dir: Path, prompts: list[list[int]], new_tokens: int):
    model = package.load(model_dir, kv="fp16-r16")
    engine = package.Engine(model, max_batch=len(prompts), max_len=max(map(len, prompts)) + new_tokens)
    params = package.SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for p in prompts:
        engine.submit(p, params)
    while not engine.all_decoding:
        engine.step()
    return engine


def time_steps(engine, steps: int, thread: bool = False, intra_op_threads: int | None = None) -> float:
    """Median seconds per decode step over ``steps`` steps, from this thread or a worker thread,
    with PyTorch's intra-op threads as they are or set to ``intra_op_threads`` (in the stepping
    thread: OpenMP keeps the setting per thread)."""
    times = []

    def run():
        saved = torch.get_num_threads()
        if intra_op_threads:
            torch.set_num_threads(intra_op_threads)
        try:
            steps_timed()
        finally:
            torch.set_num_threads(saved)

    def steps_timed():
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)

    if thread:
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    else:
        run()
    return statistics.median(times)


def time_prefill(package, model_dir: Path, prompts: list[list[int]]) -> float:
    """Seconds of the first step of a fresh engine: every prompt prefilled (and a first token);
    1 intra-op thread, as the decode comparison."""
    model = package.load(model_dir, kv="fp16-r16")
    engine = package.Engine(model, max_batch=len(prompts), max_len=128, prefill_chunk=sum(map(len, prompts)))
    for p in prompts:
        engine.submit(p, package.SamplingParams(max_tokens=1, ignore_eos=True))
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        engine.step()
        return time.perf_counter() - t0
    finally:
        torch.set_num_threads(saved)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default="e74c6dd")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    import runtime
    from lowbit_testing.tiny_models import save_model, tiny_llama

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 150, (n,), generator=g).tolist() for n in range(5, 5 + 3 * args.batch, 3)]
    new_tokens = args.rounds * args.steps + 1
    with tempfile.TemporaryDirectory() as tmp:
        before = import_before(args.before, Path(tmp))
        model, tok = tiny_llama(hidden=128, layers=4)
        model_dir = save_model(model, tok, Path(tmp) / "m")
        # (package, step from a worker thread, intra-op threads): an engine each, so every variant
        # steps at the same context lengths round by round
        variants = {"before": (before, False, 1), "after": (runtime, False, 1),
                    "before_worker_thread": (before, True, None), "after_worker_thread": (runtime, True, None),
                    "after_main_thread": (runtime, False, None)}
        engines = {name: decoding_engine(package, model_dir, prompts, new_tokens)
                   for name, (package, _, _) in variants.items()}
        rounds = {k: [] for k in variants}
        prefill = {"before": [], "after": []}
        for _ in range(args.rounds):  # alternate, so a busy spell on the shared machine hits both
            for name, (_, thread, intra_op) in variants.items():
                rounds[name].append(time_steps(engines[name], args.steps, thread, intra_op))
            for name, package in (("before", before), ("after", runtime)):
                prefill[name].append(time_prefill(package, model_dir, prompts))
    med = {k: statistics.median(v) for k, v in rounds.items()}
    pre = {k: statistics.median(v) for k, v in prefill.items()}

    def paired(a: dict, x: str, y: str) -> float:
        """Median over rounds of x / y within the round (a busy spell hits both sides of a round)."""
        return statistics.median(p / q for p, q in zip(a[x], a[y]))

    record = dict(
        what="engine step wall time on CPU, tiny Llama (hidden 128, 4 layers, fp32, reference attention, fp16 KV); "
             "per-round medians, rounds alternating in one process; ratios: median over rounds of the round's "
             "ratio; only the ratios are meaningful",
        commit=commit(), before=args.before, torch=torch.__version__, threads=torch.get_num_threads(),
        batch=args.batch, steps_per_round=args.steps, rounds=args.rounds,
        decode_step_s=med, prefill_step_s=pre, per_round_decode_s=rounds, per_round_prefill_s=prefill,
        decode_after_over_before=paired(rounds, "after", "before"),
        decode_after_over_before_worker_thread=paired(rounds, "after_worker_thread", "before_worker_thread"),
        prefill_after_over_before=paired(prefill, "after", "before"),
        main_thread_over_worker_thread=paired(rounds, "after_main_thread", "after_worker_thread"),
        one_intra_op_thread_over_default_worker_thread=paired(rounds, "after", "after_worker_thread"))
    out = args.json or ROOT / "bench" / "results" / "engine" / f"step-time-{record['commit']}.json"
    write_result(out, record)
    print(f"decode step, batch {args.batch}: after/before {record['decode_after_over_before']:.3f} (1 intra-op "
          f"thread), {record['decode_after_over_before_worker_thread']:.3f} (worker thread, default threads)")
    print(f"prefill of {args.batch} prompts: after/before {record['prefill_after_over_before']:.3f} (1 intra-op thread)")
    print(f"main thread/worker thread, default intra-op threads: {record['main_thread_over_worker_thread']:.3f}; "
          f"1 intra-op thread/default (worker): {record['one_intra_op_thread_over_default_worker_thread']:.3f}")


if __name__ == "__main__":
    main()
