"""Where a CPU decode step's time goes, and what OpenMP's wait policy and the thread count do to it.

    flock /tmp/lowbit-bench.lock python -m bench.cpu_overhead [--shapes smollm2-135m] [--policies passive,active,default]

Models as ``bench.cpu_decode`` builds them (random weights, real shapes; float32, and W4 g64 through
the CPU kernels with bf16 embedding/lm_head). Breakdown: the median decode step (``decoder(token,
cache, pos)`` after 32 prompt tokens) against a pass over its Linears alone, in the step's order, each
on an input of the shape it gets in the step (the weight-reading part: what fewer bytes per weight cut);
the rest is everything else (norms, RoPE, attention over a short cache, dtype conversions, Python
and dispatch), which bits do not change; wall and process CPU time (``--threads 1``: the work itself). Policies: a child process per OpenMP setting (it must be
set before torch loads), ``passive`` (OMP_WAIT_POLICY=PASSIVE, the CLI's default), ``active``,
``default`` (neither set: libgomp spins a while, then sleeps), timed in alternating rounds, each
at 1 and 2 threads, batch 1 and 8. Raw JSON with device, versions, commit and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.cpu_decode import SHAPES, itl, random_model, step_times
from evals.provenance import commit, cpu_name, versions

ROOT = Path(__file__).resolve().parent.parent
POLICIES = {"passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "active": {"OMP_WAIT_POLICY": "ACTIVE"}, "default": {}}


def breakdown(model, batch: int, steps: int = 16, repeats: int = 7) -> dict:
    """The median decode step against the median pass over its Linears alone (milliseconds), in wall
    time and in process CPU time (with one thread: the work itself, whatever else the machine runs)."""
    from runtime.cpu_linear import NarrowLinear
    from runtime.linear import QuantLinear

    linears = [m for m in model.decoder.modules() if isinstance(m, (QuantLinear, NarrowLinear, torch.nn.Linear))]
    shapes = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args: shapes.__setitem__(mod, args[0].shape)) for m in linears]
    step_times(model, batch, 32, 1)  # the last call of each Linear is a decode step's
    for h in hooks:
        h.remove()
    steps_taken = step_times(model, batch, 32, steps)
    inputs = [(module, torch.randn(shape)) for module, shape in shapes.items()]
    passes = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # every Linear once per pass, in the step's order: each weight read once
            wall, cpu = time.perf_counter(), time.process_time()
            for module, x in inputs:
                module(x)
            passes.append((time.perf_counter() - wall, time.process_time() - cpu))
    row = {"linears": len(shapes)}
    for i, clock in enumerate(("wall", "cpu")):
        step = statistics.median(t[i] for t in steps_taken)
        linear = statistics.median(t[i] for t in passes[1:])
        row |= {f"step_{clock}_ms": 1e3 * step, f"linears_{clock}_ms": 1e3 * linear,
                f"rest_{clock}_ms": 1e3 * (step - linear), f"rest_share_{clock}": (step - linear) / step}
    return row


def child(shape: str, steps: int) -> dict:
    """In a process started with one OpenMP setting: median ITL per model, thread count and batch."""
    models = {"float32": random_model(SHAPES[shape], quantized=False), "w4": random_model(SHAPES[shape], quantized=True)}
    out = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for batch in (1, 8):
            for name, model in models.items():
                itl(model, batch, 8, 2)  # warm-up
                out[f"{name}_b{batch}_t{threads}_ms"] = 1e3 * statistics.median(itl(model, batch, 32, steps))
    return out


def policies(shape: str, names: list[str], rounds: int, steps: int) -> dict:
    samples = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))} | POLICIES[name]
            out = subprocess.run([sys.executable, "-m", "bench.cpu_overhead", "--child", shape, "--steps", str(steps)],
                                 env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout
            samples[name].append({**json.loads(out.strip().splitlines()[-1]), "load_average": os.getloadavg()[0]})
            print(name, json.dumps(samples[name][-1]), flush=True)
    medians = {name: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for name, rows in samples.items()}
    return {"shape": shape, "env": {name: POLICIES[name] for name in names}, "median_of_rounds": medians,
            "rounds": samples}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m")
    ap.add_argument("--policies", default="passive,active,default", help="'' to skip the OpenMP comparison")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads for the breakdown (default: torch's)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu" / "cpu-overhead.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"commit": commit(), "device": f"cpu: {cpu_name()}", "threads": torch.get_num_threads(),
              "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_"))},
              "versions": versions(), "protocol": __doc__.split("\n\n", 2)[2].strip(),
              "note": "a shared 2-core machine: other sessions' jobs ran at the same time (load_average per row)",
              "load_average_start": os.getloadavg(), "breakdown": [], "policies": []}
    for shape in args.shapes.split(","):
        models = {"float32": random_model(SHAPES[shape], quantized=False), "w4": random_model(SHAPES[shape], quantized=True)}
        for batch in (1, 8):
            for name, model in models.items():
                row = {"shape": shape, "model": name, "batch": batch, **breakdown(model, batch),
                       "load_average": os.getloadavg()[0]}
                result["breakdown"].append(row)
                print(json.dumps(row), flush=True)
        del models
        if args.policies:
            result["policies"].append(policies(shape, args.policies.split(","), args.rounds, args.steps))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
