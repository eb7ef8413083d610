"""A KernelWeight dequantized into a dense fp16/bf16 ``[N, K]`` weight (Triton), for the matmul's
dense configurations: dequantize into a scratch buffer, then one cuBLAS GEMM (``quant_matmul``'s
``launch`` with ``MatmulConfig(dense=True)``), the way vLLM and AWQ's kernels run large M.

The dense weight is ``[N, K]`` (outputs by inputs, inputs in the kernel's act-order order), the
layout ``torch.nn.functional.linear`` takes: ``x @ W.T`` goes to cuBLAS as a transposed operand,
no copy. Each program dequantizes one K tile of ``BLOCK_N`` outputs with the fused kernel's own
code (``weight_tile``: ``tile_groups``, ``group_rows``, ``integer_tile``, ``dequantized``,
``input_order``), so the dense weight holds, bit for bit, the values the fused kernel feeds
``tl.dot``, and stores the tile transposed: 8 consecutive inputs a thread (one 16-byte store), a
warp writing whole rows of the tile (at 4 bits two rows of 128 inputs, 256 contiguous bytes each:
the layout Triton picks for the store, read off the compiled code). At 64 weights a thread (the configurations
``matmul_configs`` offers) the compiler reaches that layout by passing the packed words, not the
dense tile, through shared memory (bench/results/kernels/NOTES.md).

The scratch is one buffer per (device, dtype), grown to the largest weight seen and kept: the
memory of one layer's dense weight (the largest quantized Linear's ``N * K * 2`` bytes), reused by
every layer in stream order, one thread at a time (a lock held from the dequantization to the
GEMM). It is never allocated or used inside CUDA-graph capture (a graph would keep the address of
a buffer that a later, larger weight frees): :func:`scratch` refuses there, and ``matmul_configs``
offers dense configurations only above the row counts decode graphs capture.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import triton
import triton.language as tl

from runtime.kernels.weight_layout import SUBTILE_K, KernelWeight
from runtime.kernels.weight_tile import dequantized, group_rows, input_order, integer_tile, tile_groups

_SUBTILE_K = tl.constexpr(SUBTILE_K)  # jit functions read module globals only as constexpr


@triton.jit
def _dequantize_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K,
                       BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                       SCALE_PER_TILE: tl.constexpr, DEQUANT: tl.constexpr, DEQUANT_ASM: tl.constexpr,
                       BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """Outputs ``pid(0) * BLOCK_N ..`` of K tile ``pid(1)`` into ``out [N, K]`` (row stride K)."""
    PACK: tl.constexpr = 32 // BITS
    TILE_K: tl.constexpr = _SUBTILE_K * PACK
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if EVEN_N:  # no column past N: loads without a mask (as the fused kernel's EVEN_N)
        n_mask = tl.full(offs_n.shape, True, tl.int1)
    k0 = tl.program_id(1) * TILE_K
    rows = tl.arange(0, _SUBTILE_K)[:, None]  # word rows of tile 0 as the fused kernel reads them
    w_rows = qw_ptr + (rows // 4) * (4 * N) + rows % 4 + 4 * offs_n[None, :]
    g = tile_groups(k0, K, BITS, GROUP, SCALE_PER_TILE)
    scale = group_rows(s_ptr, g, offs_n, n_mask, N).to(DEQUANT)
    v, unit, offset = integer_tile(w_rows, z_ptr, k0, g, offs_n, n_mask, N, BITS, HAS_ZERO, DEQUANT, DEQUANT_ASM)
    w = tl.trans(input_order(dequantized(v, unit, offset, scale, DEQUANT_ASM), out_ptr.dtype.element_ty))
    offs_k = k0 + tl.arange(0, TILE_K)
    dest = out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]  # N * K may pass 2**31 (lm_head)
    if EVEN_N and EVEN_K:
        tl.store(dest, w)
    else:  # padding past K is not written (the dense weight has K columns)
        tl.store(dest, w, mask=n_mask[:, None] & (offs_k < K)[None, :])


def dequantize_into(kw: KernelWeight, out: torch.Tensor, block_n: int, num_warps: int, dequant, asm: bool) -> None:
    """``kw`` dequantized into ``out [N, K]`` (contiguous, fp16/bf16): ``dequant`` is the float type
    the values are computed in and ``asm`` whether inline assembly runs (``quant_matmul.dequant_type``
    and the interpreter decide both, as for the fused kernel)."""
    N, K = kw.out_features, kw.in_features
    if out.shape != (N, K) or not out.is_contiguous():
        raise ValueError(f"the dense weight must be a contiguous [{N}, {K}] tensor, got {tuple(out.shape)}")
    if block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two, got {block_n}")
    num_tiles = triton.cdiv(K, kw.tile_k)
    # one group per row: the padded length maps every tile to group 0 (as quant_matmul.launch)
    group = kw.group_len if kw.num_groups > 1 else num_tiles * kw.tile_k
    _dequantize_kernel[(triton.cdiv(N, block_n), num_tiles)](
        kw.qweight, kw.scales, kw.zeros if kw.zeros is not None else kw.scales, out, N, K,
        BITS=kw.bits, GROUP=group, HAS_ZERO=kw.zeros is not None, SCALE_PER_TILE=group % kw.tile_k == 0,
        DEQUANT=dequant, DEQUANT_ASM=asm, BLOCK_N=block_n, EVEN_N=N % block_n == 0, EVEN_K=K % kw.tile_k == 0,
        num_warps=num_warps, num_stages=1,
    )


_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_SCRATCH_LOCK = threading.Lock()  # two threads must not interleave their writes and GEMMs on one buffer


@contextlib.contextmanager
def scratch(N: int, K: int, dtype: torch.dtype, device: torch.device):
    """A ``[N, K]`` view of the (device, dtype) scratch buffer, grown (the old one freed first) when
    a larger weight comes; held by this thread inside the ``with``, where the caller enqueues the
    dequantization and the GEMM that reads it, on one stream (the GPU runs them in that order)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the dense weight's scratch buffer cannot be used inside CUDA-graph capture: a "
                           "graph would keep the address of a buffer that a larger weight later frees")
    with _SCRATCH_LOCK:
        key = (torch.device(device), dtype)
        buffer = _SCRATCH.get(key)
        if buffer is None or buffer.numel() < N * K:
            _SCRATCH.pop(key, None)  # freed before the larger one is allocated: one buffer's memory at a time
            buffer = _SCRATCH[key] = torch.empty(N * K, dtype=dtype, device=device)
        yield buffer[: N * K].view(N, K)
