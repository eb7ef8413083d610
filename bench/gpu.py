"""What the GPU benchmarks share: refusing to run without a GPU, the device's name and L2
size, and timing a list of calls with CUDA events (inside one CUDA graph where possible).

The benches run as ``python -m bench.<script>`` from the repository root.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time

import torch


def refuse_without_cuda(script: str, hint: str = "") -> None:
    """Exit with a clear message where nothing could be measured."""
    if not torch.cuda.is_available():
        sys.exit(f"{script} measures GPU kernels and needs a CUDA device; none is visible "
                 f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}). Nothing was measured.{hint}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("TRITON_INTERPRET=1 is set: the kernels would run in the interpreter. Unset it to benchmark.")


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def l2_bytes(device) -> int:
    if torch.device(device).type != "cuda":
        return 2**20  # a --smoke run on CPU: any small number
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20) or 50 * 2**20


def _run_all(calls):
    for c in calls:
        c()


def median_seconds_per_call(calls, samples: int, device, graph: bool = True) -> tuple[float, bool]:
    """Median over ``samples`` of (time to run every call once) / len(calls), and whether one
    CUDA graph ran them. A sequence that cannot be captured (a host sync inside) is timed as
    eager launches and says so. Without CUDA (a script's --smoke mode) this is wall time in
    the interpreter: it checks the script, never the speed."""
    if torch.device(device).type != "cuda":
        times = []
        for _ in range(samples):
            start = time.perf_counter()
            _run_all(calls)
            times.append((time.perf_counter() - start) / len(calls))
        return statistics.median(times), False
    run, graphed = (lambda: _run_all(calls)), False
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture: compilation, autotuning, allocator
            for _ in range(2):
                _run_all(calls)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                _run_all(calls)
            run, graphed = g.replay, True
        except RuntimeError:
            torch.cuda.synchronize()
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000 / len(calls))
    return statistics.median(times), graphed
