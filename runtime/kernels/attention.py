"""Triton kernels for attention over the paged quantized KV cache (GPU; tested in the interpreter).

Three operations (the first two here), each with the same signature as its PyTorch reference in
:mod:`runtime.kernels.kv_reference` (which is built on ``kvquant``), reading and writing the
layout that ``runtime/cache.py``'s module docstring fixes:

* :func:`decode_attention`: one query per sequence over its cached blocks and residual.
  A program owns one KV head of one sequence and one contiguous range of blocks (flash-
  decoding: the sequence is split so that small batches still fill the GPU); it loads each
  tile of packed keys and values once for all the query heads that share that KV head (GQA:
  the query heads are the rows of a ``tl.dot``), dequantizes it in registers and runs an
  online softmax. INT8 and INT4 pools over fp16 models are not dequantized at all: each packed
  field is its own dot operand and the scales are folded into the query and the softmax
  weights (:mod:`runtime.kernels.decode_folded`). Each split leaves its normalized output and log-sum-exp; a second kernel
  combines the splits (skipped when there is one split). The split count is a runtime argument:
  a growing context changes the grid, never the compiled kernel. Sequence ``s`` reads
  ``seq_lens[s]`` positions: a batch may mix lengths.
* :func:`write_kv` (in :mod:`runtime.kernels.kv_write`): quantize-on-write, bit-identical to
  ``kvquant.quantize_kv``.
* :func:`dequantize_cache` (in ``runtime/kernels/kv_dequantize.py``, with the tile readers
  both kernels share): the blocks and residual back to a dense ``[S, H, L, D]`` copy
  (chunked prefill reads earlier chunks through it; the benchmark's dequantize-then-SDPA path).

Dequantization is ``(q - zero) * scale`` in fp32 rounded once to the model dtype, as
``quant.affine.dequantize(...).to(dtype)``: the kernels see bit-identical keys and values.
Quantization uses IEEE division (``tl.div_rn``) and round-half-to-even like ``torch.round``,
so blocks written on the GPU equal ``kvquant.quantize_kv`` on the CPU bit for bit. (PyTorch on
CUDA divides by a Python scalar as a multiply by its reciprocal, so ``kvquant`` *run on CUDA*
may differ from both in the last bit of a scale, and then by one step in a code.)

Shapes the kernels take (others fall back to the reference, see :func:`supported`): block
size and head_dim powers of two >= 16, KIVI group sizes powers of two >= 16, fp16/bf16/fp32.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from runtime.cache_lockstep import LockstepCache
from runtime.kernels import decode_folded as folded
from runtime.kernels import kv_reference as ref
from runtime.kernels.kv_reference import PagedKV
from runtime.kernels.kv_dequantize import DEFAULT_TILE, dequant_pool_tile, dequantize_cache, residual_tile, tile_tokens
from runtime.kernels.kv_write import write_kv
from runtime.kernels.paged import TL_DTYPES, placeholder, pow2, require_supported, scheme_constants, supported, unsupported_reason  # noqa: F401 (public here)

_LOG2E = 1.4426950408889634

MAX_SPLITS = 64


def interpreting() -> bool:
    """Whether these kernels were built for the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_decode_kernel, InterpretedFunction)


def launch_config(bits: int, fp8: bool, kivi: bool, group_q: int, head_dim: int,
                  dtype: torch.dtype = torch.float16) -> dict:
    """Default tile (tokens), warps and pipeline stages of the decode kernel for a scheme (what
    the runtime launches, and what bench/sass_attention.py reports)."""
    # Static sm_90a counts (bench/sass.py), not timings: the benchmark sweeps these on a GPU.
    folded = dtype == torch.float16 and bits in (8, 4) and not fp8  # FOLD in _decode_kernel
    if not folded:
        return dict(tile=DEFAULT_TILE, num_warps=4, num_stages=2)
    if bits == 8:  # folded INT8: a block-wide tile spreads the per-tile softmax work
        # 4.5 instructions/element, 180 registers (Triton 3.9); 4.6, 189-245 (3.6)
        return dict(tile=128, num_warps=4, num_stages=2)
    # folded INT4: a 16-word field tile is too narrow to share among more warps
    # 4.3/element, 219 registers (Triton 3.9); 4.6, 222 (3.6); no spills under either
    return dict(tile=DEFAULT_TILE, num_warps=1, num_stages=2)


