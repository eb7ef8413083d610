"""lowbit's native int4 matmul for few rows (runtime/cpu_int4_gemm.py) against aten's int4 kernel and
a dense bf16 product, per Linear shape and row count, side by side.

    flock /tmp/lowbit-bench.lock python -m bench.cpu_int4_gemm [--rows 1,2,4,8,16,32] [--threads 1,2]

Per shape (SmolLM2-135M's and a 1B model's Linears, W4 g64 random nibbles in
``_convert_weight_to_int4pack_for_cpu``'s layout) and rows M: ``aten._weight_int4pack_mm_for_cpu``,
each path of lowbit's kernel this CPU has (``amx``, ``avx512``; ``portable`` with
``--portable``), from 16 rows Int4Slots' prefill path (``scratch``: the weight dequantized into
the reused bf16 scratch by runtime/native/int4_weights.cpp, then ``F.linear``), and the dense bf16
product of a weight of the same shape (``torch.mv`` at one row, ``F.linear`` above: what a float
model's Linear costs, 4x the bytes). The variants alternate within
each repeat (a busy machine slows them alike); a sample is enough calls for ~``--sample-ms``;
medians of ``--repeats``. At 1 thread the clock is process CPU time; at more, wall time (CPU
time beside it). GB/s: packed weight plus scale_zeros bytes (the dense weight's bytes for dense)
over the median. Raw JSON with device, versions, commit and load averages under bench/results/cpu/.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads, as the lowbit CLI does

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.results_file import write_result  # noqa: E402
from evals.provenance import commit, cpu_name, versions  # noqa: E402
from runtime import cpu_int4_gemm, cpu_int4_layout, native  # noqa: E402
from runtime import cpu_linear  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GROUP = 64
SHAPES = {  # (out_features, in_features) of each distinct decoder Linear
    "smollm2-135m": [(576, 576), (1536, 576), (576, 1536), (192, 576)],
    "llama-1b": [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192)],
}


def variants(n: int, k: int, rows: int, paths: list[str], g: torch.Generator) -> tuple[dict, dict]:
    """The callables to time at this shape and row count, and the bytes each reads."""
    u = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
    scale_zeros = (torch.rand(k // GROUP, n, 2, generator=g) * 0.01).bfloat16()
    dense = torch.randn(n, k, generator=g).bfloat16()
    a = torch.randn(rows, k, generator=g).bfloat16()
    layout = cpu_int4_layout.int4_layout()
    fns = {"aten": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(a, packed, GROUP, scale_zeros)}
    for path in paths:
        fns[path] = lambda path=path: cpu_int4_gemm.matmul(a, packed, GROUP, scale_zeros, layout, path=path)
    if rows >= 16 and cpu_int4_layout.int4_layout() is not None:  # Int4Slots' prefill path (native dequantizer)
        slots = cpu_linear.Int4Slots(packed, scale_zeros, GROUP, None, 4)
        fns["scratch"] = lambda: F.linear(a, slots.dequantized(cpu_linear.scratch(k, n)))
    fns["dense"] = (lambda: torch.mv(dense, a[0])) if rows == 1 else (lambda: F.linear(a, dense))
    quantized = packed.nbytes + scale_zeros.nbytes
    return fns, {name: dense.nbytes if name == "dense" else quantized for name in fns}  # scratch: its input


def sample(fn, calls: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per call over ``calls`` calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls


def measure(fns: dict, repeats: int, sample_ms: float) -> dict:
    """Median ms per call of each variant, the variants alternating within each repeat."""
    calls = {}
    for name, fn in fns.items():
        fn()  # warm-up (first call builds the native kernel, allocates)
        calls[name] = max(1, int(sample_ms / 1e3 / max(sample(fn, 3)[0], 1e-7)))
    walls, cpus = {name: [] for name in fns}, {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu = sample(fn, calls[name])
            walls[name].append(wall)
            cpus[name].append(cpu)
    return {name: {"wall_ms": 1e3 * statistics.median(walls[name]), "cpu_ms": 1e3 * statistics.median(cpus[name]),
                   "calls_per_sample": calls[name]} for name in fns}


def time_grid(args, shapes: dict, variants, paths: list[str], result: dict) -> None:
    """Every (threads, shape, rows) of ``args``: ``variants(n, k, rows, paths, generator)``'s functions
    timed side by side (``measure``), appended to ``result["runs"]`` and printed (the int4 and int8
    benches alike). One thread: process CPU time; more: wall."""
    g = torch.Generator().manual_seed(0)
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        clock = "cpu_ms" if threads == 1 else "wall_ms"
        for shape in args.shapes.split(","):
            for n, k in shapes[shape]:
                for rows in [int(r) for r in args.rows.split(",")]:
                    fns, nbytes = variants(n, k, rows, paths, g)
                    times = measure(fns, args.repeats, args.sample_ms)
                    for name, t in times.items():
                        t["gb_per_s"] = nbytes[name] / t[clock] / 1e6
                    result["runs"].append({"threads": threads, "clock": clock, "shape": shape, "n": n, "k": k,
                                           "rows": rows, "times": times})
                    print(f"{threads}t {n:5d}x{k:<5d} M={rows:<3d}", "  ".join(
                        f"{name} {t[clock]:.3f}" for name, t in times.items()),
                        f"  aten/{paths[0]} {times['aten'][clock] / times[paths[0]][clock]:.2f}x", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sample-ms", type=float, default=20.0)
    parser.add_argument("--portable", action="store_true", help="time the portable loop too")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/cpu/cpu-int4-gemm.json")
    args = parser.parse_args()
    best = cpu_int4_gemm.best_path()
    if best is None:
        raise SystemExit("the native int4 kernel cannot be built here (see the warning above)")
    paths = [p for p in reversed(native.matmul_paths("int4_gemm"))
             if p != "portable" or args.portable]
    result = {"device": cpu_name(), "versions": versions(), "commit": commit(), "command": " ".join(
        ["python -m bench.cpu_int4_gemm", *os.sys.argv[1:]]), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "best_path": best, "group": GROUP, "load_average_start": os.getloadavg(), "protocol": __doc__.split("\n\n", 2)[2],
        "runs": []}
    time_grid(args, SHAPES, variants, paths, result)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
