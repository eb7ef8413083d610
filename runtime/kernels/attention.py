"""Triton kernels for attention over the paged quantized KV cache (GPU; tested in the interpreter).

Three operations, each with the same signature as its PyTorch reference in
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
* :func:`write_kv`: quantize-on-write. New tokens (many in prefill, one in decode) and the
  residual's rows fill blocks; a filled block is quantized into its physical block (min/max
  qparams, rounding and packing exactly as ``kvquant.quantize_kv``), the rest go to the
  residual. Two launches on one stream: the block quantizer reads the old residual rows
  before the residual writer overwrites them.
* :func:`dequantize_cache`: the blocks and residual back to a dense ``[S, H, L, D]`` copy
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

from kvquant import KVScheme
from runtime.cache import KVCache
from runtime.kernels import decode_folded as folded
from runtime.kernels import kv_reference as ref
from runtime.kernels.kv_reference import PagedKV

_MAGIC_ROUND = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + M - M rounds |x| < 2**22 half-to-even
_FP16_TINY = tl.constexpr(6.103515625e-05)  # torch.finfo(torch.float16).tiny, kvquant's scale floor
_ZERO_BOUND = tl.constexpr(2.0**-14)  # scale >= max|x| * 2**-14 keeps |zero| < 2**14 (quant.affine)
_FP32_TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny (FP8 scale floor)
_FP8_MAX = tl.constexpr(448.0)
_LOG2E = 1.4426950408889634

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
MAX_SPLITS = 64
# 32-token tiles: ptxas (sm_90, int4, head_dim 128, 4 warps) gives the decode kernel 128 registers
# (4 programs per SM) against 190 for 64-token tiles. A register count, not a measured speed: the
# benchmark sweeps tile, warps and stages (bench/attention.py) once a GPU is available.
DEFAULT_TILE = 32
WRITE_ROWS, WRITE_WARPS = 32, 8  # 64 rows x 4 warps spilled registers in the write kernel; 32 x 8 does not


def interpreting() -> bool:
    """Whether these kernels were built for the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_decode_kernel, InterpretedFunction)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def unsupported_reason(scheme: KVScheme, head_dim: int, dtype: torch.dtype, device=None) -> str | None:
    """Why the kernels cannot serve this cache, or None when they can."""
    B, G = scheme.block_size, scheme.group_size
    if dtype not in _TL_DTYPES:
        return f"model dtype {dtype} (the kernels take float16, bfloat16 and float32)"
    if not (_pow2(head_dim) and 16 <= head_dim <= 256):
        return f"head_dim {head_dim} (the kernels take powers of two from 16 to 256)"
    if not (_pow2(B) and B >= 16):
        return f"block size (residual) {B} (the kernels take powers of two >= 16)"
    if scheme.kivi and not (_pow2(G) and G >= 16):
        return f"group_size {G} (the kernels take powers of two >= 16)"
    if scheme.fp8 and device is not None and torch.device(device).type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 9):
            return "FP8 on a GPU older than compute capability 8.9"
    return None


def supported(scheme: KVScheme, head_dim: int, dtype: torch.dtype, device=None) -> bool:
    return unsupported_reason(scheme, head_dim, dtype, device) is None


def _require_supported(paged: PagedKV) -> None:
    reason = unsupported_reason(paged.scheme, paged.head_dim, paged.dtype, paged.residual_k.device)
    if reason:
        raise ValueError(f"KV cache scheme {paged.scheme.name}: the Triton attention kernels do not support {reason}; "
                         "use runtime.kernels.kv_reference instead")


def _tile(scheme: KVScheme, tile: int | None = None) -> int:
    """Tokens per tile: divides the block and, for KIVI keys, the token group (one scale row per tile)."""
    t = tile or DEFAULT_TILE
    if not (_pow2(t) and t >= 16):
        raise ValueError(f"tile must be a power of two >= 16, got {t}")
    t = min(t, scheme.block_size)
    return min(t, scheme.group_size) if scheme.kivi else t


