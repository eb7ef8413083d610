"""The decoder's small ops as one Triton launch each: residual add + RMSNorm, RoPE on q and k,
SiLU-and-multiply. Each equals its PyTorch reference in ``runtime.model`` (same fp32 math, the
same roundings to the model dtype), so the GPU path and the CPU reference compute alike; the
tests run them in the Triton interpreter.

Why: in a decode step each of these is a chain of 5-8 elementwise kernels in PyTorch, and at
batch 1 a kernel launch costs more than the work; fused, a decode layer launches 9 or 10
kernels (``bench/step_counts.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, N, eps,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr):
    """Row r: ``s = x + residual`` (rounded to the model dtype, as torch adds), then
    ``w * (s / rms(s))`` with the normalization in fp32 rounded once, as ``RMSNorm.forward``."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    s = tl.load(x_ptr + r * N + cols, mask=ok, other=0.0)
    if HAS_RES:
        s = (s.to(tl.float32) + tl.load(res_ptr + r * N + cols, mask=ok, other=0.0).to(tl.float32)).to(DT)
        tl.store(res_out_ptr + r * N + cols, s, mask=ok)
    sf = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / N + eps)
    y = (sf * inv).to(DT)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + r * N + cols, (w.to(tl.float32) * y.to(tl.float32)).to(DT), mask=ok)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``(rmsnorm(x + residual), x + residual)`` in one launch (``residual`` None: no add)."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N).contiguous()
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else x2
    res2 = residual.reshape(-1, N).contiguous() if residual is not None else x2
    _add_rmsnorm_kernel[(x2.shape[0],)](x2, res2, weight, out, res_out, N, eps, HAS_RES=residual is not None,
                                        BLOCK=triton.next_power_of_2(N), DT=_TL[x.dtype], num_warps=4)
    return out.view(x.shape), res_out.view(x.shape)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr, DT: tl.constexpr):
    """``silu(gate) * up`` for row r of ``[gate | up]``; silu and the product round as torch's."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(gu_ptr + r * 2 * I + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r * 2 * I + I + cols, mask=ok, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(DT)
    tl.store(out_ptr + r * I + cols, (act.to(tl.float32) * u).to(DT), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a ``[..., 2I]`` tensor holding gate then up, in one launch."""
    I = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, 2 * I).contiguous()
    out = gu.new_empty(gu.shape[0], I)
    BLOCK = min(1024, triton.next_power_of_2(I))
    _silu_mul_kernel[(gu.shape[0], triton.cdiv(I, BLOCK))](gu, out, I, BLOCK=BLOCK, DT=_TL[gu.dtype])
    return out.view(*gate_up.shape[:-1], I)


@triton.jit
def _rope_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, rk_ptr, rv_ptr, starts_ptr, T, row_stride, cos_sb,
                 cos_st, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, DT: tl.constexpr,
                 STORE: tl.constexpr, B: tl.constexpr):
    """Program (token, head): rotate head ``head`` (query heads, then key heads; value heads are
    copied) of one token of the fused projection's output and store it [B, H, T, D] (the layout
    attention takes: keys and values with the same strides, so the cache write copies nothing).
    ``STORE`` (decode, T = 1): keys and values also go to row ``starts[b] % B`` of the KV cache's
    residual block [S, HK, B, D], so no separate launch writes them there."""
    tok = tl.program_id(0)
    h = tl.program_id(1)
    b = tok // T
    t = tok % T
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, HALF)
    src = qkv_ptr + tok.to(tl.int64) * row_stride + h * D
    if STORE:
        row = (tl.load(starts_ptr + b) % B).to(tl.int64)
    if h >= HQ + HK:
        lo, hi = tl.load(src + i), tl.load(src + HALF + i)
        dst = v_ptr + ((b * HK + h - HQ - HK).to(tl.int64) * T + t) * D
        tl.store(dst + i, lo)
        tl.store(dst + HALF + i, hi)
        if STORE:
            res = rv_ptr + ((b * HK + h - HQ - HK).to(tl.int64) * B + row) * D
            tl.store(res + i, lo)
            tl.store(res + HALF + i, hi)
        return
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + HALF + i).to(tl.float32)
    cs = cos_ptr + b * cos_sb + t * cos_st
    sn = sin_ptr + b * cos_sb + t * cos_st
    c1, c2 = tl.load(cs + i).to(tl.float32), tl.load(cs + HALF + i).to(tl.float32)
    s1, s2 = tl.load(sn + i).to(tl.float32), tl.load(sn + HALF + i).to(tl.float32)
    # x * cos + cat(-x2, x1) * sin, each product and the sum rounded as torch's ops round
    o1 = ((x1 * c1).to(DT).to(tl.float32) + (-x2 * s1).to(DT).to(tl.float32)).to(DT)
    o2 = ((x2 * c2).to(DT).to(tl.float32) + (x1 * s2).to(DT).to(tl.float32)).to(DT)
    if h < HQ:
        dst = q_ptr + ((b * HQ + h).to(tl.int64) * T + t) * D
    else:
        dst = k_ptr + ((b * HK + h - HQ).to(tl.int64) * T + t) * D
        if STORE:
            res = rk_ptr + ((b * HK + h - HQ).to(tl.int64) * B + row) * D
            tl.store(res + i, o1)
            tl.store(res + HALF + i, o2)
    tl.store(dst + i, o1)
    tl.store(dst + HALF + i, o2)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
             store=None):
    """Rotated q [B, Hq, T, D] and k [B, Hk, T, D], and v [B, Hk, T, D], from the fused projection
    ``qkv`` [B, T, (Hq+2Hk)*D] in one launch; ``cos``/``sin`` are [T, D] or [B, 1, T, D] (``Decoder.rope``).
    ``store``: ``(residual_k, residual_v, starts)`` of a decode step (T = 1): the same launch also
    writes each sequence's key and value into its cache residual block [B, Hk, block, D] (contiguous,
    the model's dtype) at row ``starts % block`` (``runtime.attention.SequenceBatch``)."""
    B, T, width = qkv.shape
    if qkv.stride(2) != 1 or qkv.stride(0) != T * qkv.stride(1):
        qkv = qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    per_batch = cos.ndim == 4
    q = qkv.new_empty(B, heads, T, head_dim)
    k = qkv.new_empty(B, kv_heads, T, head_dim)
    v = torch.empty_like(k)
    if store is not None:
        residual_k, residual_v, starts = store
        expected = (B, kv_heads, residual_k.shape[2], head_dim)
        if T != 1 or tuple(residual_k.shape) != expected or residual_v.shape != residual_k.shape or \
                residual_k.dtype != qkv.dtype or not (residual_k.is_contiguous() and residual_v.is_contiguous()):
            raise ValueError(f"rope_qkv stores one token per sequence into contiguous residual blocks "
                             f"{expected} of dtype {qkv.dtype}; got T={T}, {tuple(residual_k.shape)} "
                             f"{residual_k.dtype}")
    else:
        residual_k, residual_v, starts = k, v, k  # placeholders, never read
    _rope_kernel[(B * T, heads + 2 * kv_heads)](
        qkv, cos, sin, q, k, v, residual_k, residual_v, starts, T, qkv.stride(1),
        cos.stride(0) if per_batch else 0, cos.stride(-2),
        HQ=heads, HK=kv_heads, D=head_dim, DT=_TL[qkv.dtype], STORE=store is not None,
        B=residual_k.shape[2] if store is not None else 1)
    return q, k, v
