"""The M=1 weight GEMV (decode): ``y = x @ W.T + b`` for one row, on CUDA cores.

Layout: ``weight_layout.KernelWeight`` (words ``[K/pack, N]``, 16 word rows per K tile; field
``p Q + q`` of row ``4 a + b`` is input ``8 (a Q + q) + 2 b + p`` of the tile, ``Q = pack / 2``).
Each thread owns ``BLOCK_N / 32`` whole output columns and sums K inside itself: a main-loop iteration gives each warp of the CTA its
own K tile (warp ``w`` takes tiles ``w, w + warps, ...``) and the tile's 16 word rows are loaded
as 16-byte vectors, rows ``4 a .. 4 a + 3`` of one column each (the layout stores them side by
side; adjacent threads, adjacent columns: coalesced), with no 2-D tile reshuffled
through shared memory, one loop iteration ahead of their use (software pipelining in
registers). The warps' sums meet once, after the loop.

Arithmetic (``PAIR`` = fp16, or bf16 for 4 bits and fewer): a word is ``Q`` pairs of fields 16
bits apart (fields ``q`` and ``Q + q``), and pair ``q`` of row ``4 a + b`` holds the adjacent
inputs ``k, k + 1`` (``k = 8 (a Q + q) + 2 b``), so it meets the activations as one packed pair
``(x[k], x[k + 1])``, a 32-bit word of x as it lies in memory. One ``LOP3`` turns the word into
two 16-bit floats ``magic + u``, one packed fma makes ``(v - magic - 2**(bits-1) - zero) * step``
exactly (small integers times a power of two), and one packed ``fma`` accumulates ``x * that``
for the two inputs: three instructions per two weights. (fp16 4-bit: the odd fields are taken in
place as ``1024 + 16 u`` with a 16 times smaller step, so a word needs one shift; fp16 8-bit: one
``PRMT`` puts two bytes under 0x64.) Each pair's products are chained in that 16-bit type over
the tile's 16 rows (over 4 rows when the tile holds more than one group), then converted to
fp32, scaled once per group (by ``scale / step``) and added to an fp32 accumulator.

Overflow: in fp16, ``step = 2**-bits``, so a chain holds at most ``16 * |x|`` (``|q - zero| <
2**bits``) and stays finite for any ``|x| <= 4000``; without it, 16 inputs of 273 would overflow
at 4 bits, of 17 at 8 bits. bf16 has fp32's range: ``step = 1``.

Error: with ``u`` the unit roundoff of PAIR (fp16 2**-11, bf16 2**-8), each 16-term chain is
off by at most ``γ16 = 16u/(1-16u)`` times the sum of its ``|x (q - zero)|`` (plus 2**-25 per
step, in chain units, where fp16 values are subnormal), so the output is within
``γ16 · Σ_k |x_k| |q_k - z| s + (subnormal and fp32 terms) + the final rounding`` of the exact
product (tests/test_kernels_gemv.py asserts this against float64). On random data that is
about 3 times the deviation of the reference itself (weights rounded to the activation type,
fp32 sums) from exact arithmetic. 8-bit bf16 (``128 + u`` is not exact in bf16) runs in fp32,
one weight per instruction.

The 8 activations of 4 word rows' pair ``q`` (``8 (a Q + q) .. + 7``) come as two 64-bit loads,
shared by a thread's columns; no byte permutes. The interpreter cannot run inline assembly: there
(``ASM=False``) each instruction is emulated on the same packed bits (a pair's halves in fp32,
rounded to PAIR as the packed fma rounds), so the tests run the GPU's data flow: which field
meets which activation, offsets, steps, scales.

When the columns alone cannot fill the GPU, K is split across programs (grid dim 1): each
writes fp32 partial sums, and the last one to finish a column block (an atomic counter, reset
by that program) adds them in split order, with the bias: one launch, deterministic results.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.packed_pairs import byte_pairs, fma_pair, halves_to_f32, magic_pairs, magic_value, neg_offset_pair

_SUBTILE = tl.constexpr(16)  # word rows per K tile (weight_layout.SUBTILE_K)


@triton.jit
def _x_pairs(x_ptr, k, K, EVEN_K: tl.constexpr, ASM: tl.constexpr):
    """Activations ``k .. k + 7`` as 4 packed pairs ``(x[k + 2 b], x[k + 2 b + 1])``, ``b = 0..3``
    (k a multiple of 8): two 64-bit loads, each split into its two 32-bit halves (a register
    renaming). Past K they read 0 (K is a multiple of 4: the launcher pads x otherwise)."""
    if ASM:
        x64_ptr = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
        if EVEN_K:
            lo = tl.load(x64_ptr + k // 4)
            hi = tl.load(x64_ptr + k // 4 + 1)
        else:
            lo = tl.load(x64_ptr + k // 4, mask=k < K, other=0)
            hi = tl.load(x64_ptr + k // 4 + 1, mask=k + 4 < K, other=0)
        p0, p1 = tl.inline_asm_elementwise("mov.b64 {$0, $1}, $2;", "=r,=r,l", [lo], dtype=(tl.int32, tl.int32),
                                           is_pure=True, pack=1)
        p2, p3 = tl.inline_asm_elementwise("mov.b64 {$0, $1}, $2;", "=r,=r,l", [hi], dtype=(tl.int32, tl.int32),
                                           is_pure=True, pack=1)
        pairs = (p0, p1, p2, p3)
    else:  # the interpreter: the same pairs from 16-bit loads
        x16_ptr = x_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
        pairs = ()
        for b in tl.static_range(4):
            a = tl.load(x16_ptr + k + 2 * b, mask=k + 2 * b < K, other=0).to(tl.int32) & 0xFFFF
            c = tl.load(x16_ptr + k + 2 * b + 1, mask=k + 2 * b + 1 < K, other=0).to(tl.int32)
            pairs = pairs + (a | (c << 16),)
    return pairs


@triton.jit
def _field_params(s_ptr, z_ptr, k_field, cols, N, K, HAS_ZERO: tl.constexpr, GROUP: tl.constexpr):
    """Scale (fp32) and zero point (fp32, 0 when symmetric) of the group holding input ``k_field``
    (group 0 for padding past K, which multiplies zero activations)."""
    g = tl.where(k_field < K, k_field // GROUP, 0)
    s = tl.load(s_ptr + g * N + cols).to(tl.float32)
    if HAS_ZERO:
        z = tl.load(z_ptr + g * N + cols).to(tl.float32)
    else:
        z = tl.zeros_like(s)
    return s, z


@triton.jit
def _load_words(qw_ptr, t, cols, N, ASM: tl.constexpr):
    """The 16 word rows of each warp's tile ``t``, one ``[warps, BLOCK_N]`` tensor per row. Rows
    ``4 a .. 4 a + 3`` of a column lie side by side (weight_layout): one 16-byte load per column
    and ``a`` (an inline ``ld.global.v4``: a ``[warps, BLOCK_N, 4]`` load split into rows put the
    columns in another layout, re-laid through shared memory every tile). The interpreter loads
    the same words one at a time.

    The asm result takes its layout from the tile's other loads: the scale and zero rows (vector
    loads of a thread's adjacent columns, for the aligned tensors the launcher passes) give each
    warp its own K tile. Without such a load (a ragged N, clamped columns) the default layout
    puts the warps on the columns instead, each thread then reading 4 tiles' activations: still
    correct, and no worse than the unvectorized row loads were there."""
    rows = ()
    for a in tl.static_range(4):
        quad = qw_ptr + (t * _SUBTILE + 4 * a) * N + 4 * cols  # [warps, BLOCK_N]: the row 4 a word
        if ASM:
            r0, r1, r2, r3 = tl.inline_asm_elementwise(
                "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [quad],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
            rows = rows + (r0, r1, r2, r3)
        else:
            for b in tl.static_range(4):
                rows = rows + (tl.load(quad + b),)
    return rows


@triton.jit
def _tile_packed(x_ptr, words, s_ptr, z_ptr, t, cols, N, K, masks,
                 BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, PAIR: tl.constexpr,
                 EVEN_K: tl.constexpr, ASM: tl.constexpr):
    """fp32 ``[warps, BLOCK_N]``: each warp's tile ``t`` times x, two weights per instruction
    (``ASM=False``: the interpreter's emulation of the same instructions)."""
    PACK: tl.constexpr = 32 // BITS
    TILE_K: tl.constexpr = _SUBTILE * PACK
    SLOTS: tl.constexpr = PACK // 2
    # fp16 4-bit: odd slots are read in place as 1024 + 16 u (Marlin's trick): one shift per word
    IN_PLACE: tl.constexpr = PAIR == tl.float16 and BITS == 4
    # fp16 chains hold (q - zero) * 2**-BITS (see the module docstring: overflow); the subtracting
    # fma applies it, as fp16 bits STEP (odd in-place slots: another 1/16)
    LOG: tl.constexpr = BITS if PAIR == tl.float16 else 0
    STEP: tl.constexpr = 0x2C00 if BITS == 4 else (0x1C00 if BITS == 8 else 0x3400)
    ONE_GROUP: tl.constexpr = GROUP % (16 * PACK) == 0  # the whole tile shares one scale and zero
    k0 = t * TILE_K  # [warps, 1]
    half: tl.constexpr = 1 << (BITS - 1)
    magic = magic_value(PAIR)
    if ONE_GROUP:
        s, z = _field_params(s_ptr, z_ptr, k0, cols, N, K, HAS_ZERO, GROUP)
    total = tl.zeros(cols.shape, tl.float32) + tl.zeros(k0.shape, tl.float32)
    accs = (tl.zeros(total.shape, tl.int32),) * SLOTS
    for a in tl.static_range(4):  # word rows 4 a .. 4 a + 3: pair j holds inputs 8 (a SLOTS + j) + 0..7
        nofs = ()
        xps = ()
        scales = ()
        for j in tl.static_range(SLOTS):
            k_pair = k0 + 8 * (a * SLOTS + j)
            if not ONE_GROUP:  # groups are multiples of 16 inputs: a pair's 8 share one
                s, z = _field_params(s_ptr, z_ptr, k_pair, cols, N, K, HAS_ZERO, GROUP)
            scales = scales + (s,)
            if IN_PLACE and j % 2 == 1:
                nofs = nofs + (neg_offset_pair(z, z, magic / 16 + half, 1.0 / (1 << LOG), PAIR),)
            else:
                nofs = nofs + (neg_offset_pair(z, z, magic + half, 1.0 / (1 << LOG), PAIR),)
            xps = xps + (_x_pairs(x_ptr, k_pair, K, EVEN_K, ASM),)
        for b in tl.static_range(4):
            w = words[4 * a + b]
            new = ()
            for j in tl.static_range(SLOTS):
                if IN_PLACE:  # pairs 0, 1 from the word, 2, 3 from the word >> 8
                    v = magic_pairs(w >> (8 * (j // 2)), masks[j % 2], PAIR, ASM)
                elif BITS == 8 and PAIR == tl.float16:  # bytes j and j + 2 under two 0x64 bytes
                    v = byte_pairs(w, masks[2], j, ASM)
                else:
                    v = magic_pairs(w >> (BITS * j), masks[0], PAIR, ASM)
                new = new + (fma_pair(accs[j], v, nofs[j], xps[j][b], PAIR,
                                       0x1C00 if IN_PLACE and j % 2 == 1 else STEP, ASM),)
            accs = new
        # chains of 16 rows when the tile is one group (scaled once, below), else of 4 rows
        if a == 3 or not ONE_GROUP:
            for j in tl.static_range(SLOTS):
                lo, hi = halves_to_f32(accs[j], PAIR, ASM)
                if ONE_GROUP:
                    total += lo + hi
                else:
                    total += (lo + hi) * scales[j]
            accs = (tl.zeros(total.shape, tl.int32),) * SLOTS
    if ONE_GROUP:
        total = total * s
    return total * (1 << LOG)


@triton.jit
def _tile_fields(x_ptr, words, s_ptr, z_ptr, t, cols, N, K,
                 BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, EVEN_K: tl.constexpr,
                 ASM: tl.constexpr):
    """The same sum field by field in fp32, one weight per instruction: 8-bit bf16. Stored values
    become floats with the 2**23 trick (no conversion instruction); the activations come as the
    packed path's bf16 pairs (two 64-bit loads per 8), widened to fp32 by a shift or a mask."""
    PACK: tl.constexpr = 32 // BITS
    TILE_K: tl.constexpr = _SUBTILE * PACK
    Q: tl.constexpr = PACK // 2
    ONE_GROUP: tl.constexpr = GROUP % (16 * PACK) == 0  # the whole tile shares one scale and zero
    k0 = t * TILE_K
    total = tl.zeros(cols.shape, tl.float32) + tl.zeros(k0.shape, tl.float32)
    if ONE_GROUP:
        s, z = _field_params(s_ptr, z_ptr, k0, cols, N, K, HAS_ZERO, GROUP)
    for a in tl.static_range(4):
        for q in tl.static_range(Q):  # fields q and Q + q of rows 4 a + b: inputs 8 (a Q + q) + 0..7
            k_pair = k0 + 8 * (a * Q + q)
            if not ONE_GROUP:
                s, z = _field_params(s_ptr, z_ptr, k_pair, cols, N, K, HAS_ZERO, GROUP)
            offset = 8388608.0 + (1 << (BITS - 1)) + z
            xps = _x_pairs(x_ptr, k_pair, K, EVEN_K, ASM)
            chain = tl.zeros_like(total)
            for b in tl.static_range(4):
                w = words[4 * a + b]
                xs = halves_to_f32(xps[b], tl.bfloat16, ASM)  # x[k_pair + 2 b + p], p = 0, 1
                for p in tl.static_range(2):
                    field = (w >> (BITS * (p * Q + q))) & ((1 << BITS) - 1)
                    v = (field | 0x4B000000).to(tl.float32, bitcast=True)
                    chain += xs[p] * (v - offset)
            total += chain * s
    return total


@triton.jit
def _gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    K, tiles_per_split, N: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr, PAIR: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, WARPS: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    TILE_K: tl.constexpr = _SUBTILE * PACK
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # out-of-range columns read column N - 1 (valid memory, no predicated loads); never stored
    if N % BLOCK_N == 0:
        cols = offs_n[None, :]
    else:
        cols = tl.minimum(offs_n, N - 1)[None, :]
    warp_tile = tl.arange(0, WARPS)[:, None]
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, tl.cdiv(K, TILE_K))
    # The field masks of the packed path, (1 << BITS) - 1 in both halves (and shifted by 4), and
    # 8-bit fp16's magic bytes, held in registers: as literals, ptxas re-materializes them in the
    # loop, one MOV per use (LOP3 takes one immediate, the 16-bit float magic). ``K >> 31`` is 0
    # but opaque to the compiler.
    mask = (((1 << BITS) - 1) * 0x10001) ^ (K >> 31)
    masks = (mask, mask << 4, 0x64646464 ^ (K >> 31))
    acc = tl.zeros((WARPS, BLOCK_N), dtype=tl.float32)
    # Software pipelined: the words of a warp's next tile are loaded (into registers) before the
    # math on this one. A warp past the end re-reads the last tile, counted as 0.
    words = _load_words(qw_ptr, tl.minimum(t_begin + warp_tile, t_end - 1), cols, N, ASM)
    for t0 in range(t_begin, t_end, WARPS):
        t = t0 + warp_tile
        t_read = tl.minimum(t, t_end - 1)
        next_words = _load_words(qw_ptr, tl.minimum(t + WARPS, t_end - 1), cols, N, ASM)
        if PAIR != tl.float32:
            part = _tile_packed(x_ptr, words, s_ptr, z_ptr, t_read, cols, N, K, masks, BITS, GROUP, HAS_ZERO, PAIR,
                                EVEN_K, ASM)
        else:
            part = _tile_fields(x_ptr, words, s_ptr, z_ptr, t_read, cols, N, K, BITS, GROUP, HAS_ZERO, EVEN_K, ASM)
        acc += tl.where(t < t_end, part, 0.0)
        words = next_words
    total = tl.sum(acc, axis=0)  # the warps' K tiles meet once, in a fixed order
    if SPLIT:
        tl.store(part_ptr + pid_k * N + offs_n, total, mask=n_mask)
        tl.debug_barrier()  # every thread's partial sums are written before the count says so
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(1) - 1:  # the last split of this column block adds them all
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in range(0, tl.num_programs(1)):
                total += tl.load(part_ptr + s * N + offs_n, mask=n_mask, other=0.0, cache_modifier=".cg")
            _store(total, bias_ptr, out_ptr, offs_n, n_mask, HAS_BIAS)
            tl.store(count_ptr + pid_n, 0)  # ready for the next launch
    else:
        _store(total, bias_ptr, out_ptr, offs_n, n_mask, HAS_BIAS)


@triton.jit
def _store(total, bias_ptr, out_ptr, offs_n, n_mask, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)


# -- launch -----------------------------------------------------------------------------------------

_COUNTERS: dict[str, torch.Tensor] = {}  # per device: one arrival counter per column block, kept at 0


def pair_type(bits: int, dtype: torch.dtype):
    """The 16-bit type pairs of weights are multiplied in, or fp32 where ``magic + u`` is not
    exact in the activation type (8 bits in bf16)."""
    if dtype == torch.float16:
        return tl.float16
    return tl.bfloat16 if bits <= 4 else tl.float32


def default_split(out_features: int, num_tiles: int, block_n: int, warps: int, sms: int = 132) -> int:
    """K splits that give every SM (an H100's 132 unless told) a program: none where the column
    blocks alone do (N >= 16896 at 128 columns), and never so many that a warp has fewer than
    two tiles to loop over. The autotuner also times half and twice this."""
    blocks = triton.cdiv(out_features, block_n)
    return max(1, min(triton.cdiv(sms, blocks), num_tiles // (2 * warps)))


def _counters(device: torch.device, blocks: int) -> torch.Tensor:
    """Zeroed counters, allocated (one memset) only when a larger layer first needs them. Each
    launch leaves them at zero; launches on one stream never overlap, so they can share them."""
    key = str(device)
    if key not in _COUNTERS or _COUNTERS[key].numel() < blocks:
        _COUNTERS[key] = torch.zeros(max(blocks, 1024), dtype=torch.int32, device=device)
    return _COUNTERS[key]


def launch_gemv(x: torch.Tensor, kw, bias: torch.Tensor | None, out: torch.Tensor, block_n: int, warps: int,
                split_k: int, interpreted: bool) -> None:
    """``out[0] = x[0] @ W.T + bias`` for one row ``x [1, K]`` (contiguous) into ``out [1, N]``."""
    K, N = kw.in_features, kw.out_features
    num_tiles = triton.cdiv(K, kw.tile_k)
    per_split = triton.cdiv(triton.cdiv(num_tiles, split_k), warps) * warps  # whole CTA iterations
    splits = triton.cdiv(num_tiles, per_split)
    if not interpreted and (K % 4 or x.data_ptr() % 8):  # activations are read 4 at a time
        padded = torch.zeros(1, triton.cdiv(K, 4) * 4, dtype=x.dtype, device=x.device)
        padded[:, :K] = x
        x = padded
    blocks = triton.cdiv(N, block_n)
    partials = torch.empty(splits, N, dtype=torch.float32, device=x.device) if splits > 1 else out
    counters = _counters(x.device, blocks) if splits > 1 else out
    _gemv_kernel[(blocks, splits)](
        x, kw.qweight, kw.scales, kw.zeros if kw.zeros is not None else kw.scales,
        bias if bias is not None else kw.scales, out, partials, counters,
        K, per_split, N=N,
        BITS=kw.bits, GROUP=kw.group_len if kw.num_groups > 1 else num_tiles * kw.tile_k,
        HAS_ZERO=kw.zeros is not None, HAS_BIAS=bias is not None, SPLIT=splits > 1,
        PAIR=pair_type(kw.bits, x.dtype), ASM=not interpreted, EVEN_K=K % kw.tile_k == 0,
        BLOCK_N=block_n, WARPS=warps, num_warps=warps, num_stages=1,
    )
