"""lowbit's int4 weight-only matmul for few activation rows on CPU (decode, short prompts), on the
weights of :class:`runtime.cpu_linear.Int4Slots` as they are: the same packed nibbles and
``scale_zeros`` as ``aten._weight_int4pack_mm_for_cpu``, no second copy.

The aten kernel turns every weight into a float (``(u - 8) * scale + zero``) before multiplying it
by each row: compute-bound, its time grows almost linearly with the rows (bench/cpu_int4_gemm.py).
This one (runtime/native/int4_gemm.cpp) applies scale and zero once per group on the sums,
``y = sum_g s_g (a_g . u_g) + (z_g - 8 s_g) sum(a_g)``, with the nibbles as exact bf16 values:

* ``amx``: Sapphire Rapids' tile unit multiplies up to 16 rows at the cost of one, so time barely
  grows with rows;
* ``avx512``: AVX512-BF16 dot products (CPUs with AVX512-BF16 and no AMX, e.g. Zen 4);
* ``portable``: a plain loop the compiler vectorizes (other CPUs, and a partial last block of
  outputs on every CPU); slower than aten's kernel, so :func:`matmul` runs it only when asked.

:func:`matmul` returns None where it does not take a case, and the caller keeps the aten kernel.
"""

from __future__ import annotations

import torch

from runtime import native

MAX_ROWS = 128  # rows per call it takes (measured up to here against aten, bench/cpu_int4_gemm.py)
AVX512_ROWS = 2  # up to this many rows the AVX512-BF16 path beats AMX's tile setup (ties at 2)
# Fewer rows than this keep aten's kernel. One row was slower than aten's over weights streamed from
# memory (as a model's decode reads them: 4.3 vs 5.7 GB/s) until the kernel prefetched 2 KB ahead (the
# streamer restarts at every 4 KB page); now 1.2-1.4x aten's there (bench/results/cpu/NOTES.md)
MIN_ROWS = 1


def best_path() -> str | None:
    """The fastest path on this CPU (one of ``native.MATMUL_PATHS``), or None when the kernel cannot be
    built here or native kernels are off (``LOWBIT_NATIVE=0``)."""
    paths = native.matmul_paths("int4_gemm") if native.enabled() else []
    return paths[-1] if paths else None


def matmul(a: torch.Tensor, packed: torch.Tensor, group: int, scale_zeros: torch.Tensor, layout,
           path: str | None = None) -> torch.Tensor | None:
    """``aten._weight_int4pack_mm_for_cpu(a, packed, group, scale_zeros)`` (bf16 [M, N]) for
    ``a`` bf16 [M, K] with 1 <= M <= :data:`MAX_ROWS`, or None where the kernel does not take the
    case (fewer than :data:`MIN_ROWS` rows, another dtype or shape of ``a``, no compiler, ``LOWBIT_NATIVE=0``, an unknown
    ``layout``, only the portable path here: a CPU without AVX512-BF16, or a layout other than
    AVX512's blocks of 64). ``layout``: the :class:`runtime.cpu_linear.Int4Layout`
    of ``packed`` (``int4_layout()``). ``path`` forces one of ``native.MATMUL_PATHS`` (tests, benches); it
    must run here."""
    if layout is None or a.dim() != 2 or a.dtype != torch.bfloat16 or not 1 <= a.shape[0] <= MAX_ROWS:
        return None
    kernel = native.matmul_kernel("int4_gemm") if native.enabled() else None
    if kernel is None:
        return None
    module, best = kernel
    if path is None:
        if best == 0 or (layout.block_n, layout.halves) != (64, True) or a.shape[0] < MIN_ROWS:
            return None  # only the portable loop would run, slower than aten's kernel; or one row
        chosen = 1 if a.shape[0] <= AVX512_ROWS else best
    else:
        chosen = native.forced_path("int4_gemm", path)
    return module.int4_matmul(a.contiguous(), packed, group, scale_zeros, layout.block_n, layout.halves, chosen)
