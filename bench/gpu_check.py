"""One command that proves the GPU runtime correct on a lent GPU and measures its speed.

    python bench/gpu_check.py --commit SHA --call 1    # then --call 2: the whole check, two device calls
    python bench/gpu_check.py [--stages env,weights+attention,...] [--commit SHA] [--out PATH]
    python bench/gpu_check.py --smoke      # CPU + Triton interpreter, tiny shapes: checks this script
    python -m bench.gpu_check ...          # the same: the other benches run only this way
                                           # (refused on a GPU machine, and where the interpreter is broken)
    make gpu-check CALL=1                  # the same, with the machine's python3

Stages (correctness first):

  env              device, SM count, clocks, driver, versions, commit; copy bandwidth and bf16 matmul rate
  weights          W4/W8 kernels, fp16/bf16, sym/asym, g64/g128/per-channel, act-order, M 1..300 vs float64,
                   each on two fixed launch configurations per M regime (no autotuning)
  attention        decode attention over fp16/fp8/int8/int4/int2 caches, GQA 4:1 and 1:1, windows vs float64;
                   quantize-on-write bit-identical to kv_reference (kvquant)
  engine           engine greedy tokens: CUDA graphs / eager Triton / reference attention, two random models
                   (GEMMs on their default configurations: no tuning)
  tests            the CUDA-capable pytest files, compiled on the GPU (tests needing a package the machine
                   lacks, e.g. greenlet for calibration, skip and are listed; env lists the absent packages)
  kernel-speed     bench/kernels.py: Llama-3 8B and 70B shapes, M = 1, 4, 16, 4096, against cuBLAS fp16 and
                   PyTorch's int4 kernel (tinygemm) in the same process, one shape at a time (its matmul
                   candidates compiled first in parallel processes: bench/gpu_compiles.py; engine-speed too)
  attention-speed  bench/attention.py: batch 1 and 32, context 8k and 32k, default launch configuration
                   and the five others of its sweep
  engine-speed     lowbit bench: transformers generate fp16 (the baseline) first, then fp16, W4 g128,
                   W4 + INT4 KV; batch 1 and 32, prompt 512, 128 new tokens

Each stage runs in child processes with its own time budget; a stage that fails or runs out of
time records why (its traceback, its output's tail) and the next one runs. A stage saves what it
has after each case, shape or row (``report``), so one cut at its budget keeps what it measured.
``--stages`` runs its comma-separated steps in order; ``a+b`` runs stages a and b at once (the
correctness stages only: they time nothing, and compiling, their cost, is one CPU core per
process), and a stage with shards splits its cases over that many processes. The results file,
``bench/results/gpu/<device>-<commit>.json`` (and a copy in ``$OUT`` where the device tool sets
it), is rewritten as each stage ends; a second call adds to the same file. On the device machine
there is no git: pass ``--commit``.

The two calls (``CALLS``) fit the device's budget: 15 minutes in all, start-up and idle included,
so two commands of about 5.5 minutes each (budgets below, from the first run's walls). When call
1 ends early, call 2 may take the time left: ``--budget-scale`` = (the device's budget_left_s less
~90 s for start-up and hand-back) / 315, the sum of call 2's budgets. The table
printed last gives each stage's pass/fail and the headline ratios against their targets (issues
15 and 16; bench/README.md), each speed figure with the torch and Triton versions that made it.
``--smoke`` times nothing that means anything and says so. No real stage runs the Triton
interpreter (TRITON_INTERPRET is dropped from their environment): Triton 3.6's, the lent
machine's, fails under numpy >= 2.4.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # `python bench/gpu_check.py`, the lent GPU machine's documented command: bench/ is
    # what Python put first on the path (its kernels.py shadows the `kernels` package transformers looks
    # for), and `bench.*` needs the repository root in its place
    here = Path(__file__).resolve().parent
    sys.path[:] = [str(here.parent)] + [p for p in sys.path if Path(p or ".").resolve() != here]

from bench import gpu_headlines, gpu_stages  # noqa: E402


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: int  # on the GPU; a smoke run gets SMOKE_BUDGET_S
    run: object  # gpu_stages function: (smoke, shard, report) -> dict with "passed"
    shards: int = 1  # processes that split its cases (correctness stages: compiling is one core each)


# Budgets (seconds on the GPU). First run (H200, 1213cd1, every stage alone, ~17 autotuned candidates
# per GEMM shape and M bucket): env 15 s, attention 46 s, kernel-speed 129 s, attention-speed 27 s
# (no sweep); weights, engine and tests ran out of 100, 120 and 128 s, engine-speed of the call after
# its fp16 rows. Since then (bench/results/gpu/NOTES.md, `python -m bench.gpu_compiles`): weights
# runs 2 fixed configurations (was 80 tunings, 1216 candidates, 870 compiles) over 8 processes, the
# engine check no tuning (was 100 tunings, 81 compiles) over 4, tests one process per file.
STAGES = [
    Stage("env", 25, gpu_stages.environment),
    Stage("weights", 150, gpu_stages.weights, shards=8),
    Stage("attention", 150, gpu_stages.attention, shards=2),
    Stage("engine", 150, gpu_stages.engine, shards=4),
    Stage("tests", 150, gpu_stages.tests, shards=len(gpu_stages.GPU_TEST_FILES)),
    Stage("kernel-speed", 145, gpu_stages.kernel_speed),
    Stage("attention-speed", 60, gpu_stages.attention_speed),
    Stage("engine-speed", 255, gpu_stages.engine_speed),
]
BY_NAME = {s.name: s for s in STAGES}
# Each call's steps: ~25 + 150 + 145 = 320 s and 60 + 255 = 315 s of budgets, plus a few seconds of
# Python start-up per step: inside 5.5 minutes each.
CALLS = {
    1: "env,weights+attention+engine+tests,kernel-speed",
    2: "attention-speed,engine-speed",
}
SMOKE_BUDGET_S = 600
SMOKE_SHARDS = 2  # a smoke run splits stages in two at most (CI has 2 cores): the merge is still checked
TAIL_LINES = 40
SAVE_EVERY_S = 10  # how often a running stage's partial results reach the results file


def run_stage(stage: Stage, args, budget: int, on_progress=None) -> dict:
    """The stage's shards, each in a child process, at once; their results merged. ``on_progress``
    gets the merged partial results while they run (the results file keeps them if the device call
    itself is cut)."""
    shards = min(stage.shards, SMOKE_SHARDS) if args.smoke else stage.shards
    started = time.time()
    latest = {}

    def on_partial(i: int, result: dict) -> None:
        latest[i] = result
        if on_progress:
            on_progress(gpu_stages.merge_shards([latest[k] for k in sorted(latest)]))

    with ThreadPoolExecutor(max_workers=shards) as pool:
        parts = list(pool.map(lambda i: run_child(stage, args, budget, (i, shards), lambda r: on_partial(i, r)),
                              range(shards)))
    merged = gpu_stages.merge_shards([{k: v for k, v in p.items() if k != "output_tail"} for p in parts])
    tail = [line for p in parts for line in p["output_tail"]][-TAIL_LINES:]
    return {**merged, "shards": shards, "wall_s": round(time.time() - started, 1), "budget_s": budget,
            "output_tail": tail}


def run_child(stage: Stage, args, budget: int, shard: tuple[int, int], on_partial=None) -> dict:
    """One child process: its output streams through, its result (or, cut at the budget, what it
    reported last) comes back as JSON; ``on_partial`` gets each partial result it saves meanwhile."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = child_command(stage.name, result_file, shard, args.smoke)
        label = stage.name if shard[1] == 1 else f"{stage.name} {shard[0] + 1}/{shard[1]}"
        started = time.time()
        # its own process group: a cut stage's grandchildren (pytest) stop with it
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=child_env(args.smoke, args.commit), cwd=ROOT, start_new_session=True)
        tail = collections.deque(maxlen=TAIL_LINES)
        reader = threading.Thread(target=_relay, args=(proc.stdout, label, tail), daemon=True)
        reader.start()
        wait_watching(proc, started + budget, result_file, on_partial)
        reader.join(timeout=5)
        wall = time.time() - started
        result = json.loads(result_file.read_text()) if result_file.exists() else None
        if result is None or result.get("partial"):
            why = (f"ran out of its {budget} s budget" if wall >= budget
                   else f"the child process died (exit {proc.returncode})")
            kept = "; what it had measured is kept" if result else ""
            result = {**(result or {}), "passed": False, "error": f"{label}: {why}{kept}"}
        return {**result, "wall_s": round(wall, 1), "output_tail": list(tail)}


