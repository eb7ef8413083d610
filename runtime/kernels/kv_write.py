"""Quantize-on-write for the paged KV cache (Triton): :func:`write_kv`, with the signature of
:func:`runtime.kernels.kv_reference.write_kv`.

New tokens (many in prefill, one in decode) and the residual's rows fill blocks; a filled block
is quantized into its physical block (min/max qparams, rounding and packing exactly as
``kvquant.quantize_kv``), the rest go to the residual. Two launches on one stream: the block
quantizer reads the old residual rows before the residual writer overwrites them. Quantization
uses IEEE division (``tl.div_rn``) and round-half-to-even like ``torch.round``, and FP8 bytes
are built from the bits (:func:`_e4m3_codes`, no fp32 -> fp8 cast), so blocks written on the GPU
equal ``kvquant.quantize_kv`` on the CPU bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.kv_reference import PagedKV
from runtime.kernels.paged import TL_DTYPES, placeholder, require_supported, scheme_constants

_MAGIC_ROUND = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + M - M rounds |x| < 2**22 half-to-even
_FP16_TINY = tl.constexpr(6.103515625e-05)  # torch.finfo(torch.float16).tiny, kvquant's scale floor
_ZERO_BOUND = tl.constexpr(2.0**-14)  # scale >= max|x| * 2**-14 keeps |zero| < 2**14 (quant.affine)
_FP32_TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny (FP8 scale floor)
_FP8_MAX = tl.constexpr(448.0)
_FP8_MIN_NORMAL = tl.constexpr(2.0**-6)  # smallest normal e4m3 value
WRITE_ROWS, WRITE_WARPS = 32, 8  # 64 rows x 4 warps spilled registers in the write kernel; 32 x 8 does not


@triton.jit
def _qparams(lo, hi, BITS: tl.constexpr, RATIO: tl.constexpr = 1.0):
    """kvquant's min/max grid (``quant.affine.choose_qparams(float_zero=True)``, fp16 scales),
    the range shrunk about its centre to ``RATIO`` of itself (``KVScheme.range_ratio``)."""
    QMIN: tl.constexpr = -(1 << (BITS - 1))
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    # the floor keeps |zero| = |lo| / scale below 2**14, so a constant group's zero fits fp16
    floor = tl.maximum(tl.maximum(tl.abs(lo), tl.abs(hi)) * _ZERO_BOUND, _FP16_TINY)
    if RATIO != 1.0:  # write_kv turns off FMA contraction, so these round as torch's do
        mid = (lo + hi) * 0.5
        half = (hi - lo) * (0.5 * RATIO)
        lo, hi = mid - half, mid + half
    scale = tl.maximum(tl.div_rn(hi - lo, QMAX - QMIN + 0.0), floor).to(tl.float16)
    zero = (QMIN - tl.div_rn(lo, scale.to(tl.float32))).to(tl.float16)
    return scale, zero


@triton.jit
def _codes(x, scale, zero, BITS: tl.constexpr):
    """Unsigned stored codes ``round(x / scale + zero)`` clamped to the signed range, plus ``2**(bits-1)``."""
    QMIN: tl.constexpr = -(1 << (BITS - 1))
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    y = tl.div_rn(x, scale.to(tl.float32)) + zero.to(tl.float32)
    y = tl.minimum(tl.maximum(y, QMIN), QMAX)  # clamping first changes nothing: the bounds are integers
    y = (y + _MAGIC_ROUND) - _MAGIC_ROUND  # round half to even, as torch.round
    return (y - QMIN).to(tl.int32)


@triton.jit
def _bitwise_or(a, b):
    return a | b


@triton.jit
def _pack_rows(u, ROWS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Codes [ROWS, D] into int32 words [ROWS, D*BITS/32], value i at bits [i*BITS, (i+1)*BITS)."""
    PACK: tl.constexpr = 32 // BITS
    shifts = tl.arange(0, PACK) * BITS
    fields = tl.reshape(u, (ROWS, D // PACK, PACK)) << shifts[None, None, :]
    return tl.reduce(fields, 2, _bitwise_or)  # the top field reaches the sign bit: OR, not a sum that overflows


@triton.jit
def _load_pending(res_ptr, new_ptr, s, h, start, block_pos, r0, new_ss, new_sh, new_st,
                  H: tl.constexpr, B: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, CACHE: tl.constexpr):
    """Rows ``r0 .. r0+ROWS`` of the block starting at position ``block_pos``: positions before
    ``start`` come from the residual, later ones from the new tokens (cast to the cache dtype first,
    as the reference does), fp32 [ROWS, D]."""
    rows = r0 + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    pos = block_pos + rows
    old = pos < start
    res = tl.load(res_ptr + (s * H + h).to(tl.int64) * B * D + rows[:, None] * D + cols[None, :],
                  mask=old[:, None], other=0.0)
    t = tl.where(old, 0, pos - start).to(tl.int64)
    new = tl.load(new_ptr + s.to(tl.int64) * new_ss + h * new_sh + t[:, None] * new_st + cols[None, :],
                  mask=(~old)[:, None], other=0.0)
    return tl.where(old[:, None], res.to(tl.float32), new.to(CACHE).to(tl.float32))


@triton.jit
def _store_quantized(x, data_ptr, scale_ptr, zero_ptr, plane, r0, KEYS: tl.constexpr, B: tl.constexpr,
                     D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, KIVI: tl.constexpr,
                     ROWS: tl.constexpr, RATIO: tl.constexpr):
    """Quantize rows ``r0 .. r0+ROWS`` (fp32 [ROWS, D]) of one head of one block and store codes and qparams."""
    rows = r0 + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    if not KIVI:  # int8: per token over the whole head
        scale, zero = _qparams(tl.min(x, axis=1), tl.max(x, axis=1), BITS)
        u = _codes(x, scale[:, None], zero[:, None], BITS)
        tl.store(scale_ptr + plane * B + rows, scale)
        tl.store(zero_ptr + plane * B + rows, zero)
    elif KEYS:  # per channel: the ROWS = G rows are one token group
        scale, zero = _qparams(tl.min(x, axis=0), tl.max(x, axis=0), BITS, RATIO)
        u = _codes(x, scale[None, :], zero[None, :], BITS)
        g = r0 // G
        tl.store(scale_ptr + plane * (B // G) * D + g * D + cols, scale)
        tl.store(zero_ptr + plane * (B // G) * D + g * D + cols, zero)
    else:  # values: per token over groups of G channels
        NG: tl.constexpr = D // G
        x3 = tl.reshape(x, (ROWS, NG, G))
        scale, zero = _qparams(tl.min(x3, axis=2), tl.max(x3, axis=2), BITS, RATIO)
        u = tl.reshape(_codes(x3, scale[:, :, None], zero[:, :, None], BITS), (ROWS, D))
        idx = plane * B * NG + rows[:, None] * NG + tl.arange(0, NG)[None, :]
        tl.store(scale_ptr + idx, scale)
        tl.store(zero_ptr + idx, zero)
    W: tl.constexpr = D * BITS // 32
    words = _pack_rows(u, ROWS, D, BITS)
    tl.store(data_ptr + plane * B * W + rows[:, None] * W + tl.arange(0, W)[None, :], words)


@triton.jit
def _e4m3_codes(y):
    """The float8 e4m3fn bytes of ``y`` (|y| <= 448 or NaN) as torch's ``.to(torch.float8_e4m3fn)``
    makes them (c10's conversion, on CPU and CUDA alike): nearest code, ties to even, the sign
    kept (-0 and values that round to zero from below are 0x80), NaN 0x7F. Built from the bits in
    fp32 and integer arithmetic, so no converter's rounding decides a code: Triton 3.6's ``-x`` is
    ``0 - x`` (+0 for a zero, where torch keeps -0: the H200 run's mismatches), and the
    interpreter's fp32 -> fp8 cast drops the carry of roundings that cross a power of two."""
    bits = y.to(tl.int32, bitcast=True)
    mag = tl.abs(y)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # subnormals step like the smallest normals
    # 1.5 * 2**(exp + 20): added to |y| it leaves e4m3's step 2**(exp - 3) as the last place kept
    magic = (((exp + 20 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    r = (mag + magic) - magic  # |y| on the e4m3 grid, round half to even, >= +0
    # normal: exponent and top 3 mantissa bits, rebiased 127 -> 7; subnormal: r / 2**-9 is 0..7, exact
    normal = (r.to(tl.int32, bitcast=True) >> 20) - ((127 - 7) << 3)
    code = tl.where(r >= _FP8_MIN_NORMAL, normal, (r * 512.0).to(tl.int32))
    code = tl.where(mag != mag, 0x7F, code) | ((bits >> 24) & 0x80)  # NaN; then the sign bit
    return code.to(tl.uint8)


@triton.jit
def _write_block(res_ptr, new_ptr, data_ptr, scale_ptr, zero_ptr, s, h, start, block_pos, plane,
                 new_ss, new_sh, new_st, KEYS: tl.constexpr, H: tl.constexpr, B: tl.constexpr, D: tl.constexpr,
                 G: tl.constexpr, BITS: tl.constexpr, FP8: tl.constexpr, KIVI: tl.constexpr,
                 ROWS: tl.constexpr, CACHE: tl.constexpr, RATIO: tl.constexpr):
    """Quantize one filled block of one head (keys or values) into pool plane ``plane``."""
    cols = tl.arange(0, D)
    if BITS == 16:  # unquantized pool: a copy
        for r0 in range(0, B, ROWS):
            x = _load_pending(res_ptr, new_ptr, s, h, start, block_pos, r0, new_ss, new_sh, new_st, H, B, D, ROWS, CACHE)
            rows = r0 + tl.arange(0, ROWS)
            tl.store(data_ptr + plane * B * D + rows[:, None] * D + cols[None, :], x.to(CACHE))
    elif FP8:  # one scale per head and block: the block's largest magnitude first, then the cast
        amax = tl.zeros((ROWS, D), tl.float32)
        for r0 in range(0, B, ROWS):
            x = _load_pending(res_ptr, new_ptr, s, h, start, block_pos, r0, new_ss, new_sh, new_st, H, B, D, ROWS, CACHE)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.div_rn(tl.max(tl.max(amax, axis=1), axis=0), _FP8_MAX), _FP32_TINY)
        tl.store(scale_ptr + plane, scale)
        for r0 in range(0, B, ROWS):
            x = _load_pending(res_ptr, new_ptr, s, h, start, block_pos, r0, new_ss, new_sh, new_st, H, B, D, ROWS, CACHE)
            rows = r0 + tl.arange(0, ROWS)
            codes = _e4m3_codes(tl.div_rn(x, scale))  # the bytes, stored as they are
            tl.store(data_ptr + plane * B * D + rows[:, None] * D + cols[None, :],
                     codes.to(data_ptr.dtype.element_ty, bitcast=True))
    else:
        for r0 in range(0, B, ROWS):
            x = _load_pending(res_ptr, new_ptr, s, h, start, block_pos, r0, new_ss, new_sh, new_st, H, B, D, ROWS, CACHE)
            _store_quantized(x, data_ptr, scale_ptr, zero_ptr, plane, r0, KEYS, B, D, G, BITS, KIVI, ROWS, RATIO)


@triton.jit
def _write_blocks_kernel(k_ptr, v_ptr, rk_ptr, rv_ptr, kd, ks, kz, vd, vs, vz, table_ptr, starts_ptr,
                         T, table_stride, new_ss, new_sh, new_st,
                         H: tl.constexpr, B: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
                         FP8: tl.constexpr, KIVI: tl.constexpr, KEY_ROWS: tl.constexpr, ROWS: tl.constexpr,
                         CACHE: tl.constexpr, KEY_RATIO: tl.constexpr, VALUE_RATIO: tl.constexpr):
    """Program (s, h, i): the i-th block this write touches in sequence s, if the write fills it."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(starts_ptr + s)
    j = start // B + tl.program_id(2)
    if (j + 1) * B <= start + T:
        blk = tl.load(table_ptr + s * table_stride + j)
        if blk >= 0:  # the caller allocates every block a write fills (reference: a ValueError)
            plane = blk.to(tl.int64) * H + h
            _write_block(rk_ptr, k_ptr, kd, ks, kz, s, h, start, j * B, plane, new_ss, new_sh, new_st,
                         True, H, B, D, G, BITS, FP8, KIVI, KEY_ROWS, CACHE, KEY_RATIO)
            _write_block(rv_ptr, v_ptr, vd, vs, vz, s, h, start, j * B, plane, new_ss, new_sh, new_st,
                         False, H, B, D, G, BITS, FP8, KIVI, ROWS, CACHE, VALUE_RATIO)


@triton.jit
def _write_residual_kernel(k_ptr, v_ptr, rk_ptr, rv_ptr, starts_ptr, T, new_ss, new_sh, new_st,
                           H: tl.constexpr, B: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                           CACHE: tl.constexpr):
    """Program (s, h, c): new positions ``c*ROWS ..`` of the block that stays partial go to
    residual rows ``p % B`` (one program per 16 positions: a decode step writes one row)."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(starts_ptr + s)
    end = start + T
    first = tl.maximum(start, (end // B) * B)  # the partial block's first new position
    pos = first + tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    ok = pos < end
    t = tl.where(ok, pos - start, 0).to(tl.int64)
    cols = tl.arange(0, D)
    src = s.to(tl.int64) * new_ss + h * new_sh + t[:, None] * new_st + cols[None, :]
    dst = (s * H + h).to(tl.int64) * B * D + (pos % B)[:, None] * D + cols[None, :]
    tl.store(rk_ptr + dst, tl.load(k_ptr + src, mask=ok[:, None], other=0.0).to(CACHE), mask=ok[:, None])
    tl.store(rv_ptr + dst, tl.load(v_ptr + src, mask=ok[:, None], other=0.0).to(CACHE), mask=ok[:, None])


def write_kv(paged: PagedKV, starts: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             num_warps: int = WRITE_WARPS, blocks: bool = True, residual: bool = True) -> None:
    """Same as :func:`runtime.kernels.kv_reference.write_kv`. The caller allocates the blocks the
    write fills (``block_table`` entries >= 0); no host sync. A caller that knows more skips a
    launch: ``blocks=False`` when no sequence fills a block (a decode step where none crosses a
    block boundary), ``residual=False`` when the new tokens are in the residual already
    (``small_ops.rope_qkv`` with ``store``; the block kernel still reads them from ``k, v``)."""
    require_supported(paged)
    S, H, B, D = paged.residual_k.shape
    if k.ndim != 4 or k.shape != v.shape or (k.shape[0], k.shape[1], k.shape[3]) != (S, H, D):
        raise ValueError(f"new keys and values must both be [S={S}, H={H}, T, D={D}], got keys {tuple(k.shape)} "
                         f"and values {tuple(v.shape)}")
    if starts.shape != (S,):
        raise ValueError(f"starts must have one entry per sequence ({S}), got shape {tuple(starts.shape)}")
    T = k.shape[2]
    if T == 0 or S == 0:
        return
    if k.stride() != v.stride() or k.stride(-1) != 1:  # the kernels index keys and values with one set of strides
        k, v = k.contiguous(), v.contiguous()
    starts = starts.to(torch.int32)
    kd, ks, kz = (placeholder(t, paged.k.data) for t in paged.k)
    vd, vs, vz = (placeholder(t, paged.v.data) for t in paged.v)
    c = scheme_constants(paged)
    cache_dtype = TL_DTYPES[paged.dtype]
    strides = (k.stride(0), k.stride(1), k.stride(2))
    fills = (B - 1 + T) // B if blocks else 0  # most blocks one sequence can fill
    if fills:
        rows = min(B, WRITE_ROWS)
        key_rows = c["G"] if c["KIVI"] else rows  # KIVI keys: a whole token group per program
        _write_blocks_kernel[(S, H, fills)](
            k, v, paged.residual_k, paged.residual_v, kd, ks, kz, vd, vs, vz, paged.block_table, starts,
            T, paged.block_table.stride(0), *strides, KEY_ROWS=key_rows, ROWS=rows, CACHE=cache_dtype, H=H, **c,
            KEY_RATIO=paged.scheme.range_ratio(True), VALUE_RATIO=paged.scheme.range_ratio(False),
            num_warps=num_warps, enable_fp_fusion=False)  # no FMA: qparams round exactly as kvquant's
    if not residual:
        return
    # after the blocks (same stream): they read residual rows this overwrites
    residual_rows = 16
    _write_residual_kernel[(S, H, triton.cdiv(min(T, B - 1), residual_rows))](
        k, v, paged.residual_k, paged.residual_v, starts, T, *strides, H=H, B=B, D=D, ROWS=residual_rows,
        CACHE=cache_dtype, num_warps=4)
