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
* ``avx2``: float FMAs on the nibbles as floats (AVX2 CPUs: most AMD EPYCs and laptops, and AVX-512
  ones without BF16), on AVX-512's blocks of 64 and AVX2's own blocks of 32;
* ``portable``: a plain loop the compiler vectorizes (other CPUs, and a partial last block of
  outputs on every CPU); slower than aten's kernel, so :func:`matmul` runs it only when asked.

Which of them a build has depends on its instruction-set level (runtime/native: one build per
level, the highest this CPU runs by default, ``native.level()``).

:func:`matmul` returns None where it does not take a case, and the caller keeps the aten kernel.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from runtime import native

MAX_ROWS = 128  # rows per call it takes (measured up to here against aten, bench/cpu_int4_gemm.py)
AVX512_ROWS = 2  # up to this many rows the AVX512-BF16 path beats AMX's tile setup (ties at 2)
# Fewer rows than this keep aten's kernel. One row was slower than aten's over weights streamed from
# memory (as a model's decode reads them: 4.3 vs 5.7 GB/s) until the kernel prefetched 2 KB ahead (the
# streamer restarts at every 4 KB page); now 1.2-1.4x aten's there (bench/results/cpu/NOTES.md)
MIN_ROWS = 1
# Packed weight bytes a thread must get before a layer's blocks split across threads, for up to
# AVX512_ROWS rows (more rows split every block). 0: every block, as before. Per call, one row at 2
# threads (PASSIVE), no SmolLM2-135M layer gained from the split and a 1B 3 MB one did, but SmolLM2's
# whole decode step at 2 threads was no faster with 1 MB spans (W4/float32 wall 0.46-0.55, median
# 0.528 over 5 runs, against 0.47-0.51 split): a thread the Linears leave asleep is woken by the
# next op instead (bench/results/cpu/NOTES.md)
PARALLEL_BYTES = 0
# Rows up to which the avx2 path (CPUs without AVX512-BF16) replaces aten's kernel: measured there
# (bench/cpu_int4_levels.py under ATEN_CPU_CAPABILITY=avx2 on a Zen 4, weights streamed) 2.2-2.9x
# aten's AVX2 kernel at one row and 1.0-1.3x at eight; more rows are unmeasured and keep aten's
AVX2_MAX_ROWS = 8


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
    ``layout``, only the portable path here: a CPU without AVX2, or a layout other than AVX-512's
    or AVX2's blocks in halves). ``layout``: the :class:`runtime.cpu_int4_layout.Int4Layout`
    of ``packed`` (``int4_layout()``). ``path`` forces one of ``native.MATMUL_PATHS`` (tests, benches); it
    must run here."""
    if layout is None or a.dim() != 2 or a.dtype != torch.bfloat16 or not 1 <= a.shape[0] <= MAX_ROWS:
        return None
    if path is None:
        return linear(a, packed, group, scale_zeros, layout)
    kernel = native.matmul_kernel("int4_gemm") if native.enabled() else None
    if kernel is None:
        return None
    return kernel[0].int4_linear(a, packed, group, scale_zeros, layout.block_n, layout.halves,
                                 native.forced_path("int4_gemm", path), PARALLEL_BYTES if a.shape[0] <= AVX512_ROWS else 0)


def linear(x: torch.Tensor, packed: torch.Tensor, group: int, scale_zeros: torch.Tensor, layout) -> torch.Tensor | None:
    """``x @ w.T`` for ``x`` float32 or bf16 [..., K] of :data:`MIN_ROWS`..:data:`MAX_ROWS` rows, in
    ``x``'s dtype: the bf16 product of ``x.to(bfloat16)`` (as :func:`matmul`), widened for float32
    (equal to ``matmul(x.to(bfloat16)).to(x.dtype)``, with neither conversion as an op of its own);
    or None where :func:`matmul` would decline. One native call: a decode step makes 120 of these."""
    chosen = _paths(layout) if native.enabled() else None
    if chosen is None or x.dtype not in _DTYPES:
        return None
    rows = x.numel() // x.shape[-1]
    if not MIN_ROWS <= rows <= MAX_ROWS:
        return None
    module, few, more = chosen
    if more == _AVX2 and rows > AVX2_MAX_ROWS:
        return None
    if rows <= AVX512_ROWS:
        return module.int4_linear(x, packed, group, scale_zeros, layout.block_n, layout.halves, few, PARALLEL_BYTES)
    return module.int4_linear(x, packed, group, scale_zeros, layout.block_n, layout.halves, more, 0)


_DTYPES = (torch.float32, torch.bfloat16)


@lru_cache(maxsize=4)
def _paths(layout) -> tuple | None:
    """The kernel's module and the paths it runs for up to :data:`AVX512_ROWS` rows and for more, or
    None where only the portable loop would run (slower than aten's kernel) or it cannot be built:
    AVX512-BF16 and AMX read AVX-512's blocks of 64, AVX2 those and AVX2's blocks of 32."""
    kernel = native.matmul_kernel("int4_gemm")
    if kernel is None or layout is None or not layout.halves:
        return None
    module, best = kernel
    if best >= _AVX512 and layout.block_n == 64:
        return module, _AVX512, best
    if best >= _AVX2 and layout.block_n in (32, 64):
        return module, _AVX2, _AVX2
    return None


_AVX2, _AVX512 = native.MATMUL_PATHS.index("avx2"), native.MATMUL_PATHS.index("avx512")
