"""lowbit's 8-bit per-channel weight-only matmul for few activation rows on CPU (decode, short
prompts), on the weights of :class:`runtime.cpu_linear.Int8Channels` as they are: the same int8
codes ``q`` [N, K] and bf16 ``scales`` [N] as ``aten._weight_int8pack_mm``, no second copy.

The aten kernel multiplies every code, turned into a float, by each row with float FMAs:
compute-bound, its time grows linearly with the rows (bench/cpu_int8_gemm.py). This one
(runtime/native/int8_gemm.cpp) turns the codes into exact bf16 values once per call and multiplies
them with bf16 dot products, the scale applied once per output after the sum:

* ``amx``: Sapphire Rapids' tile unit multiplies up to 16 rows at the cost of one;
* ``avx512``: float dot products along K (codes shared by 4 outputs' rows); level with aten's kernel
  at 1-2 rows, behind above, so :func:`matmul` runs it only when asked;
* ``avx2``: the same in AVX2's 8 lanes (the builds of levels without AVX512-BF16: runtime/native);
  run only when asked;
* ``portable``: a plain loop; slower than aten's kernel, run only when asked.

:func:`matmul` takes AMX_MIN_ROWS..MAX_ROWS rows where AMX runs (bench/cpu_int8_gemm.py, 1 thread:
from 4 rows it beats aten on every measured shape, 2-5x at 8-32 rows on a 1B model's, and Int8Channels'
scratch path up to 32-128 rows); it returns None where it does not take a case, and the caller keeps
the aten kernel.
An asymmetric zero point stays the caller's correction (``- s z sum(x)``).
"""

from __future__ import annotations

import torch

from runtime import native

MAX_ROWS = 128  # rows per call it takes (measured up to here against aten, bench/cpu_int8_gemm.py)
AMX_MIN_ROWS = 4  # below, aten's kernel is as fast or faster (AMX pays for converting every code)


def best_path() -> str | None:
    """The fastest path on this CPU (one of ``native.MATMUL_PATHS``), or None when the kernel cannot be
    built here or native kernels are off (``LOWBIT_NATIVE=0``)."""
    paths = native.matmul_paths("int8_gemm") if native.enabled() else []
    return paths[-1] if paths else None


def matmul(a: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, path: str | None = None) -> torch.Tensor | None:
    """``aten._weight_int8pack_mm(a, q, scales)`` (bf16 [M, N]) for ``a`` bf16 [M, K] with
    :data:`AMX_MIN_ROWS` <= M <= :data:`MAX_ROWS`, ``q`` int8 [N, K] and ``scales`` bf16 [N], any
    N and K; or None where the kernel does not take the case (other dtypes or ranks, fewer rows, no
    compiler, ``LOWBIT_NATIVE=0``, no AMX here). ``path`` forces one of ``native.MATMUL_PATHS`` for any
    1..MAX_ROWS rows (tests, benches); it must run here."""
    if a.dim() != 2 or a.dtype != torch.bfloat16 or not 1 <= a.shape[0] <= MAX_ROWS:
        return None
    if q.dtype != torch.int8 or q.dim() != 2 or scales.dtype != torch.bfloat16:
        return None
    kernel = native.matmul_kernel("int8_gemm") if native.enabled() else None
    if kernel is None:
        return None
    module, best = kernel
    if path is None:
        if best != native.MATMUL_PATHS.index("amx") or a.shape[0] < AMX_MIN_ROWS:
            return None  # the other paths, and AMX at fewer rows, are no faster than aten's kernel
        chosen = best
    else:
        chosen = native.forced_path("int8_gemm", path)
    return module.int8_matmul(a.contiguous(), q, scales.reshape(-1), chosen)
