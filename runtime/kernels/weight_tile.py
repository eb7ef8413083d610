"""One K tile of the kernel weight layout, read and dequantized inside Triton kernels.

The layout is ``weight_layout``'s (its docstring): a tile is 16 word rows of ``pack`` fields, field
``p Q + q`` of row ``4 a + b`` holding input ``8 (a Q + q) + 2 b + p`` (``Q = pack / 2``). Values are
handled as ``[Q, 4, 4, BLOCK_N, 2]`` tensors ``(q, a, b, n, p)``: the last dimension is the pair of
inputs ``k, k + 1`` that a tensor-core register holds, which the layout keeps 16 bits apart in one
word, so one shift and one AND/OR of a word make the pair (``integer_tile``), and a permutation
that only renames registers puts the tile in input order (``quant_matmul._tile_step``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from runtime.kernels.packed_pairs import byte_pairs, magic_pairs, magic_value
from runtime.kernels.weight_layout import SUBTILE_K

_SUBTILE_K = tl.constexpr(SUBTILE_K)  # jit functions read module globals only as constexpr


@triton.jit
def group_rows(ptr, g_rows, offs_n, n_mask, N):
    """Rows ``g_rows`` (shaped ``[Q or 1, 4 or 1, 1]``, see tile_groups) of a ``[groups, N]``
    tensor (scales, zero points), shaped to broadcast to integer_tile's values."""
    return tl.load(ptr + g_rows[:, :, :, None, None] * N + offs_n[None, None, None, :, None],
                   mask=n_mask[None, None, None, :, None], other=0)