def wait_watching(proc, deadline: float, result_file: Path, on_partial) -> None:
    """Wait for ``proc`` until ``deadline`` (then kill its process group), passing each new version of
    its result file to ``on_partial`` every SAVE_EVERY_S."""
    seen = None
    while True:
        try:
            proc.wait(timeout=max(0.1, min(SAVE_EVERY_S, deadline - time.time())))
            return
        except subprocess.TimeoutExpired:
            if time.time() >= deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return
        if on_partial and result_file.exists() and result_file.stat().st_mtime != seen:
            seen = result_file.stat().st_mtime
            try:
                on_partial(json.loads(result_file.read_text()))
            except (OSError, ValueError):  # replaced meanwhile: the next look reads it
                seen = None


def child_command(name: str, result_file: Path, shard: tuple[int, int], smoke: bool) -> list[str]:
    return [sys.executable, "-m", "bench.gpu_check", "--child", name, "--child-out", str(result_file),
            "--shard", f"{shard[0]}/{shard[1]}"] + (["--smoke"] if smoke else [])


def child_env(smoke: bool, commit: str) -> dict:
    """A stage's environment: only a smoke stage may run the Triton interpreter (it sets
    TRITON_INTERPRET itself); a real one compiles, whatever this shell has set."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LOWBIT_COMMIT": commit}
    env.pop("TRITON_INTERPRET", None)
    return env


def smoke_refusal() -> str | None:
    """Why --smoke must not run here, or None: it is the interpreter on CPU, a check of this script
    for machines without a GPU; a GPU machine runs the stages compiled."""
    import torch

    if torch.cuda.is_available():
        return ("--smoke runs the kernels in the Triton interpreter on CPU, to check this script where no GPU "
                "is; this machine has one: run the stages themselves")
    return gpu_stages.interpreter_problem()


def _relay(stream, name: str, tail) -> None:
    for line in stream:
        print(f"[{name}] {line}", end="", flush=True)
        tail.append(line.rstrip("\n"))


def child(name: str, out: Path, smoke: bool, shard: tuple[int, int]) -> None:
    """Inside the child: run one stage (or shard), saving what it reports as it goes (marked
    partial), then its result or its traceback."""
    def report(partial: dict) -> None:
        write_json(out, {**partial, "partial": True})

    stages = BY_NAME
    if ":" in name:  # another script's stage, "module:stage" (bench/gpu_first.py's): the same runner
        module, name = name.split(":")
        stages = importlib.import_module(module).BY_NAME
    try:
        result = stages[name].run(smoke, shard=shard, report=report)
    except BaseException:  # noqa: BLE001 - a stage's failure of any kind is its result
        kept = json.loads(out.read_text()) if out.exists() else {}
        result = {**kept, "partial": False, "passed": False, "error": traceback.format_exc(limit=20)}
    write_json(out, result)


def write_json(path: Path, record: dict) -> None:
    """Atomically: a reader (or a kill) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record, indent=1, default=str) + "\n")
    partial.replace(path)


