"""Reading the paged cache (runtime/cache.py's layout) as dense tiles: the tile readers that the
decode-attention kernel (runtime/kernels/attention.py) also uses, and ``dequantize_cache``, the
dense keys and values a chunk after cached positions attends over."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.kv_reference import PagedKV
from runtime.kernels.paged import TL_DTYPES, placeholder, pow2, require_supported, scheme_constants

# 32-token tiles: ptxas (sm_90, int4, head_dim 128, 4 warps) gives the decode kernel 128 registers
# (4 programs per SM) against 190 for 64-token tiles. A register count, not a measured speed: the
# benchmark sweeps tile, warps and stages (bench/attention.py) once a GPU is available.
DEFAULT_TILE = 32



def tile_tokens(paged: PagedKV, tile: int | None = None) -> int:
    """Tokens per tile: divides the block and, for KIVI keys, the token group (one scale row per tile)."""
    t = tile or DEFAULT_TILE
    if not (pow2(t) and t >= 16):
        raise ValueError(f"tile must be a power of two >= 16, got {t}")
    c = scheme_constants(paged)
    t = min(t, c["B"])
    return min(t, c["G"]) if c["KIVI"] else t




@triton.jit
def dequant_pool_tile(data_ptr, scale_ptr, zero_ptr, plane, t0, row_ok,
                       KEYS: tl.constexpr, B: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                       BITS: tl.constexpr, FP8: tl.constexpr, KIVI: tl.constexpr,
                       TILE: tl.constexpr, OUT: tl.constexpr):
    """Rows ``t0 .. t0+TILE`` of one head of one pooled block (``plane = block * H + head``),
    dequantized to ``OUT`` [TILE, D]; rows where ``row_ok`` is false read as 0."""
    plane = plane.to(tl.int64)
    rows = t0 + tl.arange(0, TILE)
    cols = tl.arange(0, D)
    if BITS == 16:  # unquantized pool
        x = tl.load(data_ptr + plane * B * D + rows[:, None] * D + cols[None, :], mask=row_ok[:, None], other=0.0)
        x = x.to(OUT)
    elif FP8:  # e4m3 with one fp32 scale per head and block
        x = tl.load(data_ptr + plane * B * D + rows[:, None] * D + cols[None, :], mask=row_ok[:, None], other=0.0)
        x = (x.to(tl.float32) * tl.load(scale_ptr + plane)).to(OUT)
    else:
        PACK: tl.constexpr = 32 // BITS
        W: tl.constexpr = D // PACK  # int32 words per token
        words = tl.load(data_ptr + plane * B * W + rows[:, None] * W + tl.arange(0, W)[None, :],
                        mask=row_ok[:, None], other=0)
        # value i of a token sits in bits [i*BITS, (i+1)*BITS) of its words: word i // PACK, field i % PACK
        shifts = tl.arange(0, PACK) * BITS
        u = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        # the signed code, exact in fp32: OR the bits into the mantissa of 2**23 and subtract, which
        # spares the int-to-float conversion (a quarter-rate instruction) on every element
        u_plus_2p23 = (tl.reshape(u, (TILE, D)) | 0x4B000000).to(tl.float32, bitcast=True)
        q = u_plus_2p23 - (8388608.0 + (1 << (BITS - 1)))
        if not KIVI:  # int8: one scale and zero per token
            s = tl.load(scale_ptr + plane * B + rows, mask=row_ok, other=0.0).to(tl.float32)
            z = tl.load(zero_ptr + plane * B + rows, mask=row_ok, other=0.0).to(tl.float32)
            x = (q - z[:, None]) * s[:, None]
        elif KEYS:  # per channel over groups of G tokens; a tile lies inside one group
            g = t0 // G
            s = tl.load(scale_ptr + plane * (B // G) * D + g * D + cols).to(tl.float32)
            z = tl.load(zero_ptr + plane * (B // G) * D + g * D + cols).to(tl.float32)
            x = (q - z[None, :]) * s[None, :]
        else:  # values: per token over groups of G channels
            NG: tl.constexpr = D // G
            idx = plane * B * NG + rows[:, None] * NG + tl.arange(0, NG)[None, :]
            s = tl.load(scale_ptr + idx, mask=row_ok[:, None], other=0.0).to(tl.float32)
            z = tl.load(zero_ptr + idx, mask=row_ok[:, None], other=0.0).to(tl.float32)
            x = tl.reshape((tl.reshape(q, (TILE, NG, G)) - z[:, :, None]) * s[:, :, None], (TILE, D))
        x = x.to(OUT)
    return x


@triton.jit
def residual_tile(res_ptr, plane, t0, row_ok, B: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr):
    """Rows ``t0 .. t0+TILE`` of one head of one sequence's residual (``plane = seq * H + head``)."""
    rows = t0 + tl.arange(0, TILE)
    ptrs = res_ptr + plane.to(tl.int64) * B * D + rows[:, None] * D + tl.arange(0, D)[None, :]
    return tl.load(ptrs, mask=row_ok[:, None], other=0.0)