# ------------------------------------------------------------------------- decode attention


@triton.jit
def _softmax_step(scores, ok, m, l, qk_scale):
    """Online-softmax bookkeeping (log2 domain) for one tile of raw scores [QH, TILE]: the new
    running max and sum, the factor ``alpha`` that rescales earlier sums, and the weights ``p``."""
    scores = tl.where(ok[None, :], scores * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    return m_new, l, alpha, p


@triton.jit
def _attend_tile(q, k, v, ok, m, l, acc, qk_scale, IEEE: tl.constexpr):
    """One online-softmax step of the query rows ``q`` [QH, D] over one dequantized tile."""
    if IEEE:  # fp32 models: no TF32 shortcut
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    m, l, alpha, p = _softmax_step(scores, ok, m, l, qk_scale)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m, l, acc


# Arguments that follow the context length are neither constexprs nor specialized (Triton compiles
# a variant for an int equal to 1 or divisible by 16): a growing context never recompiles.
_LENGTH_ARGS = ["blocks_per_split", "splits"]


@triton.jit(do_not_specialize=_LENGTH_ARGS)
def _decode_kernel(q_ptr, kd, ks, kz, vd, vs, vz, rk_ptr, rv_ptr, table_ptr, lens_ptr, out_ptr, part_o_ptr,
                   part_lse_ptr, qk_scale, window, table_stride, blocks_per_split, splits,
                   H: tl.constexpr, GROUP_Q: tl.constexpr, QH: tl.constexpr, B: tl.constexpr, D: tl.constexpr,
                   G: tl.constexpr, BITS: tl.constexpr, FP8: tl.constexpr, KIVI: tl.constexpr,
                   TILE: tl.constexpr, SLIDING: tl.constexpr, IEEE: tl.constexpr,
                   OUT: tl.constexpr):
    """Program (s, h, split): query heads ``h*GROUP_Q ..`` of sequence ``s`` over the logical
    blocks ``split*blocks_per_split ..`` (the residual is the logical block after the last full one)."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + s)
    n_full = length // B
    lo = 0  # first visible position
    if SLIDING:
        lo = tl.maximum(length - window, 0)
    # positions [p_begin, p_end) of this split, walked in tiles that never straddle a block
    p_begin = tl.maximum(split * blocks_per_split * B, (lo // TILE) * TILE)
    p_end = tl.minimum((split + 1) * blocks_per_split * B, length)
    pool_end = tl.minimum(p_end, n_full * B)

    # INT8 and INT4 over an fp16 model: scales folded into the query and the softmax weights
    FOLD: tl.constexpr = (BITS == 8 or BITS == 4) and not FP8 and OUT == tl.float16
    heads = tl.arange(0, QH)
    head_ok = heads < GROUP_Q
    cols = tl.arange(0, D)
    q_rows = (s * H * GROUP_Q + h * GROUP_Q + heads).to(tl.int64)
    m = tl.full((QH,), float("-inf"), tl.float32)
    l = tl.zeros((QH,), tl.float32)
    acc = tl.zeros((QH, D), tl.float32)

    if FOLD:  # the pool's quantized keys and values, never dequantized (runtime/kernels/decode_folded.py)
        q_fields = folded.query_fields(q_ptr, q_rows, head_ok, D, BITS)
        q_sum = folded.field_sum(q_fields)
        acc_fields = folded.zero_fields(QH, D, BITS)
        zero_sum = tl.zeros((QH,), tl.float32)  # what the values' zero points take off every channel
        # KIVI: a loop step covers a key group, so the query is scaled once per group
        STEP: tl.constexpr = G if KIVI and G > TILE else TILE
        for g0 in range(tl.maximum(p_begin // STEP * STEP, 0), pool_end, STEP):
            plane = tl.load(table_ptr + s * table_stride + g0 // B) * H + h
            qs_fields, key_term = folded.fold_key_scales(q_fields, q_sum, ks, kz, plane, g0 % B, B, D, G, BITS,
                                                         KIVI, TILE)
            for i in tl.static_range(STEP // TILE):
                p0 = g0 + i * TILE
                if SLIDING:
                    ok = p0 + tl.arange(0, TILE) >= tl.maximum(lo, p_begin)
                else:  # splits start on block boundaries, so every position of a pool tile is visible
                    ok = tl.full((TILE,), 1, tl.int1)
                scores = folded.folded_scores(qs_fields, key_term, kd, ks, kz, plane, p0 % B, B, D, BITS, KIVI,
                                              TILE)
                m, l, alpha, p = _softmax_step(scores, ok, m, l, qk_scale)
                acc_fields, zs = folded.folded_values(p, alpha, acc_fields, vd, vs, vz, plane, p0 % B, B, D, G,
                                                      BITS, KIVI, TILE)
                zero_sum = zero_sum * alpha + zs
        acc = folded.merge_fields(acc_fields, QH, D, BITS) - zero_sum[:, None]
        # loaded only now, for the residual: not held through the main loop
        q = tl.load(q_ptr + q_rows[:, None] * D + cols[None, :], mask=head_ok[:, None], other=0.0)
    else:
        q = tl.load(q_ptr + q_rows[:, None] * D + cols[None, :], mask=head_ok[:, None], other=0.0)
        for p0 in range(p_begin, pool_end, TILE):  # full blocks, from the pool
            blk = tl.load(table_ptr + s * table_stride + p0 // B)
            ok = p0 + tl.arange(0, TILE) >= lo
            k = dequant_pool_tile(kd, ks, kz, blk * H + h, p0 % B, ok, True, B, D, G, BITS, FP8, KIVI, TILE, OUT)
            v = dequant_pool_tile(vd, vs, vz, blk * H + h, p0 % B, ok, False, B, D, G, BITS, FP8, KIVI, TILE, OUT)
            m, l, acc = _attend_tile(q, k, v, ok, m, l, acc, qk_scale, IEEE)
    # folded INT4 runs one warp: a 16-row residual tile keeps its [tile, D] keys and values from
    # pushing the kernel past 255 registers (ptxas then spills the loop-invariant addresses)
    RT: tl.constexpr = 16 if FOLD and BITS == 4 else TILE
    for p0 in range(tl.maximum(p_begin, n_full * B), p_end, RT):  # the partial block, from the residual
        pos = p0 + tl.arange(0, RT)
        ok = (pos >= lo) & (pos < length)
        k = residual_tile(rk_ptr, s * H + h, p0 % B, ok, B, D, RT).to(OUT)
        v = residual_tile(rv_ptr, s * H + h, p0 % B, ok, B, D, RT).to(OUT)
        m, l, acc = _attend_tile(q, k, v, ok, m, l, acc, qk_scale, IEEE)

    l_safe = tl.where(l == 0.0, 1.0, l)  # a split with no positions leaves zeros and lse = -inf
    o = acc / l_safe[:, None]
    if splits == 1:
        tl.store(out_ptr + q_rows[:, None] * D + cols[None, :], o.to(OUT), mask=head_ok[:, None])
    else:
        part = q_rows * splits + split
        tl.store(part_o_ptr + part[:, None] * D + cols[None, :], o, mask=head_ok[:, None])
        lse = tl.where(l == 0.0, float("-inf"), m + tl.log2(l_safe))
        tl.store(part_lse_ptr + part, lse, mask=head_ok)


@triton.jit(do_not_specialize=["splits"])
def _combine_kernel(part_o_ptr, part_lse_ptr, out_ptr, splits, MAX: tl.constexpr, D: tl.constexpr):
    """Program (query row): the splits' outputs weighted by their share of the softmax mass.
    ``splits`` (<= ``MAX``) is a runtime argument, so a growing context reuses one binary."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, MAX)
    lse = tl.load(part_lse_ptr + row * splits + sp, mask=sp < splits, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)  # empty splits weigh 0
    total = tl.sum(w, axis=0)
    cols = tl.arange(0, D)
    out = tl.zeros((D,), tl.float32)
    for i in range(splits):  # one row of D at a time: registers do not grow with MAX
        w_i = tl.exp2(tl.load(part_lse_ptr + row * splits + i) - top)
        out += w_i * tl.load(part_o_ptr + (row * splits + i) * D + cols)
    out = out / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * D + cols, out.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: a few splits, so the tests exercise the combine
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_attention(q: torch.Tensor, paged: PagedKV, seq_lens: torch.Tensor, window: int | None = None,
                     scale: float | None = None, max_seq_len: int | None = None, num_splits: int | None = None,
                     tile: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None) -> torch.Tensor:
    """Same as :func:`runtime.kernels.kv_reference.decode_attention` (q [S, Hq, D] -> [S, Hq, D]).

    ``max_seq_len`` (a bound on ``seq_lens``, known on the host) sizes the split; without it the
    block table's width is used. No host sync: lengths are only read on the device.
    ``num_splits``, ``tile``, ``num_warps`` and ``num_stages`` override the launch configuration.
    """
    require_supported(paged)
    group_q = ref.check_query(q, paged)
    S, H, B, D = paged.residual_k.shape
    if seq_lens.shape != (S,):
        raise ValueError(f"seq_lens must have one entry per sequence ({S}), got shape {tuple(seq_lens.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must be a positive number of positions, got {window}")
    c = scheme_constants(paged)
    config = launch_config(c["BITS"], c["FP8"], c["KIVI"], group_q, D, paged.dtype)
    num_warps = num_warps or config["num_warps"]
    num_stages = num_stages or config["num_stages"]
    if tile is None:  # fp32 tiles and IEEE dots: 32-token tiles spill registers (ptxas, sm_90)
        tile = 16 if paged.dtype == torch.float32 else config["tile"]
    q_dtype = q.dtype
    q = q.to(paged.dtype).contiguous()  # attention runs in the cache dtype, as the reference
    out = torch.empty_like(q)
    if S == 0:
        return out.to(q_dtype)
    bound = max_seq_len if max_seq_len is not None else paged.block_table.shape[1] * B
    if num_splits is None:
        num_splits = ref.num_splits(bound, B, S * H, target=2 * _sm_count(q.device), max_splits=MAX_SPLITS)
    blocks = max(math.ceil(bound / B), 1)
    per_split = math.ceil(blocks / max(1, min(num_splits, blocks, MAX_SPLITS)))
    splits = math.ceil(blocks / per_split)
    if splits > 1:
        part_o = torch.empty(S, q.shape[1], splits, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(S, q.shape[1], splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # not written
    kd, ks, kz = (placeholder(t, paged.k.data) for t in paged.k)
    vd, vs, vz = (placeholder(t, paged.v.data) for t in paged.v)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    _decode_kernel[(S, H, splits)](
        q, kd, ks, kz, vd, vs, vz, paged.residual_k, paged.residual_v, paged.block_table,
        seq_lens.to(torch.int32), out, part_o, part_lse, scale * _LOG2E, window or 0,
        paged.block_table.stride(0), per_split, splits,
        H=H, GROUP_Q=group_q, QH=max(16, triton.next_power_of_2(group_q)), TILE=tile_tokens(paged, tile),
        SLIDING=window is not None, IEEE=q.dtype == torch.float32, OUT=TL_DTYPES[q.dtype], **c,
        num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        _combine_kernel[(S * q.shape[1],)](part_o, part_lse, out, splits, MAX=MAX_SPLITS, D=D)
    return out.to(q_dtype)


# ----------------------------------------------------------------------- the cache's attention

KERNEL_OPS = ref.AttentionOps(write_kv, dequantize_cache, decode_attention)


def cache_attention(cache, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor | None:
    """:func:`runtime.kernels.kv_reference.cache_attention` on these kernels; None when they do not
    support the cache (the caller then takes the reference path)."""
    if not isinstance(cache, LockstepCache) or q.dtype != cache.dtype:
        return None
    if not supported(cache.scheme, cache.head_dim, cache.dtype, cache.device):
        return None
    return ref.cache_attention(cache, layer, start, q, k, v, mask, window, ops=KERNEL_OPS)