def launch_config(bits: int, fp8: bool, kivi: bool, group_q: int, head_dim: int,
                  dtype: torch.dtype = torch.float16) -> dict:
    """Default tile (tokens), warps and pipeline stages of the decode kernel for a scheme (what
    the runtime launches, and what bench/sass_attention.py reports)."""
    # Static sm_90a counts (bench/sass.py), not timings: the benchmark sweeps these on a GPU.
    folded = dtype == torch.float16 and bits in (8, 4) and not fp8  # FOLD in _decode_kernel
    if not folded:
        return dict(tile=DEFAULT_TILE, num_warps=4, num_stages=2)
    if bits == 8:  # folded INT8: a block-wide tile spreads the per-tile softmax work
        return dict(tile=128, num_warps=4, num_stages=2)  # 4.6 instructions/element, 178 registers
    # folded INT4: a 16-word field tile is too narrow to share among more warps
    return dict(tile=DEFAULT_TILE, num_warps=1, num_stages=2)  # 4.6/element, 254 registers, no spills


def _scheme_constants(paged: PagedKV) -> dict:
    s = paged.scheme
    return dict(B=s.block_size, D=paged.head_dim, G=s.group_size if s.kivi else paged.head_dim,
                BITS=s.bits, FP8=s.fp8, KIVI=s.kivi)