@triton.jit
def integer_tile(qw_ptr, z_ptr, k0, g_rows, offs_n, n_mask, N, BITS: tl.constexpr, HAS_ZERO: tl.constexpr,
                  HALF: tl.constexpr, ASM: tl.constexpr):
    """``(v, unit, offset)`` with ``v * unit - offset == q - zero`` (exact) for inputs
    ``k0 .. k0 + tile_k`` and outputs ``offs_n``; ``v`` is shaped ``[Q, 4, 4, BLOCK_N, 2]``, element
    ``[q, a, b, n, p]`` being input ``k0 + 8 (a Q + q) + 2 b + p``; ``unit`` and ``offset``
    broadcast to it. In fp32, or in ``HALF`` (a 16-bit float type), where pairs of values share an
    instruction."""
    Q: tl.constexpr = 16 // BITS
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    # the tile's 16 word rows (padding is stored: no K mask); qw_ptr points at [16, BLOCK_N] rows
    # 0..15 of tile 0 (interleaved in memory, weight_layout); a tile is 16 N words further
    words = tl.load(qw_ptr + (k0 // (2 * Q)) * N, mask=n_mask[None, :], other=0)
    words = tl.reshape(words, (1, 4, 4, BLOCK_N))
    field_bit = BITS * tl.arange(0, Q)[:, None, None, None]  # in the low half; p = 1: 16 bits up
    if HALF == tl.float32:
        # Integer to float without a conversion instruction: OR-ed into the mantissa of 2**23, the
        # bits read as exactly 2**23 + u; subtracting 2**23 + 2**(bits-1) + zero leaves q - zero.
        u = words[:, :, :, :, None] >> (field_bit[:, :, :, :, None] + 16 * tl.arange(0, 2)[None, None, None, None, :])
        u = u & ((1 << BITS) - 1)
        v = (u | 0x4B000000).to(tl.float32, bitcast=True)
        unit = tl.full((1, 1, 1, 1, 1), 1.0, tl.float32)
        offset = 8388608.0 + (1 << (BITS - 1)) + tl.zeros((1, 1, 1, 1, 1), dtype=tl.float32)
    else:
        # The same in 16 bits (packed_pairs.magic_pairs): both values of a pair (p = 0, 1: 16 bits
        # apart) come out of one shift and one LOP3 on the whole word, as one 32-bit register
        # holding the 16-bit pair magic + u (exact: the caller keeps 8-bit weights in fp32 for
        # bf16); split and joined below only to name its halves (the compiled code keeps the
        # register as it is). In fp16 a field is taken where it sits in its byte (bit r):
        # 1024 + u * 2**r stays exact below 2048, so one shift serves every field of a byte, and
        # unit = 2**-r scales it back in the fma.
        magic = magic_value(HALF).to(HALF)
        if HALF == tl.float16:
            r = field_bit % 8
            unit = ((127 - r) << 23).to(tl.float32, bitcast=True).to(HALF)  # 2**-r, exactly
            offset = magic * unit + (1 << (BITS - 1))
        else:  # bf16 has no spare mantissa bits for u * 2**r: every field is shifted down
            r = field_bit * 0
            unit = tl.full((1, 1, 1, 1), 1.0, HALF)
            offset = magic + (1 << (BITS - 1)) + tl.zeros((1, 1, 1, 1), dtype=HALF)
        if HALF == tl.float16 and BITS == 8:  # bytes q, q + 2 under two 0x64 bytes: one PRMT, no shift
            # (4.31 -> 4.19 SASS instructions per weight, W8 16x64 on sm_90a; an opaque register for
            # the magic bytes, as the GEMV keeps one, made the compiler re-lay the tile through shared memory)
            pairs = byte_pairs(words, tl.full((1, 1, 1, 1), 0x64646464, tl.int32), field_bit // 8, ASM)
        else:
            fields = words >> (field_bit - r)
            pairs = magic_pairs(fields, (((1 << BITS) - 1) * 0x10001) << r, HALF, ASM)
        low = (pairs & 0xFFFF).to(tl.int16).to(HALF, bitcast=True)
        high = (pairs >> 16).to(tl.int16).to(HALF, bitcast=True)
        v = tl.join(low, high)
        unit = unit[:, :, :, :, None]
        offset = offset[:, :, :, :, None]
    if HAS_ZERO:  # int8 zero points, one row per group: g_rows broadcasts to [Q, 4, 1]
        zero = group_rows(z_ptr, g_rows, offs_n, n_mask, N)
        offset = offset + zero.to(v.dtype)
    return v, unit, offset


@triton.jit
def scaled_difference(v, unit, offset, scale, ASM: tl.constexpr):
    """``(v * unit - offset) * scale`` in v's 16-bit float type, rounded once, two values per
    instruction.

    The compiler widens 16-bit arithmetic to fp32 (a conversion, an op and a repack per value), so
    the compiled path spells it as packed fused multiply-adds: ``v * unit + -offset`` is exact
    (integers below 2048 in fp16, 256 in bf16; unit a power of two) and ``t * scale + -0`` is the
    correctly rounded product, which is what ``quant.affine.dequantize(...).to(dtype)`` gives. The
    interpreter cannot run inline assembly: there the same values come from fp32 (exact operands,
    one rounding: the same result)."""
    neg_offset = tl.broadcast_to(-offset, v.shape)
    unit = tl.broadcast_to(unit, v.shape)
    scale = tl.broadcast_to(scale, v.shape)
    if ASM:
        if v.dtype == tl.float16:
            out = tl.inline_asm_elementwise(
                "{.reg .b32 z; mov.b32 z, 0x80008000;"
                " fma.rn.f16x2 $0, $1, $2, $3; fma.rn.f16x2 $0, $0, $4, z;}",
                "=r,r,r,r,r", [v, unit, neg_offset, scale], dtype=tl.float16, is_pure=True, pack=2)
        else:
            out = tl.inline_asm_elementwise(  # unit is 1 in bf16 (see integer_tile)
                "{.reg .b32 m, z; mov.b32 m, 0x3F803F80; mov.b32 z, 0x80008000;"
                " fma.rn.bf16x2 $0, $1, m, $3; fma.rn.bf16x2 $0, $0, $4, z;}",
                "=r,r,r,r,r", [v, unit, neg_offset, scale], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        out = ((v.to(tl.float32) * unit.to(tl.float32) + neg_offset.to(tl.float32))
               * scale.to(tl.float32)).to(v.dtype)
    return out


@triton.jit
def dequantized(v, unit, offset, scale, ASM: tl.constexpr):
    """``(q - zero) * scale`` from integer_tile's ``(v, unit, offset)`` and the groups' scales (in
    v's type), rounded once to v's type as ``quant.affine.dequantize(...).to(dtype)`` rounds it: in
    fp32 (``unit`` is 1 there) one multiply, in 16 bits scaled_difference's packed pairs."""
    if v.dtype == tl.float32:
        wq = (v - offset) * scale
    else:
        wq = scaled_difference(v, unit, offset, scale, ASM)
    return wq


@triton.jit
def input_order(wq, DTYPE: tl.constexpr):
    """dequantized's ``[Q, 4, 4, BLOCK_N, 2]`` values as the ``[tile_k, BLOCK_N]`` tile in input
    order, in DTYPE. ``[q, a, b, n, p] -> [a, q, b, p, n]`` is input order (8 (a Q + q) + 2 b + p):
    registers are only renamed, the values already sit where the tensor-core operand wants them."""
    TILE_K: tl.constexpr = wq.shape[0] * 32
    BLOCK_N: tl.constexpr = wq.shape[3]
    return tl.reshape(tl.permute(wq, (1, 0, 2, 4, 3)), (TILE_K, BLOCK_N)).to(DTYPE)


@triton.jit
def tile_groups(k0, K, BITS: tl.constexpr, GROUP: tl.constexpr, SCALE_PER_TILE: tl.constexpr):
    """Group row of each scale the tile needs, broadcastable to ``[Q, 4, 4]`` ``(q, a, b)``: one when
    the tile lies in one group, else one per 16-input field ``(q, a)`` (the 16 inputs from 16 f are
    the fields with a Q + q = 2 f, 2 f + 1; groups are multiples of 16). Fields past K (padding)
    read group 0."""
    if SCALE_PER_TILE:
        g = k0 // GROUP + tl.zeros((1, 1, 1), dtype=tl.int32)
    else:
        Q: tl.constexpr = 16 // BITS
        q = tl.arange(0, Q)[:, None, None]
        a = tl.arange(0, 4)[None, :, None]
        k_field = k0 + _SUBTILE_K * ((a * Q + q) // 2)  # the field's first input
        g = tl.where(k_field < K, k_field // GROUP, 0)
    return g
