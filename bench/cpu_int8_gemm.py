"""lowbit's native 8-bit per-channel matmul for few rows (runtime/cpu_int8_gemm.py) against aten's
int8 kernel, Int8Channels' scratch path and a dense bf16 product, per Linear shape and row count,
side by side.

    flock /tmp/lowbit-bench.lock python -m bench.cpu_int8_gemm [--rows 1,2,4,8,16,32,64,128] [--threads 1]

Per shape (SmolLM2-135M's and a 1B model's Linears, random int8 codes [N, K] and bf16 scales [N],
as Int8Channels holds them) and rows M: ``aten._weight_int8pack_mm``, each path of lowbit's kernel
this CPU has (``amx``, ``avx512``; ``portable`` with ``--portable``), Int8Channels' prefill path
(``scratch``: the codes copied into the reused bf16 scratch, exact, then ``F.linear`` and the
scales), and the dense bf16 product of a weight of the same shape (``torch.mv`` at one row,
``F.linear`` above: what a bf16 model's Linear costs, 2x the bytes). The variants alternate within
each repeat (a busy machine slows them alike); a sample is enough calls for ~``--sample-ms``;
medians of ``--repeats``. At 1 thread the clock is process CPU time; at more, wall time (CPU time
beside it). GB/s: codes plus scales bytes (the dense weight's bytes for dense) over the median.
Raw JSON with device, versions, commit and load averages under bench/results/cpu/.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads, as the lowbit CLI does

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.cpu_int4_gemm import time_grid  # noqa: E402  (variants alternating per repeat, medians)
from bench.results_file import write_result  # noqa: E402
from evals.provenance import commit, cpu_name, versions  # noqa: E402
from runtime import cpu_int8_gemm, native  # noqa: E402
from runtime import cpu_linear  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # (out_features, in_features) of each distinct decoder Linear
    "smollm2-135m": [(576, 576), (1536, 576), (576, 1536), (192, 576)],
    "llama-1b": [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192)],
}


def variants(n: int, k: int, rows: int, paths: list[str], g: torch.Generator) -> tuple[dict, dict]:
    """The callables to time at this shape and row count, and the bytes each reads."""
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, generator=g) * 0.01 + 1e-4).bfloat16()
    dense = torch.randn(n, k, generator=g).bfloat16()
    a = torch.randn(rows, k, generator=g).bfloat16()
    fns = {"aten": lambda: torch.ops.aten._weight_int8pack_mm(a, q, scales)}
    for path in paths:
        fns[path] = lambda path=path: cpu_int8_gemm.matmul(a, q, scales, path=path)
    fns["scratch"] = lambda: F.linear(a, cpu_linear.scratch(n, k).copy_(q)) * scales  # Int8Channels' prefill
    fns["dense"] = (lambda: torch.mv(dense, a[0])) if rows == 1 else (lambda: F.linear(a, dense))
    quantized = q.nbytes + scales.nbytes
    return fns, {name: dense.nbytes if name == "dense" else quantized for name in fns}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--threads", default="1")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sample-ms", type=float, default=20.0)
    parser.add_argument("--portable", action="store_true", help="time the portable loop too")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/cpu/cpu-int8-gemm.json")
    args = parser.parse_args()
    best = cpu_int8_gemm.best_path()
    if best is None:
        raise SystemExit("the native int8 kernel cannot be built here (see the warning above)")
    paths = [p for p in reversed(native.matmul_paths("int8_gemm"))
             if p != "portable" or args.portable]
    result = {"device": cpu_name(), "versions": versions(), "commit": commit(), "command": " ".join(
        ["python -m bench.cpu_int8_gemm", *os.sys.argv[1:]]), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "best_path": best, "load_average_start": os.getloadavg(), "protocol": __doc__.split("\n\n", 2)[2], "runs": []}
    time_grid(args, SHAPES, variants, paths, result)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
