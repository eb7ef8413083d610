"""One command that proves the GPU runtime correct on a lent GPU and measures its speed.

    python bench/gpu_check.py [--stages env,weights,...] [--commit SHA] [--out PATH]
    python bench/gpu_check.py --smoke      # CPU + Triton interpreter, tiny shapes: checks this script
    python -m bench.gpu_check ...          # the same: the other benches run only this way
                                           # (refused on a GPU machine, and where the interpreter is broken)
    make gpu-check                         # the same, with the machine's python3

Stages, in the default order (correctness first):

  env              device, SM count, clocks, driver, versions, commit; copy bandwidth and bf16 matmul rate
  weights          W4/W8 kernels, fp16/bf16, sym/asym, g64/g128/per-channel, act-order, M 1..300 vs float64
  attention        decode attention over fp16/fp8/int8/int4/int2 caches, GQA 4:1 and 1:1, windows vs float64;
                   quantize-on-write bit-identical to kv_reference (kvquant)
  engine           engine greedy tokens: CUDA graphs / eager Triton / reference attention, two random models
  tests            the CUDA-capable pytest files, compiled on the GPU (tests needing a package the machine
                   lacks, e.g. greenlet for calibration, skip and are listed; env lists the absent packages)
  kernel-speed     bench/kernels.py: Llama-3 8B and 70B shapes, M = 1, 16, 4096, against cuBLAS fp16 and
                   PyTorch's int4 kernel (tinygemm) in the same process
  attention-speed  bench/attention.py: batch 1 and 32, context 8k and 32k, default launch configuration
  engine-speed     lowbit bench: fp16, W4 g128, W4 + INT4 KV; batch 1 and 32, prompt 512, 128 new tokens;
                   transformers generate fp16 as the baseline

Each stage runs in a child process with its own time budget; a stage that fails or runs out of
time records why (its traceback, its output's tail) and the next one runs. The results file,
``bench/results/gpu/<device>-<commit>.json`` (and a copy in ``$OUT`` where the device tool sets
it), is rewritten as each stage ends, so a run cut off at its limit keeps what it measured; a
second call with other ``--stages`` adds to the same file. On the device machine there is no git:
pass ``--commit``. The whole check fits two calls under 9 minutes each:

    python bench/gpu_check.py --commit SHA --stages env,weights,attention,engine,tests
    python bench/gpu_check.py --commit SHA --stages kernel-speed,attention-speed,engine-speed

The table printed last gives each stage's pass/fail and the headline ratios against their targets
(issues 15 and 16; bench/README.md), each speed figure with the torch and Triton versions that made
it. ``--smoke`` times nothing that means anything and says so. No real stage runs the Triton
interpreter (TRITON_INTERPRET is dropped from their environment): Triton 3.6's, the lent machine's,
fails under numpy >= 2.4.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # `python bench/gpu_check.py`, the lent GPU machine's documented command: bench/ is
    sys.path.insert(0, str(ROOT))  # what Python put on the path, and `bench.*` needs the repository root

from bench import gpu_stages  # noqa: E402


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: int  # on the GPU; a smoke run gets SMOKE_BUDGET_S
    run: object  # gpu_stages function: (smoke) -> dict with "passed"


# Budgets (seconds on the GPU) are guesses until a run measures the stages: each call of the
# two-call split sums to 510 s, inside the device's 10-minute limit with start-up to spare.
STAGES = [
    Stage("env", 60, gpu_stages.environment),
    Stage("weights", 100, gpu_stages.weights),
    Stage("attention", 80, gpu_stages.attention),
    Stage("engine", 120, gpu_stages.engine),
    Stage("tests", 150, gpu_stages.tests),
    Stage("kernel-speed", 170, gpu_stages.kernel_speed),
    Stage("attention-speed", 120, gpu_stages.attention_speed),
    Stage("engine-speed", 220, gpu_stages.engine_speed),
]
BY_NAME = {s.name: s for s in STAGES}
SMOKE_BUDGET_S = 600
TAIL_LINES = 40


def run_stage(stage: Stage, args, budget: int) -> dict:
    """The stage in a child process: its output streams through, its result comes back as JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "bench.gpu_check", "--child", stage.name, "--child-out", str(result_file)]
        if args.smoke:
            cmd.append("--smoke")
        env = child_env(args.smoke, args.commit)
        started = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=ROOT)
        tail = collections.deque(maxlen=TAIL_LINES)
        reader = threading.Thread(target=_relay, args=(proc.stdout, stage.name, tail), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
        wall = time.time() - started
        if result_file.exists():
            result = json.loads(result_file.read_text())
        elif wall >= budget:
            result = {"passed": False, "error": f"ran out of its {budget} s budget"}
        else:
            result = {"passed": False, "error": f"the child process died (exit {proc.returncode})"}
        return {**result, "wall_s": round(wall, 1), "budget_s": budget, "output_tail": list(tail)}


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


def child(name: str, out: Path, smoke: bool) -> None:
    """Inside the child: run one stage, write its result (or its traceback)."""
    try:
        result = BY_NAME[name].run(smoke)
    except BaseException:  # noqa: BLE001 - a stage's failure of any kind is its result
        result = {"passed": False, "error": traceback.format_exc(limit=20)}
    out.write_text(json.dumps(result, indent=1, default=str))


def results_path(args, device_name: str) -> Path:
    if args.out:
        return args.out
    if args.smoke:
        return Path(tempfile.gettempdir()) / "gpu-check-smoke.json"
    from bench.gpu import device_slug

    return ROOT / "bench" / "results" / "gpu" / f"{device_slug(device_name)}-{args.commit}.json"


def save(record: dict, path: Path) -> None:
    """Write atomically, and a copy into $OUT when the device tool set it (only $OUT comes back)."""
    text = json.dumps(record, indent=1, default=str) + "\n"
    targets = [path] + ([Path(os.environ["OUT"]) / path.name] if os.environ.get("OUT") else [])
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        partial.write_text(text)
        partial.replace(target)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default=",".join(s.name for s in STAGES),
                    help="comma-separated, run in the order given")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes: checks the script")
    ap.add_argument("--commit", default=None, help="the commit under test (default: git, else 'unknown')")
    ap.add_argument("--out", type=Path, help="results JSON (default: bench/results/gpu/<device>-<commit>.json)")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every stage's time budget")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.child_out, args.smoke)
        return 0
    names = [n.strip() for n in args.stages.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
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
    for name in names:
        stage = BY_NAME[name]
        budget = SMOKE_BUDGET_S if args.smoke else round(stage.budget_s * args.budget_scale)
        record["stages"][name] = {**run_stage(stage, args, budget), "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")}
        save(record, path)
    record["headlines"] = gpu_stages.headlines(record["stages"])
    save(record, path)
    print(gpu_stages.summary_table(record, names))
    print(f"results: {path}")
    return 0 if all(record["stages"][n].get("passed") for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())
