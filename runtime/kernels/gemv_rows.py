"""The few-row weight GEMV (decode at batch 2..16): ``y = x @ W.T + b`` for ``ROWS`` rows a program, on
CUDA cores, in the design of the M=1 GEMV (``gemv.py``: its layout, word loads, steps and K split).

Why (bench/results/gpu/NOTES.md, "Small M", static): the 16-row ``tl.dot`` loop the tuner offered
for 2..16 rows ran at about a quarter of copy bandwidth on the H200, while the M=1 GEMV ran at
53-66%. Read off its sm_90a SASS, that loop waits for all its asynchronous copies at the top of
every iteration and issues the next ones at the bottom (no overlap of a CTA's loads with its own
math), then loads scales and zero points synchronously; the GEMV instead keeps a whole tile of
words per warp in flight in registers, one iteration ahead, with no barrier.

Each thread owns ``BLOCK_N / 32`` whole output columns; each warp of the CTA takes its own K tile
(as in ``gemv.py``); the tile's 16 word rows come as 16-byte loads an iteration ahead. A weight
pair is unpacked once (one ``LOP3``, in fp16 4-bit also a shift per word) and turned into
``(q - zero) * 2**-bits`` once (one packed fma, ``packed_pairs.offset_pair``), then multiplied into
each of the ``ROWS`` rows' chains (one packed fma a row, ``packed_pairs.mac_pair``): ``(2 + ROWS) / 2``
instructions per weight, the weight bytes read once for all rows. A row's 8 activations of one
pair slot come as one 16-byte load (``_x_quad``), shared by the thread's columns.

Chains (16-bit packed sums, as in ``gemv.py``) are 16 terms long, so the error bound and the
overflow limit (``|x| <= 4000`` in fp16) are the GEMV's: with the whole tile in one group, a chain
runs over the 4 word rows of one ``a`` and up to 4 pair slots (slots share the scale and, the odd
in-place ones included, the step), then goes to an fp32 sum, scaled once per tile; with smaller
groups, a chain is one slot's 4 rows, scaled as it is folded. 8-bit weights in bf16 (fp32 fields
in ``gemv.py``) are not offered here.

Rows past M read row M - 1 (never stored). The K split and its in-launch reduction are the GEMV's:
fp32 partial sums per split, the last program of a (row block, column block) to arrive adds them
in split order, with the bias.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.gemv import _counters, _field_params, _load_words, _store, _x_pairs, pair_type
from runtime.kernels.packed_pairs import byte_pairs, halves_to_f32, mac_pair, magic_pairs, magic_value, \
    neg_offset_pair, offset_pair

_SUBTILE = tl.constexpr(16)  # word rows per K tile (weight_layout.SUBTILE_K)
MAX_ROWS = 16  # rows a program takes at most (registers: ROWS chains and sums per column)


@triton.jit
def _x_quad(x_row, k, K, EVEN_K: tl.constexpr, ASM: tl.constexpr):
    """Activations ``k .. k + 7`` of one row as 4 packed pairs: one 16-byte load (``EVEN_K``: the
    launcher gives 16-byte aligned rows), else ``gemv._x_pairs``' two masked 8-byte loads."""
    if ASM and EVEN_K:
        x32 = x_row.to(tl.pointer_type(tl.int32), bitcast=True)
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [x32 + k // 2],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
        pairs = (p0, p1, p2, p3)
    else:
        pairs = _x_pairs(x_row, k, K, EVEN_K, ASM)
    return pairs


@triton.jit
def _fold(totals, chains, scale, ROWS: tl.constexpr, SCALED: tl.constexpr, PAIR: tl.constexpr, ASM: tl.constexpr):
    """Each row's chain (two 16-bit sums) added to its fp32 total (times ``scale`` if ``SCALED``)."""
    new = ()
    for r in tl.static_range(ROWS):
        lo, hi = halves_to_f32(chains[r], PAIR, ASM)
        if SCALED:
            new = new + (totals[r] + (lo + hi) * scale,)
        else:
            new = new + (totals[r] + (lo + hi),)
    return new


@triton.jit
def _tile_rows(x_rows, words, s_ptr, z_ptr, t, cols, N, K, masks,
               BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, PAIR: tl.constexpr,
               EVEN_K: tl.constexpr, ASM: tl.constexpr, ROWS: tl.constexpr):
    """fp32 ``[warps, BLOCK_N]`` per row: each warp's tile ``t`` times each row of ``x_rows``."""
    PACK: tl.constexpr = 32 // BITS
    TILE_K: tl.constexpr = _SUBTILE * PACK
    SLOTS: tl.constexpr = PACK // 2
    IN_PLACE: tl.constexpr = PAIR == tl.float16 and BITS == 4  # as gemv._tile_packed
    LOG: tl.constexpr = BITS if PAIR == tl.float16 else 0
    STEP: tl.constexpr = 0x2C00 if BITS == 4 else (0x1C00 if BITS == 8 else 0x3400)
    ONE_GROUP: tl.constexpr = GROUP % (16 * PACK) == 0
    # slots per chain: 4 rows x FOLD slots = at most 16 terms (one group); 4 terms otherwise
    FOLD: tl.constexpr = (4 if SLOTS > 4 else SLOTS) if ONE_GROUP else 1
    k0 = t * TILE_K
    half: tl.constexpr = 1 << (BITS - 1)
    magic = magic_value(PAIR)
    if ONE_GROUP:
        s, z = _field_params(s_ptr, z_ptr, k0, cols, N, K, HAS_ZERO, GROUP)
    zero_sum = tl.zeros(cols.shape, tl.float32) + tl.zeros(k0.shape, tl.float32)
    totals = (zero_sum,) * ROWS
    empty = (tl.zeros(zero_sum.shape, tl.int32),) * ROWS
    chains = empty
    for a in tl.static_range(4):
        for j in tl.static_range(SLOTS):  # pair j of rows 4 a + b: inputs 8 (a SLOTS + j) + 2 b + 0..1
            k_pair = k0 + 8 * (a * SLOTS + j)
            if not ONE_GROUP:
                s, z = _field_params(s_ptr, z_ptr, k_pair, cols, N, K, HAS_ZERO, GROUP)
            if IN_PLACE and j % 2 == 1:
                nof = neg_offset_pair(z, z, magic / 16 + half, 1.0 / (1 << LOG), PAIR)
            else:
                nof = neg_offset_pair(z, z, magic + half, 1.0 / (1 << LOG), PAIR)
            xq = ()
            for r in tl.static_range(ROWS):
                xq = xq + (_x_quad(x_rows[r], k_pair, K, EVEN_K, ASM),)
            for b in tl.static_range(4):
                w = words[4 * a + b]
                if IN_PLACE:  # pairs 0, 1 from the word, 2, 3 from the word >> 8
                    v = magic_pairs(w >> (8 * (j // 2)), masks[j % 2], PAIR, ASM)
                elif BITS == 8 and PAIR == tl.float16:
                    v = byte_pairs(w, masks[2], j, ASM)
                else:
                    v = magic_pairs(w >> (BITS * j), masks[0], PAIR, ASM)
                d = offset_pair(v, nof, PAIR, 0x1C00 if IN_PLACE and j % 2 == 1 else STEP, ASM)
                new = ()
                for r in tl.static_range(ROWS):
                    new = new + (mac_pair(chains[r], xq[r][b], d, PAIR, ASM),)
                chains = new
            if j % FOLD == FOLD - 1:
                totals = _fold(totals, chains, s, ROWS, not ONE_GROUP, PAIR, ASM)
                chains = empty
    out = ()
    for r in tl.static_range(ROWS):
        if ONE_GROUP:
            out = out + (totals[r] * s * (1 << LOG),)
        else:
            out = out + (totals[r] * (1 << LOG),)
    return out


@triton.jit
def _gemv_rows_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, K, stride_x, tiles_per_split, N: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr, PAIR: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, WARPS: tl.constexpr, ROWS: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    TILE_K: tl.constexpr = _SUBTILE * PACK
    # row blocks first: the programs reading one column block's words run side by side (L2)
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if N % BLOCK_N == 0:
        cols = offs_n[None, :]
    else:
        cols = tl.minimum(offs_n, N - 1)[None, :]
    warp_tile = tl.arange(0, WARPS)[:, None]
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, tl.cdiv(K, TILE_K))
    mask = (((1 << BITS) - 1) * 0x10001) ^ (K >> 31)  # registers, not literals: see gemv._gemv_kernel
    masks = (mask, mask << 4, 0x64646464 ^ (K >> 31))
    x_rows = ()
    for r in tl.static_range(ROWS):  # rows past M read row M - 1, never stored
        x_rows = x_rows + (x_ptr + tl.minimum(pid_m * ROWS + r, M - 1).to(tl.int64) * stride_x,)
    accs = (tl.zeros((WARPS, BLOCK_N), dtype=tl.float32),) * ROWS
    words = _load_words(qw_ptr, tl.minimum(t_begin + warp_tile, t_end - 1), cols, N, ASM)
    for t0 in range(t_begin, t_end, WARPS):  # software pipelined as gemv._gemv_kernel
        t = t0 + warp_tile
        next_words = _load_words(qw_ptr, tl.minimum(t + WARPS, t_end - 1), cols, N, ASM)
        parts = _tile_rows(x_rows, words, s_ptr, z_ptr, tl.minimum(t, t_end - 1), cols, N, K, masks,
                           BITS, GROUP, HAS_ZERO, PAIR, EVEN_K, ASM, ROWS)
        new = ()
        for r in tl.static_range(ROWS):
            new = new + (accs[r] + tl.where(t < t_end, parts[r], 0.0),)
        accs = new
        words = next_words
    for r in tl.static_range(ROWS):
        row = pid_m * ROWS + r
        row_mask = n_mask & (row + tl.zeros_like(offs_n) < M)
        total = tl.sum(accs[r], axis=0)  # the warps' K tiles meet once, in a fixed order
        if SPLIT:
            tl.store(part_ptr + (pid_k * M + row) * N + offs_n, total, mask=row_mask)
        else:
            _store(total, bias_ptr, out_ptr + row.to(tl.int64) * N, offs_n, row_mask, HAS_BIAS)
    if SPLIT:
        tl.debug_barrier()  # every thread's partial sums are written before the count says so
        counter = count_ptr + pid_m * tl.num_programs(1) + pid_n
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(2) - 1:  # the last split of this block adds them all
            for r in tl.static_range(ROWS):
                row = pid_m * ROWS + r
                row_mask = n_mask & (row + tl.zeros_like(offs_n) < M)
                total = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for s in range(0, tl.num_programs(2)):
                    total += tl.load(part_ptr + (s * M + row) * N + offs_n, mask=row_mask, other=0.0,
                                     cache_modifier=".cg")
                _store(total, bias_ptr, out_ptr + row.to(tl.int64) * N, offs_n, row_mask, HAS_BIAS)
            tl.store(counter, 0)  # ready for the next launch


def supports(bits: int, dtype: torch.dtype | None) -> bool:
    """Whether the few-row GEMV takes this format (``dtype`` None: every activation dtype): the packed
    16-bit path, not 8-bit bf16."""
    dtypes = (torch.float16, torch.bfloat16) if dtype is None else (dtype,)
    return all(pair_type(bits, d) != tl.float32 for d in dtypes)


def launch_gemv_rows(x: torch.Tensor, kw, bias: torch.Tensor | None, out: torch.Tensor, rows: int, block_n: int,
                     warps: int, split_k: int, interpreted: bool) -> None:
    """``out = x @ W.T + bias`` for ``x [M, K]`` (unit column stride) into ``out [M, N]`` (contiguous),
    ``rows`` rows a program."""
    if not supports(kw.bits, x.dtype):
        raise ValueError(f"the few-row GEMV takes no {kw.bits}-bit weights with {x.dtype} activations")
    if rows > MAX_ROWS or rows & (rows - 1):
        raise ValueError(f"rows per program must be a power of two up to {MAX_ROWS}, got {rows}")
    M, K = x.shape
    N = kw.out_features
    num_tiles = triton.cdiv(K, kw.tile_k)
    per_split = triton.cdiv(triton.cdiv(num_tiles, split_k), warps) * warps  # whole CTA iterations
    splits = triton.cdiv(num_tiles, per_split)
    even_k = K % kw.tile_k == 0
    # 16-byte activation loads (EVEN_K) need 16-byte aligned rows; masked 8-byte loads, 8-byte ones
    align = 8 if even_k else 4
    if not interpreted and (x.stride(0) % align or x.data_ptr() % (2 * align) or K % 4):
        padded = torch.zeros(M, triton.cdiv(K, align) * align, dtype=x.dtype, device=x.device)
        padded[:, :K] = x
        x = padded
    blocks, row_blocks = triton.cdiv(N, block_n), triton.cdiv(M, rows)
    partials = torch.empty(splits, M, N, dtype=torch.float32, device=x.device) if splits > 1 else out
    counters = _counters(x.device, blocks * row_blocks) if splits > 1 else out
    _gemv_rows_kernel[(row_blocks, blocks, splits)](
        x, kw.qweight, kw.scales, kw.zeros if kw.zeros is not None else kw.scales,
        bias if bias is not None else kw.scales, out, partials, counters,
        M, K, x.stride(0), per_split, N=N,
        BITS=kw.bits, GROUP=kw.group_len if kw.num_groups > 1 else num_tiles * kw.tile_k,
        HAS_ZERO=kw.zeros is not None, HAS_BIAS=bias is not None, SPLIT=splits > 1,
        PAIR=pair_type(kw.bits, x.dtype), ASM=not interpreted, EVEN_K=even_k,
        BLOCK_N=block_n, WARPS=warps, ROWS=rows, num_warps=warps, num_stages=1,
    )