def results_path(args, device_name: str) -> Path:
    if args.out:
        return args.out
    if args.smoke:
        return Path(tempfile.gettempdir()) / "gpu-check-smoke.json"
    from bench.gpu import device_slug

    return ROOT / "bench" / "results" / "gpu" / f"{device_slug(device_name)}-{args.commit}.json"


def save(record: dict, path: Path) -> None:
    """The results file, and a copy into $OUT when the device tool set it (only $OUT comes back)."""
    for target in [path] + ([Path(os.environ["OUT"]) / path.name] if os.environ.get("OUT") else []):
        write_json(target, record)


def plan(args, ap) -> list[list[str]]:
    """The steps to run: ``--call N``'s preset or ``--stages`` (commas: steps in order; ``+``: stages
    of one step, run at once); by default both calls' steps."""
    if args.call and args.stages:
        ap.error("--call and --stages: give one")
    text = CALLS[args.call] if args.call else args.stages or ",".join(CALLS.values())
    steps = [[n.strip() for n in step.split("+") if n.strip()] for step in text.split(",") if step.strip()]
    unknown = [n for step in steps for n in step if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
    return steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--call", type=int, choices=sorted(CALLS), help="one device call's preset: " + "; ".join(
        f"{n}: {text}" for n, text in CALLS.items()))
    ap.add_argument("--stages", help="steps in order, comma-separated; a+b: stages run at once (default: "
                                     "both calls' steps)")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes: checks the script")
    ap.add_argument("--commit", default=None, help="the commit under test (default: git, else 'unknown')")
    ap.add_argument("--out", type=Path, help="results JSON (default: bench/results/gpu/<device>-<commit>.json)")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every stage's time budget")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.child_out, args.smoke, tuple(int(v) for v in args.shard.split("/")))
        return 0
    steps = plan(args, ap)
    names = [n for step in steps for n in step]
    if args.smoke and smoke_refusal():
        ap.error(smoke_refusal())
    args.commit = args.commit or gpu_stages.commit()
    device_name = gpu_stages.device_name(args.smoke)
    path = results_path(args, device_name)
    record = json.loads(path.read_text()) if path.exists() else {
        "check": "bench/gpu_check.py", "device": device_name, "commit": args.commit, "smoke": args.smoke,
        "note": "smoke: CPU + Triton interpreter on tiny shapes; no number in it means anything about speed"
        if args.smoke else "GPU run", "stages": {}}
    print(f"gpu_check: {device_name}, commit {args.commit}; stages {', '.join(names)}; results -> {path}", flush=True)
    lock = threading.Lock()

    def run_and_save(name: str) -> None:
        stage = BY_NAME[name]
        budget = SMOKE_BUDGET_S if args.smoke else round(stage.budget_s * args.budget_scale)

        def save_partial(partial: dict) -> None:  # replaced by the stage's result when it ends
            with lock:
                record["stages"][name] = {**partial, "passed": False, "wall_s": 0, "error": (
                    "still running when last saved: the device call ended before the stage did")}
                save(record, path)

        result = {**run_stage(stage, args, budget, save_partial), "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")}
        with lock:
            record["stages"][name] = result
            save(record, path)

    for step in steps:
        with ThreadPoolExecutor(max_workers=len(step)) as pool:
            list(pool.map(run_and_save, step))
    record["headlines"] = gpu_headlines.headlines(record["stages"])
    save(record, path)
    print(gpu_headlines.summary_table(record, names))
    print(f"results: {path}")
    return 0 if all(record["stages"][n].get("passed") for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())