def _placeholder(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Schemes without scale or zero still pass a pointer (never read)."""
    return like if t is None else t


# ----------------------------------------------------------------------------- dequantize


@triton.jit
def _dequant_pool_tile(data_ptr, scale_ptr, zero_ptr, plane, t0, row_ok,
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
def _residual_tile(res_ptr, plane, t0, row_ok, B: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr):
    """Rows ``t0 .. t0+TILE`` of one head of one sequence's residual (``plane = seq * H + head``)."""
    rows = t0 + tl.arange(0, TILE)
    ptrs = res_ptr + plane.to(tl.int64) * B * D + rows[:, None] * D + tl.arange(0, D)[None, :]
    return tl.load(ptrs, mask=row_ok[:, None], other=0.0)


@triton.jit
def _dequantize_kernel(kd, ks, kz, vd, vs, vz, rk_ptr, rv_ptr, table_ptr, lens_ptr, ko_ptr, vo_ptr,
                       table_stride, out_len,
                       H: tl.constexpr, B: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
                       FP8: tl.constexpr, KIVI: tl.constexpr, TILE: tl.constexpr, OUT: tl.constexpr):
    """Program (s, h, tile): one tile of keys and values of one head into the dense [S, H, L, D] copy."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    p0 = tl.program_id(2) * TILE  # first position of this tile
    length = tl.minimum(tl.load(lens_ptr + s), out_len)
    j = p0 // B
    t0 = p0 % B
    pos = p0 + tl.arange(0, TILE)
    ok = pos < length
    if (j + 1) * B <= length:  # a full block: in the pool
        blk = tl.load(table_ptr + s * table_stride + j)
        k = _dequant_pool_tile(kd, ks, kz, blk * H + h, t0, ok, True, B, D, G, BITS, FP8, KIVI, TILE, OUT)
        v = _dequant_pool_tile(vd, vs, vz, blk * H + h, t0, ok, False, B, D, G, BITS, FP8, KIVI, TILE, OUT)
    else:  # the partial block (or past the end: zeros)
        k = _residual_tile(rk_ptr, s * H + h, t0, ok, B, D, TILE).to(OUT)
        v = _residual_tile(rv_ptr, s * H + h, t0, ok, B, D, TILE).to(OUT)
    out = ((s * H + h).to(tl.int64) * out_len + pos[:, None]) * D + tl.arange(0, D)[None, :]
    keep = (pos < out_len)[:, None]
    tl.store(ko_ptr + out, k, mask=keep)
    tl.store(vo_ptr + out, v, mask=keep)


def dequantize_cache(paged: PagedKV, seq_lens: torch.Tensor, length: int | None = None):
    """Same as :func:`runtime.kernels.kv_reference.dequantize_cache`; ``length`` is required
    here (no host sync to find the longest sequence)."""
    _require_supported(paged)
    if length is None:
        raise ValueError("dequantize_cache on the GPU needs length= (the longest sequence) to size its output")
    S, H, B, D = paged.residual_k.shape
    out_k = paged.residual_k.new_empty(S, H, length, D)
    out_v = paged.residual_v.new_empty(S, H, length, D)
    if length == 0 or S == 0:
        return out_k, out_v
    TILE = _tile(paged.scheme)
    kd, ks, kz = (_placeholder(t, paged.k.data) for t in paged.k)
    vd, vs, vz = (_placeholder(t, paged.v.data) for t in paged.v)
    c = _scheme_constants(paged)
    _dequantize_kernel[(S, H, triton.cdiv(length, TILE))](
        kd, ks, kz, vd, vs, vz, paged.residual_k, paged.residual_v, paged.block_table, seq_lens.to(torch.int32),
        out_k, out_v, paged.block_table.stride(0), length,
        H=H, TILE=TILE, OUT=_TL_DTYPES[paged.dtype], **c)
    return out_k, out_v


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
    q = tl.load(q_ptr + q_rows[:, None] * D + cols[None, :], mask=head_ok[:, None], other=0.0)
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
            qs_fields, key_term = folded.fold_key_scales(q_fields, q_sum, ks, kz, plane, g0 % B, B, D, G, BITS, KIVI)
            for i in tl.static_range(STEP // TILE):
                p0 = g0 + i * TILE
                ok = p0 + tl.arange(0, TILE) >= tl.maximum(lo, p_begin)
                scores = folded.folded_scores(qs_fields, key_term, kd, ks, kz, plane, p0 % B, B, D, BITS, KIVI,
                                              TILE)
                m, l, alpha, p = _softmax_step(scores, ok, m, l, qk_scale)
                acc_fields, zs = folded.folded_values(p, alpha, acc_fields, vd, vs, vz, plane, p0 % B, B, D, G,
                                                      BITS, KIVI, TILE)
                zero_sum = zero_sum * alpha + zs
        acc = folded.merge_fields(acc_fields, QH, D, BITS) - zero_sum[:, None]
    else:
        for p0 in range(p_begin, pool_end, TILE):  # full blocks, from the pool
            blk = tl.load(table_ptr + s * table_stride + p0 // B)
            ok = p0 + tl.arange(0, TILE) >= lo
            k = _dequant_pool_tile(kd, ks, kz, blk * H + h, p0 % B, ok, True, B, D, G, BITS, FP8, KIVI, TILE, OUT)
            v = _dequant_pool_tile(vd, vs, vz, blk * H + h, p0 % B, ok, False, B, D, G, BITS, FP8, KIVI, TILE, OUT)
            m, l, acc = _attend_tile(q, k, v, ok, m, l, acc, qk_scale, IEEE)
    for p0 in range(tl.maximum(p_begin, n_full * B), p_end, TILE):  # the partial block, from the residual
        pos = p0 + tl.arange(0, TILE)
        ok = (pos >= lo) & (pos < length)
        k = _residual_tile(rk_ptr, s * H + h, p0 % B, ok, B, D, TILE).to(OUT)
        v = _residual_tile(rv_ptr, s * H + h, p0 % B, ok, B, D, TILE).to(OUT)
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
    _require_supported(paged)
    group_q = ref.check_query(q, paged)
    S, H, B, D = paged.residual_k.shape
    if seq_lens.shape != (S,):
        raise ValueError(f"seq_lens must have one entry per sequence ({S}), got shape {tuple(seq_lens.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must be a positive number of positions, got {window}")
    sch = paged.scheme
    config = launch_config(sch.bits, sch.fp8, sch.kivi, group_q, D, paged.dtype)
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
    kd, ks, kz = (_placeholder(t, paged.k.data) for t in paged.k)
    vd, vs, vz = (_placeholder(t, paged.v.data) for t in paged.v)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    _decode_kernel[(S, H, splits)](
        q, kd, ks, kz, vd, vs, vz, paged.residual_k, paged.residual_v, paged.block_table,
        seq_lens.to(torch.int32), out, part_o, part_lse, scale * _LOG2E, window or 0,
        paged.block_table.stride(0), per_split, splits,
        H=H, GROUP_Q=group_q, QH=max(16, triton.next_power_of_2(group_q)), TILE=_tile(paged.scheme, tile),
        SLIDING=window is not None, IEEE=q.dtype == torch.float32, OUT=_TL_DTYPES[q.dtype],
        **_scheme_constants(paged),
        num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        _combine_kernel[(S * q.shape[1],)](part_o, part_lse, out, splits, MAX=MAX_SPLITS, D=D)
    return out.to(q_dtype)


# ------------------------------------------------------------------------ quantize-on-write


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
def _round_to_e4m3(y):
    """``y`` (|y| <= 448) rounded to the nearest float8 e4m3 value, ties to even, still in fp32, so
    the cast that follows is exact: torch's rounding, on any converter (the interpreter's drops
    the carry of roundings that cross a power of two)."""
    bits = y.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # subnormals step like the smallest normals
    # 1.5 * 2**(exp + 20): added to |y| it leaves e4m3's step 2**(exp - 3) as the last place kept
    magic = (((exp + 20 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    r = (tl.abs(y) + magic) - magic
    return tl.where(bits < 0, -r, r)  # the sign bit, so -0 stays -0


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
            y = _round_to_e4m3(tl.div_rn(x, scale))
            tl.store(data_ptr + plane * B * D + rows[:, None] * D + cols[None, :], y.to(data_ptr.dtype.element_ty))
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
             num_warps: int = WRITE_WARPS) -> None:
    """Same as :func:`runtime.kernels.kv_reference.write_kv`. The caller allocates the blocks the
    write fills (``block_table`` entries >= 0); no host sync."""
    _require_supported(paged)
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
    kd, ks, kz = (_placeholder(t, paged.k.data) for t in paged.k)
    vd, vs, vz = (_placeholder(t, paged.v.data) for t in paged.v)
    c = _scheme_constants(paged)
    cache_dtype = _TL_DTYPES[paged.dtype]
    strides = (k.stride(0), k.stride(1), k.stride(2))
    fills = (B - 1 + T) // B  # most blocks one sequence can fill
    if fills:
        rows = min(B, WRITE_ROWS)
        key_rows = paged.scheme.group_size if paged.scheme.kivi else rows
        _write_blocks_kernel[(S, H, fills)](
            k, v, paged.residual_k, paged.residual_v, kd, ks, kz, vd, vs, vz, paged.block_table, starts,
            T, paged.block_table.stride(0), *strides, KEY_ROWS=key_rows, ROWS=rows, CACHE=cache_dtype, H=H, **c,
            KEY_RATIO=paged.scheme.range_ratio(True), VALUE_RATIO=paged.scheme.range_ratio(False),
            num_warps=num_warps, enable_fp_fusion=False)  # no FMA: qparams round exactly as kvquant's
    # after the blocks (same stream): they read residual rows this overwrites
    residual_rows = 16
    _write_residual_kernel[(S, H, triton.cdiv(min(T, B - 1), residual_rows))](
        k, v, paged.residual_k, paged.residual_v, starts, T, *strides, H=H, B=B, D=D, ROWS=residual_rows,
        CACHE=cache_dtype, num_warps=4)


# ----------------------------------------------------------------------- the cache's attention

KERNEL_OPS = ref.AttentionOps(write_kv, dequantize_cache, decode_attention)


def cache_attention(cache, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor | None:
    """:func:`runtime.kernels.kv_reference.cache_attention` on these kernels; None when they do not
    support the cache (the caller then takes the reference path)."""
    if not isinstance(cache, KVCache) or q.dtype != cache.dtype:
        return None
    if not supported(cache.scheme, cache.head_dim, cache.dtype, cache.device):
        return None
    return ref.cache_attention(cache, layer, start, q, k, v, mask, window, ops=KERNEL_OPS)
