"""Packed 16-bit pair arithmetic for the CUDA-core kernels (the M=1 GEMV): each helper is one or
two PTX instructions on a 32-bit register holding two fp16/bf16 values, and, where ``ASM`` is
false (the Triton interpreter cannot run inline assembly), the same instruction emulated on the
same bits (each half in fp32, rounded to the pair's type as the packed instruction rounds), so
CPU tests run the GPU's data flow. Used by the GEMVs (``gemv.py``, ``gemv_rows.py``)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def magic_value(PAIR: tl.constexpr):
    """``magic`` of the ``magic + u`` trick in PAIR, as an fp32 scalar: 1024 in fp16 (10 mantissa
    bits: 1024 + u is exact for u < 1024), 128 in bf16 (7 bits: u < 128)."""
    return tl.full((), 1024.0 if PAIR == tl.float16 else 128.0, tl.float32)


@triton.jit
def magic_pairs(fields, masks, PAIR: tl.constexpr, ASM: tl.constexpr):
    """``(fields & masks) | magic's exponent bits`` in both 16-bit halves: integers ``u`` sitting
    in the low mantissa bits of each half become the PAIR values ``magic + u`` exactly (see
    magic_value), with no integer-to-float conversion. One LOP3 with the exponent bits as its immediate
    (left to itself, the compiler picks the masks as immediates and re-materializes the
    exponent bits in a register)."""
    if not ASM:
        out = (fields & masks) | (0x64006400 if PAIR == tl.float16 else 0x43004300)
    elif PAIR == tl.float16:
        out = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, 0x64006400, 0xea;", "=r,r,r", [fields, masks],
                                        dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, 0x43004300, 0xea;", "=r,r,r", [fields, masks],
                                        dtype=tl.int32, is_pure=True, pack=1)
    return out


@triton.jit
def fma_pair(acc, v, nofs, xp, PAIR: tl.constexpr, STEP: tl.constexpr, ASM: tl.constexpr):
    """``acc + x * (v * STEP + nofs)`` on packed 16-bit pairs; STEP (a power of two, as fp16 bits;
    1 in bf16) is exact on the small integers ``v`` holds."""
    # offset_pair's result is exact in PAIR, so rounding it between the two fmas changes nothing
    return mac_pair(acc, xp, offset_pair(v, nofs, PAIR, STEP, ASM), PAIR, ASM)


@triton.jit
def offset_pair(v, nofs, PAIR: tl.constexpr, STEP: tl.constexpr, ASM: tl.constexpr):
    """``v * STEP + nofs`` on packed 16-bit pairs: fma_pair's first half, for a weight pair that
    meets several rows' activations (exact: small integers times a power of two)."""
    if not ASM:
        step: tl.constexpr = 1.0 if PAIR == tl.bfloat16 else (
            0.0625 if STEP == 0x2C00 else (0.00390625 if STEP == 0x1C00 else 0.25))
        lo = _half(v, 0, PAIR) * step + _half(nofs, 0, PAIR)
        hi = _half(v, 1, PAIR) * step + _half(nofs, 1, PAIR)
        out = _rounded_bits(lo, PAIR) | (_rounded_bits(hi, PAIR) << 16)
    else:
        tl.static_assert(PAIR == tl.bfloat16 or STEP == 0x2C00 or STEP == 0x1C00 or STEP == 0x3400,
                         "fp16 steps: 1/4, 1/16, 1/256")
        FMA: tl.constexpr = "fma.rn.f16x2" if PAIR == tl.float16 else "fma.rn.bf16x2"
        STEPS: tl.constexpr = STEP * 0x10001 if PAIR == tl.float16 else 0x3F803F80  # both halves
        steps = tl.full(v.shape, STEPS, tl.int32)  # a constant: ptxas takes it as an immediate
        out = tl.inline_asm_elementwise(FMA + " $0, $1, $3, $2;", "=r,r,r,r", [v, nofs, steps], dtype=tl.int32,
                                        is_pure=True, pack=1)
    return out


@triton.jit
def mac_pair(acc, xp, d, PAIR: tl.constexpr, ASM: tl.constexpr):
    """``acc + x * d`` on packed 16-bit pairs (fma_pair's second half), rounded once per half."""
    if not ASM:
        lo = _half(acc, 0, PAIR) + _half(xp, 0, PAIR) * _half(d, 0, PAIR)
        hi = _half(acc, 1, PAIR) + _half(xp, 1, PAIR) * _half(d, 1, PAIR)
        out = _rounded_bits(lo, PAIR) | (_rounded_bits(hi, PAIR) << 16)
    else:
        FMA: tl.constexpr = "fma.rn.f16x2" if PAIR == tl.float16 else "fma.rn.bf16x2"
        out = tl.inline_asm_elementwise(FMA + " $0, $2, $3, $1;", "=r,r,r,r", [acc, xp, d], dtype=tl.int32,
                                        is_pure=True, pack=1)
    return out


@triton.jit
def _half(bits, HI: tl.constexpr, PAIR: tl.constexpr):
    """Half ``HI`` (0: low) of a packed pair, as fp32 (exact)."""
    h = (bits >> 16) & 0xFFFF if HI else bits & 0xFFFF
    if PAIR == tl.float16:
        f = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        f = (h << 16).to(tl.float32, bitcast=True)
    return f


@triton.jit
def _rounded_bits(v, PAIR: tl.constexpr):
    """fp32 ``v`` rounded to nearest-even in PAIR, as its 16 bits in an int32 (bf16 by hand: the
    interpreter's bf16 cast truncates)."""
    if PAIR == tl.float16:
        out = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        bits = v.to(tl.int32, bitcast=True)
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return out


@triton.jit
def byte_pairs(w, magic, high, ASM: tl.constexpr):
    """fp16 pairs ``(1024 + byte h, 1024 + byte h + 2)`` of ``w`` (``h = high``, 0 or 1, per
    element): one byte permute, no shift, no mask (``magic`` holds 0x64 in every byte; a
    register: as a literal, ptxas re-materializes it per use)."""
    if not ASM:
        out = ((w >> (8 * high)) & 0x00FF00FF) | 0x64006400
    else:
        selector = 0x4240 + 0x101 * high  # result bytes: byte h, 0x64, byte h + 2, 0x64
        out = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [w, magic, selector],
                                        dtype=tl.int32, is_pure=True, pack=1)
    return out


@triton.jit
def halves_to_f32(acc, PAIR: tl.constexpr, ASM: tl.constexpr):
    """The two 16-bit sums of a packed accumulator, in fp32 (exact)."""
    if not ASM:
        lo = _half(acc, 0, PAIR)
        hi = _half(acc, 1, PAIR)
    elif PAIR == tl.float16:
        lo, hi = tl.inline_asm_elementwise(
            "{.reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h;}",
            "=f,=f,r", [acc], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo, hi = tl.inline_asm_elementwise(
            "{shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000;}",
            "=r,=r,r", [acc], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    return lo, hi


@triton.jit
def neg_offset_pair(z_lo, z_hi, bias, step: tl.constexpr, PAIR: tl.constexpr):
    """``-(bias + zero) * step`` for the two halves of a pair (exact: an integer below 2048 times
    a power of two), as the int32 bits of a packed PAIR."""
    lo = _exact_bits(-(bias + z_lo) * step, PAIR)
    hi = _exact_bits(-(bias + z_hi) * step, PAIR)
    return lo | (hi << 16)


@triton.jit
def _exact_bits(v, PAIR: tl.constexpr):
    """The 16 bits of fp32 ``v``, which PAIR holds exactly, in an int32."""
    if PAIR == tl.float16:
        out = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        out = (v.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    return out
