"""Decode attention over INT8 and INT4 keys and values without dequantizing them (fp16 models).

Packed integer data holds channel ``w * PACK + f`` of a token in field ``f`` of its word ``w``
(``PACK = 32 / bits``). Instead of unpacking a tile into ``[TILE, D]`` (a reshape that Triton
re-lays through shared memory), each field is its own ``[TILE, W]`` operand of a ``tl.dot``: the
query is split into the same fields once, and the accumulator is kept as ``PACK`` field tiles
that :func:`merge_fields` interleaves back into channel order after the main loop.

The quantization scales are folded out of the per-element work wherever the math allows:

* KIVI keys (per channel ``c`` over a group of tokens):
  ``q.k = sum_c (q_c s_c) code_c - sum_c q_c s_c z_c``: the scales go into the query once per
  tile (a tile lies in one group) and the zero points into one dot per tile;
* INT8 keys (per token ``t``): ``q.k_t = s_t (sum_c q_c code_tc - z_t sum_c q_c)``;
* INT8 values and KIVI values whose channel group is the whole head (per token):
  ``sum_t p_t s_t (code_tc - z_t) = sum_t (p_t s_t) code_tc - sum_t p_t s_t z_t``: the scales go
  into the softmax weights, the zero points into one running sum per query row;
* KIVI values with several channel groups per head are dequantized in fp16 (a scale that changes
  along the columns of a dot cannot be folded into its rows).

Codes become fp16 without an int-to-float conversion: a field ORed into the mantissa of 1024.0
(fp16 ``0x6400``) reads as ``1024 + field``, and subtracting ``1024 + 2**(bits-1)`` leaves the
signed code, exactly.

Rounding differs from dequantize-then-attend: the reference rounds each dequantized key to fp16,
here ``q_c s_c`` (KIVI) and ``p_t s_t`` are rounded to fp16 instead. Both are one fp16 rounding
per product term (relative 2**-11), so results agree to the same tolerance as before.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _field_codes(words, f: tl.constexpr, BITS: tl.constexpr):
    """Field ``f`` of each packed word as its signed code times ``_field_scale(f, BITS)``, exact in
    fp16 (same shape as ``words``). INT4's odd fields are masked in place (bits 4..7 of a byte: 16
    times the field) rather than shifted down: one shift serves two fields."""
    if BITS == 4:
        u = (words >> ((f // 2) * 8)) & (0xF << (4 * (f % 2)))
    else:
        u = (words >> (f * BITS)) & ((1 << BITS) - 1)
    m = (u | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + field * scale
    return m - (1024.0 + (1 << (BITS - 1)) * _field_scale(f, BITS))


@triton.constexpr_function
def _field_scale(f, BITS):
    """What field ``f``'s code is multiplied by in place: 16 for INT4's odd fields, else 1. A
    compile-time constant (a ``@triton.jit`` function's Python float comes back as an fp32 tensor
    under Triton 3.6, which made ``_field_codes`` fp32 and the fp16 dots fail to compile)."""
    return 16.0 if BITS == 4 and f % 2 == 1 else 1.0


@triton.jit
def _load_words(data_ptr, plane, t0, B: tl.constexpr, W: tl.constexpr, TILE: tl.constexpr):
    rows = t0 + tl.arange(0, TILE)
    return tl.load(data_ptr + plane.to(tl.int64) * B * W + rows[:, None] * W + tl.arange(0, W)[None, :])


@triton.jit
def query_fields(q_ptr, q_rows, head_ok, D: tl.constexpr, BITS: tl.constexpr):
    """The query rows [QH, D] as ``PACK`` field tiles [QH, W] (fp16): field f holds channels w*PACK+f."""
    PACK: tl.constexpr = 32 // BITS
    W: tl.constexpr = D // PACK
    cols = tl.arange(0, W) * PACK
    fields = ()
    for f in tl.static_range(PACK):
        fields = fields + (tl.load(q_ptr + q_rows[:, None] * D + cols[None, :] + f, mask=head_ok[:, None],
                                   other=0.0),)
    return fields


@triton.jit
def field_sum(fields):
    """Sum of each row over all field tiles, in fp32 [QH]."""
    total = tl.sum(fields[0].to(tl.float32), axis=1)
    for f in tl.static_range(1, len(fields)):
        total += tl.sum(fields[f].to(tl.float32), axis=1)
    return total


@triton.jit
def zero_fields(QH: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    fields = ()
    for f in tl.static_range(PACK):
        fields = fields + (tl.zeros((QH, D // PACK), tl.float32),)
    return fields


@triton.jit
def fold_key_scales(q_fields, q_sum, ks, kz, plane, t0, B: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                    BITS: tl.constexpr, KIVI: tl.constexpr, TILE: tl.constexpr):
    """The query fields that multiply the key codes, and the term the raw scores start from:
    KIVI: ``q_c s_c`` of the group holding position ``t0`` of the block, and ``-sum_c q_c s_c z_c``
    as a [QH, TILE] tile (every column equal) that :func:`folded_scores` accumulates its dots on;
    INT8: the query itself and its row sums (scale and zero are per token, see folded_scores).

    The zero-point term is a dot too (the fp16 query fields against the zero points broadcast over
    the tile's columns): then the scaled query is only ever a dot operand, never also reduced in
    another register layout, which made Triton 3.6 keep two copies of it and spill."""
    if KIVI:
        PACK: tl.constexpr = 32 // BITS
        W: tl.constexpr = D // PACK
        base = (plane.to(tl.int64) * (B // G) + t0 // G) * D + tl.arange(0, W) * PACK
        start = tl.zeros((q_fields[0].shape[0], TILE), tl.float32)
        qs_fields = ()
        for f in tl.static_range(PACK):
            s = tl.load(ks + base + f)
            minus_z = -(tl.load(kz + base + f) * _field_scale(f, BITS))  # exact: a power of two
            # q_c s_c rounded once to fp16 (the product of two fp16 is exact), then / 16: exact
            qs = (q_fields[f] * s[None, :]) * (1.0 / _field_scale(f, BITS))
            start = tl.dot(qs, tl.broadcast_to(minus_z[:, None], (W, TILE)), start)
            qs_fields = qs_fields + (qs,)
        return qs_fields, start
    else:
        return q_fields, q_sum


@triton.jit
def folded_scores(qs_fields, key_term, kd, ks, kz, plane, t0, B: tl.constexpr, D: tl.constexpr,
                  BITS: tl.constexpr, KIVI: tl.constexpr, TILE: tl.constexpr):
    """Raw scores [QH, TILE] over one tile of quantized keys, from :func:`fold_key_scales`'s query
    fields and term (module docstring)."""
    PACK: tl.constexpr = 32 // BITS
    W: tl.constexpr = D // PACK
    words = _load_words(kd, plane, t0, B, W, TILE)
    if KIVI:  # the zero points' term is where the dots start
        raw = key_term
    else:
        raw = tl.zeros((qs_fields[0].shape[0], TILE), tl.float32)
    for f in tl.static_range(PACK):
        raw = tl.dot(qs_fields[f], tl.trans(_field_codes(words, f, BITS)), raw)
    if KIVI:
        scores = raw
    else:  # per token: scale and zero apply to whole score columns
        rows = plane.to(tl.int64) * B + t0 + tl.arange(0, TILE)
        s = tl.load(ks + rows).to(tl.float32)
        z = tl.load(kz + rows).to(tl.float32)
        scores = (raw - key_term[:, None] * z[None, :]) * s[None, :]
    return scores


@triton.jit
def folded_values(p, alpha, acc_fields, vd, vs, vz, plane, t0, B: tl.constexpr, D: tl.constexpr,
                  G: tl.constexpr, BITS: tl.constexpr, KIVI: tl.constexpr, TILE: tl.constexpr):
    """``acc_fields * alpha + p @ values`` (field tiles) for softmax weights ``p`` [QH, TILE], and
    what the values' zero points take off every channel of this tile [QH] (0 when dequantized)."""
    PACK: tl.constexpr = 32 // BITS
    W: tl.constexpr = D // PACK
    NG: tl.constexpr = D // G if KIVI else 1
    words = _load_words(vd, plane, t0, B, W, TILE)
    rows = plane.to(tl.int64) * B + t0 + tl.arange(0, TILE)
    out = ()
    if NG == 1:  # per token: scales into p, zero points into one sum
        s = tl.load(vs + rows).to(tl.float32)
        z = tl.load(vz + rows).to(tl.float32)
        ps = (p * s[None, :]).to(tl.float16)
        zero_sum = tl.sum(ps.to(tl.float32) * z[None, :], axis=1)
        ps_odd = (ps.to(tl.float32) * (1.0 / _field_scale(1, BITS))).to(tl.float16)  # for 16x fields
        for f in tl.static_range(PACK):
            pf = ps_odd if _field_scale(f, BITS) != 1.0 else ps
            out = out + (tl.dot(pf, _field_codes(words, f, BITS), acc_fields[f] * alpha[:, None]),)
    else:  # channel w*PACK+f lies in group (w*PACK+f) // G = w // (G // PACK) for every field f
        s, minus_zs = _group_columns(vs, vz, rows, NG, W, G // PACK)
        s_odd = s * (1.0 / _field_scale(1, BITS))  # for 16x fields (a power of two: exact)
        p16 = p.to(tl.float16)
        zero_sum = tl.zeros((p.shape[0],), tl.float32)
        for f in tl.static_range(PACK):
            sf = s_odd if _field_scale(f, BITS) != 1.0 else s
            v = (_field_codes(words, f, BITS) * sf + minus_zs).to(tl.float16)
            out = out + (tl.dot(p16, v, acc_fields[f] * alpha[:, None]),)
    return out, zero_sum


@triton.jit
def _group_columns(vs, vz, rows, NG: tl.constexpr, W: tl.constexpr, GROUP_WORDS: tl.constexpr):
    """The values' scales ``s`` and ``-(z s)`` (fp16) as [TILE, W] tiles: word ``w`` of token ``t``
    takes group ``w // GROUP_WORDS`` of row ``rows[t]``. Loaded as [TILE, NG] (contiguous) and
    broadcast: a load of the [TILE, W] addresses themselves (contiguous along neither dim) made
    Triton 3.6 lay the whole value path out one token per thread, unpacked and stored to shared
    memory 16 bits at a time (bench/results/kernels/sass-*-triton3.6.0.json)."""
    idx = rows[:, None] * NG + tl.arange(0, NG)[None, :]
    s_g = tl.load(vs + idx)
    minus_zs_g = (-(tl.load(vz + idx).to(tl.float32) * s_g.to(tl.float32))).to(tl.float16)
    shape: tl.constexpr = (rows.shape[0], NG, GROUP_WORDS)
    s = tl.reshape(tl.broadcast_to(s_g[:, :, None], shape), (rows.shape[0], W))
    minus_zs = tl.reshape(tl.broadcast_to(minus_zs_g[:, :, None], shape), (rows.shape[0], W))
    return s, minus_zs


@triton.jit
def _join4(a, b, c, d):
    """[.., 2, 2] holding a, b, c, d at flat index 0, 1, 2, 3 of the last two dims."""
    return tl.join(tl.join(a, c), tl.join(b, d))


@triton.jit
def merge_fields(fields, QH: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Field tiles back to one [QH, D] tile in channel order (once, after the main loop)."""
    PACK: tl.constexpr = 32 // BITS
    if PACK == 4:
        x = _join4(fields[0], fields[1], fields[2], fields[3])
    else:  # 8: field 4i + 2j + k at [.., i, j, k]
        even = _join4(fields[0], fields[2], fields[4], fields[6])
        odd = _join4(fields[1], fields[3], fields[5], fields[7])
        x = tl.join(even, odd)
    return tl.reshape(x, (QH, D))