@triton.jit
def _dequantize_kernel(kd, ks, kz, vd, vs, vz, rk_ptr, rv_ptr, table_ptr, lens_ptr, ko_ptr, vo_ptr,
                       table_stride, out_len, window, SLIDING: tl.constexpr,
                       H: tl.constexpr, B: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
                       FP8: tl.constexpr, KIVI: tl.constexpr, TILE: tl.constexpr, OUT: tl.constexpr):
    """Program (s, h, tile): one tile of keys and values of one head into the dense [S, H, L, D] copy.
    ``SLIDING``: positions before ``seq_len - window + 1`` read as 0 (the ring may have dropped their
    blocks: a table entry of -1 is never followed)."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    p0 = tl.program_id(2) * TILE  # first position of this tile
    seq_len = tl.load(lens_ptr + s)
    length = tl.minimum(seq_len, out_len)
    j = p0 // B
    t0 = p0 % B
    pos = p0 + tl.arange(0, TILE)
    ok = pos < length
    if SLIDING:
        ok = ok & (pos >= seq_len - window + 1)
    if (j + 1) * B <= length:  # a full block: in the pool
        blk = tl.maximum(tl.load(table_ptr + s * table_stride + j), 0)  # a dropped block: no row is ok
        k = dequant_pool_tile(kd, ks, kz, blk * H + h, t0, ok, True, B, D, G, BITS, FP8, KIVI, TILE, OUT)
        v = dequant_pool_tile(vd, vs, vz, blk * H + h, t0, ok, False, B, D, G, BITS, FP8, KIVI, TILE, OUT)
        k = tl.where(ok[:, None], k, 0.0).to(OUT)  # KIVI keys' scales are read whatever the rows
        v = tl.where(ok[:, None], v, 0.0).to(OUT)
    else:  # the partial block (or past the end: zeros)
        k = residual_tile(rk_ptr, s * H + h, t0, ok, B, D, TILE).to(OUT)
        v = residual_tile(rv_ptr, s * H + h, t0, ok, B, D, TILE).to(OUT)
    out = ((s * H + h).to(tl.int64) * out_len + pos[:, None]) * D + tl.arange(0, D)[None, :]
    keep = (pos < out_len)[:, None]
    tl.store(ko_ptr + out, k, mask=keep)
    tl.store(vo_ptr + out, v, mask=keep)


def dequantize_cache(paged: PagedKV, seq_lens: torch.Tensor, length: int | None = None):
    """Same as :func:`runtime.kernels.kv_reference.dequantize_cache`; ``length`` is required
    here (no host sync to find the longest sequence)."""
    require_supported(paged)
    if length is None:
        raise ValueError("dequantize_cache on the GPU needs length= (the longest sequence) to size its output")
    S, H, B, D = paged.residual_k.shape
    out_k = paged.residual_k.new_empty(S, H, length, D)
    out_v = paged.residual_v.new_empty(S, H, length, D)
    if length == 0 or S == 0:
        return out_k, out_v
    TILE = tile_tokens(paged)
    kd, ks, kz = (placeholder(t, paged.k.data) for t in paged.k)
    vd, vs, vz = (placeholder(t, paged.v.data) for t in paged.v)
    c = scheme_constants(paged)
    _dequantize_kernel[(S, H, triton.cdiv(length, TILE))](
        kd, ks, kz, vd, vs, vz, paged.residual_k, paged.residual_v, paged.block_table, seq_lens.to(torch.int32),
        out_k, out_v, paged.block_table.stride(0), length, paged.window or 0, SLIDING=paged.window is not None,
        H=H, TILE=TILE, OUT=TL_DTYPES[paged.dtype], **c)
    return out_k, out_v
