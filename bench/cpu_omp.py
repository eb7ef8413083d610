"""What OpenMP's settings do to CPU decode: wait policy, spin count, thread count and binding, on a quiet
machine and under load, side by side.

    flock /tmp/lowbit-bench.lock python -m bench.cpu_omp [--settings passive@2,spin2000@2,passive@1]
        [--shapes smollm2-135m,llama-1b] [--models w4,float32] [--busy 2] [--rev REV [--overlay PATHS]]

Models as ``bench.cpu_decode`` builds them (random weights, real shapes; W4 g64 through the CPU kernels
with bf16 embedding/lm_head, and the float32 model), fp16 KV cache. A setting is an OpenMP environment
and a thread count, ``NAME@THREADS``: ``passive`` (``OMP_WAIT_POLICY=PASSIVE``, the CLI's default),
``active``, ``default`` (neither: libgomp spins 300,000 times, then sleeps), ``spinN``
(``GOMP_SPINCOUNT=N``, no policy: spin N times, then sleep), ``bind`` (PASSIVE with ``OMP_PROC_BIND=close``,
``OMP_PLACES=cores``: a thread pinned to each core); ``+`` joins them (``passive+spin300``: the spin count
wins over the policy's in libgomp). OpenMP reads them when torch loads, so each setting
runs in a child process started with it (every ``OMP_*``/``GOMP_*``/``KMP_*`` variable of the caller
dropped), the settings alternating round by round so a change in load slows each alike. A child builds
the models and times ``--steps`` greedy decode steps after a 32-token prompt per model and batch (1 and
8; ``--path``: ``decoder(token, cache, pos)`` over a ``LockstepCache`` as ``bench.cpu_decode`` times it, or
``Engine.step``, ``bench.cpu_overhead``'s paths): median wall ms (what a user waits) and process CPU ms (both threads' work and spinning), and the
cost of one small parallel region (``torch.add`` of 2 x 32,768 floats, at or over ATen's grain: one
region of two chunks; median of 2,000 calls, us). ``--busy N``: N busy-loop processes run throughout,
the load other jobs put on a shared machine. Medians over rounds per setting, and each setting over
the first. ``--rev REV``: the children run the code of git revision REV (``git archive``; with
``--overlay PATHS`` from this tree), not a working tree others are editing, with kernels compiled for
it (``LOWBIT_NATIVE_CACHE`` in the tree unless set). Raw JSON with device, versions, commit, command
and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OMP_PREFIXES = ("OMP_", "GOMP_", "KMP_")
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
NAMED = {"passive": PASSIVE, "active": {"OMP_WAIT_POLICY": "ACTIVE"}, "default": {},
         "bind": PASSIVE | {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}}


def setting_env(setting: str) -> tuple[dict, int]:
    """``NAME[+NAME]@THREADS`` -> (OpenMP variables, thread count); a clear error for an unknown name."""
    names, _, threads = setting.partition("@")
    env = {}
    for name in names.split("+"):
        if name.startswith("spin") and name[4:].isdigit():
            env["GOMP_SPINCOUNT"] = name[4:]
        elif name in NAMED:
            env.update(NAMED[name])
        else:
            raise SystemExit(f"unknown setting {name!r}: one of {', '.join(NAMED)} or spinN (e.g. spin2000)")
    if not threads.isdigit():
        raise SystemExit(f"setting {setting!r}: NAME@THREADS, e.g. passive@2")
    return env, int(threads)


def region_us(calls: int = 2000) -> float:
    """Median us of a small ``torch.add`` that ATen splits into two chunks (one parallel region)."""
    import torch

    a, b = torch.ones(2 * 32768), torch.ones(2 * 32768)
    out = torch.empty_like(a)
    times = []
    for _ in range(calls):
        t = time.perf_counter_ns()
        torch.add(a, b, out=out)
        times.append(time.perf_counter_ns() - t)
    return statistics.median(times) / 1e3


def child(shape: str, models: list[str], threads: int, steps: int, path: str) -> dict:
    """In a process started with one setting: region cost, then per model and batch the median step."""
    import torch

    from bench.cpu_decode import SHAPES, random_model
    from bench.cpu_overhead import PATHS

    torch.set_num_threads(threads)
    region_us(200)  # warm-up: the thread pool starts on the first region
    out = {"region_us": region_us()}
    for name in models:
        model = random_model(SHAPES[shape], quantized=name == "w4")
        for batch in (1, 8):
            PATHS[path](model, batch, 2)  # warm-up: first calls allocate and pick kernels
            times = PATHS[path](model, batch, steps)  # (process CPU, wall) ns
            out[f"{name}_b{batch}_wall_ms"] = statistics.median(w for _, w in times) / 1e6
            out[f"{name}_b{batch}_cpu_ms"] = statistics.median(c for c, _ in times) / 1e6
        del model
    return out


def busy_loops(n: int) -> list[subprocess.Popen]:
    """N processes that spin on a core each (another job's load), ended by the caller."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def compare(shape: str, settings: list[str], models: list[str], rounds: int, steps: int, path: str, code: Path) -> dict:
    """Child processes per setting (the code under ``code``), alternating round by round; medians over rounds."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(OMP_PREFIXES)}
    samples = {s: [] for s in settings}
    for _ in range(rounds):
        for s in settings:
            env, threads = setting_env(s)
            command = [sys.executable, "-m", "bench.cpu_omp", "--child", shape, "--models", ",".join(models),
                       "--threads", str(threads), "--steps", str(steps), "--path", path]
            run = subprocess.run(command, env=base | env, cwd=code, capture_output=True, text=True)
            if run.returncode:
                raise SystemExit(f"{shape} {s}: the child failed:\n{run.stderr[-3000:]}")
            out = run.stdout
            samples[s].append({**json.loads(out.strip().splitlines()[-1]), "load_average": os.getloadavg()[0]})
            print(shape, s, json.dumps(samples[s][-1]), flush=True)
    medians = {s: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for s, rows in samples.items()}
    first = medians[settings[0]]
    over_first = {s: {k: m[k] / first[k] for k in m if k.endswith(("_ms", "_us"))} for s, m in medians.items()}
    return {"shape": shape, "env": {s: setting_env(s)[0] for s in settings}, "median_of_rounds": medians,
            f"over_{settings[0]}": over_first, "rounds": samples}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="passive@2,spin2000@2,passive@1")
    ap.add_argument("--shapes", default="smollm2-135m")
    ap.add_argument("--models", default="w4,float32")
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes running throughout (load)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24, help="decode steps per round, model and batch")
    ap.add_argument("--path", default="decoder", choices=("decoder", "engine"),
                    help="decoder(token, cache, pos) steps (what bench.cpu_decode times) or Engine.step")
    ap.add_argument("--rev", help="run the code of this git revision (git archive), not the working tree")
    ap.add_argument("--overlay", default="", help="with --rev: these paths (comma-separated) from this tree")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu" / "cpu-omp.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    models = args.models.split(",")
    if args.child:
        print(json.dumps(child(args.child, models, args.threads, args.steps, args.path)))
        return
    from bench.results_file import write_result
    from evals.provenance import commit, cpu_name, versions

    settings = args.settings.split(",")
    for s in settings:
        setting_env(s)  # every name checked before any work
    result = {"commit": commit(), "device": f"cpu: {cpu_name()}", "cores": os.cpu_count(), "versions": versions(),
              "protocol": __doc__.split("\n\n", 2)[2].strip(), "command": "python -m bench.cpu_omp " + " ".join(sys.argv[1:]),
              "busy_processes": args.busy, "load_average_start": os.getloadavg(), "rows": []}
    with tempfile.TemporaryDirectory(prefix="lowbit-omp-") as tree:
        code = ROOT
        if args.rev:
            from bench.cpu_overhead import tree_at

            overlay = ["bench/cpu_omp.py", *filter(None, args.overlay.split(","))]
            code = Path(tree_at(args.rev, tree, overlay))
            # its own compiled kernels: one cache shared with a tree whose sources differ rebuilds over it
            os.environ.setdefault("LOWBIT_NATIVE_CACHE", str(code / ".native-cache"))
            sha = subprocess.run(["git", "rev-parse", args.rev], cwd=ROOT, capture_output=True, text=True).stdout.strip()
            result["code"] = {"revision": args.rev, "sha": sha, "overlay": overlay}
        loops = busy_loops(args.busy)
        try:
            for shape in args.shapes.split(","):
                result["rows"].append(compare(shape, settings, models, args.rounds, args.steps, args.path, code))
        finally:
            for p in loops:
                p.kill()
                p.wait()
    write_result(args.out, result)


if __name__ == "__main__":
    main()
