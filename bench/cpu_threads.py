"""How many threads CPU decode and prefill should use: 1 against 2 (or ``--threads``) in one run.

    flock /tmp/lowbit-bench.lock python -m bench.cpu_threads [--shapes smollm2-135m,llama-1b]

Models as ``bench.cpu_decode`` builds them (random weights, real shapes; W4 g64 through the CPU
kernels with bf16 embedding/lm_head, and the float32 model), with ``OMP_WAIT_POLICY=PASSIVE`` (the
CLI's default; set here before torch loads unless the caller set it). ``torch.set_num_threads`` is
switched inside one process, thread counts alternating round by round so a busy machine slows each
alike: wall time of a decode step (median of greedy steps after a 32-token prompt) at batch 1 and 8,
and of a prefill of ``--prefill`` tokens at batch 1 (a forward filling the cache). Wall time, not CPU
time: with two threads CPU time counts both. Raw JSON with device, versions, commit and the load
average before and after, under bench/results/cpu/.
"""

from __future__ import annotations

import os

import lowbit.cli_options  # noqa: E402,F401  OpenMP as the lowbit CLI sets it, before torch loads

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.cpu_decode import SHAPES, prefill_seconds, random_model, step_times  # noqa: E402
from bench.results_file import write_result  # noqa: E402
from evals.provenance import commit, cpu_name, versions  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def measure(model, threads: list[int], rounds: int, steps: int, prefill: int) -> dict:
    """Per thread count: median decode step wall ms at batch 1 and 8, median prefill wall ms."""
    samples = {t: {"decode_b1": [], "decode_b8": [], "prefill": []} for t in threads}
    for t in threads:  # warm-up at each count: first calls allocate and pick kernels
        torch.set_num_threads(t)
        step_times(model, 1, 8, 2)
        prefill_seconds(model, 16)
    for _ in range(rounds):
        for t in threads:
            torch.set_num_threads(t)
            for batch in (1, 8):
                samples[t][f"decode_b{batch}"] += [w for w, _ in step_times(model, batch, 32, steps)]
            samples[t]["prefill"].append(prefill_seconds(model, prefill))
    out = {}
    for t, kinds in samples.items():
        out[f"threads_{t}"] = {f"{kind}_ms": 1e3 * statistics.median(v) for kind, v in kinds.items()}
    first = out[f"threads_{threads[0]}"]
    for t in threads[1:]:
        out[f"threads_{t}_over_{threads[0]}"] = {k: out[f"threads_{t}"][k] / first[k] for k in first}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m,llama-1b")
    ap.add_argument("--models", default="w4,float32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per round and batch")
    ap.add_argument("--prefill", type=int, default=256, help="prompt tokens of the prefill timing")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu" / "cpu-threads.json")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    result = {"commit": commit(), "device": f"cpu: {cpu_name()}", "cores": os.cpu_count(),
              "torch_default_threads": torch.get_num_threads(),
              "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_"))},
              "versions": versions(), "protocol": __doc__.split("\n\n", 2)[2].strip(),
              "command": "python -m bench.cpu_threads " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                                 vars(args).items() if k != "out"),
              "load_average_start": os.getloadavg(), "rows": []}
    for shape in args.shapes.split(","):
        for name in args.models.split(","):
            model = random_model(SHAPES[shape], quantized=name == "w4")
            row = {"shape": shape, "model": name, **measure(model, threads, args.rounds, args.steps, args.prefill),
                   "load_average": os.getloadavg()[0]}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            del model
            gc.collect()
    write_result(args.out, result)


if __name__ == "__main__":
    main()
