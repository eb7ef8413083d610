"""Decode attention on CPU over the quantized cache's stored codes, scales folded (no dequantize).

The reference path (``PagedCache._read`` + SDPA) dequantizes every cached position of a layer
into a float buffer on every decode step: at long contexts that dominates the step, and an
INT4 cache cost twice the time of the unquantized one. Here a decode step (one new token per
sequence) gathers the pool's packed codes, turns them into floats as they are stored (one
conversion; no zero point subtracted) and applies the scales where they cost least, with the
algebra of the CUDA kernel (``runtime/kernels/decode_folded.py``). With ``u`` the stored
unsigned code and ``z' = zero + 2**(bits-1)``, ``x = (u - z') * s``:

* INT8 keys (per token ``t``): ``q.k_t = s_t (sum_c q_c u_tc - z'_t sum_c q_c)``: scale and zero
  apply to whole score columns;
* KIVI keys (per channel ``c`` over a group of ``G`` tokens):
  ``q.k_t = sum_c (q_c s_c) u_tc - sum_c q_c s_c z'_c``: the scales go into the query, once per
  group (one small product per group of ``G`` tokens: a batched matmul), the zero points into
  one bias per group and query row;
* values (per token, one channel group per head: INT8, KIVI with ``group_size == head_dim``):
  ``sum_t p_t s_t (u_tc - z'_t) = sum_t (p_t s_t) u_tc - sum_t p_t s_t z'_t``: the scales go
  into the softmax weights, the zero points into one sum per query row. Several channel groups
  per head: the scales multiply the codes in place (a scale that changes along a dot's columns
  cannot fold into its rows), the zero points as before, per group.

Codes are cut from whole int32 words (field ``f`` of every byte with one scalar shift and one
mask) and kept in that field order, fields leading: ``[f, ..., j]`` is channel ``j*F + f`` (``F =
8 / bits``), so the query (keys) and the output (values) are permuted instead, ``D`` numbers per
query row. Nothing the size of the history is written but the float codes, and those a few rows
(KV head x sequence) at a time (:data:`CHUNK_FLOATS`), so the product reads them from the core's
cache; no copy of the cache is kept between steps.

Everything is float32 (the stored float16 scales widened), so results equal the reference's to
float32 rounding (summation order differs; tests/test_cpu_attention.py). Which schemes take this
path: :func:`grids` (integer families: int8, kivi, kv-split); FP8 and the unquantized cache keep
the reference.

The same algebra runs compiled (``runtime/native/kv_attention.cpp``, :func:`native_attention`; the
layouts it walks: :func:`native_refusal`): one pass per (KV head x sequence) row, in parallel,
reading codes, scales and zero points from the pool's pages through the block table (nothing
gathered, no float codes written: a token's codes are widened in registers). Which of the two runs
is the attention backend's choice (``runtime/attention_backends/``: ``cpu-native``, then
``cpu-folded``, made once per model and cache scheme); the PyTorch code below is the compiled
kernel's reference and the fallback (no compiler, ``LOWBIT_NATIVE=0`` or ``LOWBIT_DISABLE=cpu-native``,
the layouts it does not walk).
"""

from __future__ import annotations

import functools

import torch

from kvquant import KVScheme, QuantizedKV


@functools.cache  # a frozen scheme and an int: asked per layer of every decode step
def grids(scheme: KVScheme, head_dim: int):
    """``(keys' grid, values' grid)`` (``kvquant.schemes.integer.IntGrid``) when decode attention
    over this scheme's cache runs on the stored codes, else None: integer families of 8, 4 or 2
    bits per side, keys per token over the whole head or per channel over groups of tokens,
    values per token over the head or over groups of whole bytes of channels. The unquantized
    and FP8 caches keep the reference path."""
    declared = getattr(scheme.definition, "grids", None)  # integer families declare their grids
    if not scheme.quantized or declared is None:
        return None
    keys, values = declared(scheme)
    if keys.bits not in (8, 4, 2) or values.bits not in (8, 4, 2) or values.over_tokens:
        return None
    if not keys.over_tokens and keys.group is not None:
        return None
    if values.group is not None and (values.group % (8 // values.bits) or head_dim % values.group):
        return None
    return keys, values


def folds(scheme: KVScheme, head_dim: int) -> bool:
    """Whether decode attention over this scheme's cache runs on the stored codes (:func:`grids`)."""
    return grids(scheme, head_dim) is not None


def decodes(scheme: KVScheme, head_dim: int) -> bool:
    """Whether decode steps over this scheme's cache attend over what it stores, one call per layer
    (the ``cpu-folded`` backend's cases): the integer ones it folds, and the unquantized one (its
    stored floats are read as they are: one batched call per layer instead of a read-back and an
    SDPA per sequence). FP8 keeps the reference path."""
    return not scheme.quantized or folds(scheme, head_dim)


# Float codes converted (or floats gathered) per chunk of rows (KV head x sequence): about this
# many floats, so they are still in the core's cache when the products read them (at batch 8 and
# 4k context a layer's keys are 25 MB as floats; per row, 1 MB). At least one row per chunk.
# 2**20 (4 MB) measured best of 2**18..2**24 for fp16, int8 and int4 at batch 8 and 4k (2 MB L2).
CHUNK_FLOATS = 1 << 20


def folded_attention(paged, q: torch.Tensor, lengths: list[int], window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over everything the cache holds for it, by PyTorch
    ops over the stored codes (the ``cpu-folded`` backend, ``runtime/attention_backends/``).

    ``paged``: ``runtime.kernels.kv_reference.PagedKV`` of one layer and the batch's rows (the new
    token already stored: :meth:`runtime.cache_paged.PagedCache.store`); ``q`` [S, Hq, 1, D];
    ``lengths[i]``: positions sequence ``i`` holds, the new one included; ``window``: the layer's
    sliding window (positions before ``length - window`` are not read; a ring may have dropped
    them). ``softcap``: scores through ``softcap * tanh(s / softcap)`` (Gemma 2). [S, Hq, 1, D]
    in ``q``'s dtype."""
    S, Hq, _, D = q.shape
    H, B = paged.residual_k.shape[1], paged.block_size
    nq, R = Hq // H, H * S
    # rows r = h * S + s: [R, nq, D]; query head h * nq + i reads KV head h (as SDPA's GQA); heads
    # lead, so each head's gathered tokens are one contiguous run
    qf = q.float().view(S, H, nq, D).transpose(0, 1).reshape(R, nq, D)
    firsts = [0 if window is None else max(n - window, 0) for n in lengths]
    stored = [n // B for n in lengths]
    lo, hi = min(f // B for f in firsts), max(stored)
    rest = max(n - s * B for n, s in zip(lengths, stored))  # residual positions read (the longest)
    pooled = (hi - lo) * B
    grid = grids(paged.scheme, D)
    # the rows' blocks lo..hi; -1 (ring, shorter row): page 0, masked
    pages = paged.block_table[:, lo:hi].clamp_min(0) if pooled else None
    mask = _invalid(lengths, firsts, stored, lo, hi, rest, B, q.device)
    if mask is not None:
        mask = mask.repeat(H, 1)[:, None]  # [R, 1, pooled + rest]
    out = torch.empty(R, nq, D, device=q.device)
    for heads, seqs in _chunks(H, S, max(1, CHUNK_FLOATS // ((pooled + rest) * D))):
        rows = slice(heads.start * S + seqs.start, (heads.stop - 1) * S + seqs.stop)  # [r]: h-major
        n = rows.stop - rows.start
        keys = values = None
        if pooled:  # [r, (hi-lo) * B, ...], gathered per chunk (so it, too, is read from cache)
            ids = pages[seqs].flatten()
            keys, values = (part.map(lambda t: _gather(t, heads, ids, n)) for part in (paged.k, paged.v))
        residual_k, residual_v = (r[seqs, heads, :rest].transpose(0, 1).reshape(n, rest, D)
                                  for r in (paged.residual_k, paged.residual_v))
        out[rows] = _attend_rows(qf[rows], keys, values, residual_k, residual_v,
                                 None if mask is None else mask[rows], grid, softcap)
    return out.view(H, S, nq, D).transpose(0, 1).reshape(S, Hq, 1, D).to(q.dtype)


@functools.cache  # decided once per (scheme, head_dim, dtypes): a backend's refusal, asked at its choice
def native_refusal(scheme: KVScheme, D: int, dtype: torch.dtype, data_dtype: torch.dtype) -> str | None:
    """Why the compiled kernel (``runtime/native/kv_attention.cpp``) does not walk this cache's
    layout, or None when it does: float32 model, head_dim and block size multiples of 16 (head_dim
    <= 256), key groups of whole 16-token tiles, a token's codes whole 16-byte chunks, value
    channel groups of whole chunks; the float (unquantized) pool and every integer scheme
    :func:`grids` accepts that fits. ``data_dtype``: how the pool stores a block (the layout)."""
    B = scheme.block_size
    if dtype != torch.float32:
        return f"model dtype {dtype} (the kernel takes float32 models)"
    if D % 16 or D > 256:
        return f"head_dim {D} (the kernel takes multiples of 16 up to 256)"
    if B % 16:
        return f"block size (residual) {B} (the kernel takes multiples of 16)"
    grid = grids(scheme, D)
    if grid is None:
        if scheme.quantized:
            return f"the {scheme.definition.name} family (the kernel reads integer codes and float32 pools)"
        return None if data_dtype == torch.float32 else f"an unquantized pool stored as {data_dtype}"
    keys, values = grid
    groups = 1 if values.group is None else D // values.group
    chunks = D * values.bits // 128  # 16-byte chunks of a token's value codes
    if keys.over_tokens and keys.group % 16:
        return f"key groups of {keys.group} tokens (the kernel takes whole 16-token tiles)"
    if D * keys.bits % 128 or not chunks or chunks % groups:
        return "a token's codes or a value channel group not whole 16-byte chunks"
    if B * groups > 4096:
        return f"{B} tokens x {groups} value groups per block (the kernel takes up to 4096)"
    return None


def native_attention(kernel, paged, q: torch.Tensor, lengths: list[int], window: int | None = None,
                     softcap: float | None = None, step: dict | None = None) -> torch.Tensor:
    """:func:`folded_attention` by the compiled kernel ``kernel`` (``runtime.native.load("kv_attention")``;
    the ``cpu-native`` backend, on the layouts :func:`native_refusal` accepts): one pass per (KV
    head x sequence) row over the pool's pages through the block table (nothing gathered, no float
    codes written). ``step``: a dict that lives one decode step (every layer's call with these
    ``lengths``), where what all its layers share is kept (the lengths as a tensor): a CPU decode
    step is dispatch-bound, so per-layer host work counts 30 times."""
    S, Hq, _, D = q.shape
    H = paged.residual_k.shape[1]
    key_grid, value_grid = grids(paged.scheme, D) or (None, None)
    qs = (q.reshape(S, H, Hq // H, D) * D ** -0.5).contiguous()  # the softmax scale folded into q
    bounds = None if step is None else step.get(("native bounds", window))
    if bounds is None:  # [2, S] int64: the lengths, then each sequence's first position in the window
        bounds = torch.tensor([lengths, [0 if window is None else max(n - window, 0) for n in lengths]])
        if step is not None:
            step[("native bounds", window)] = bounds

    def side(part, grid):
        if grid is None:
            return part.data.contiguous(), None, None, 32
        return part.data.contiguous(), part.scale.contiguous(), part.zero.contiguous(), grid.bits

    k_data, k_scale, k_zero, k_bits = side(paged.k, key_grid)
    v_data, v_scale, v_zero, v_bits = side(paged.v, value_grid)
    out = kernel.decode_attention(
        qs, paged.block_table.contiguous(), bounds[0], bounds[1],
        k_data, k_scale, k_zero, k_bits, key_grid.group if key_grid is not None and key_grid.over_tokens else 0,
        v_data, v_scale, v_zero, v_bits, paged.residual_k.contiguous(), paged.residual_v.contiguous(),
        float(softcap or 0.0))
    return out.view(S, Hq, 1, D)


def _gather(pool: torch.Tensor, heads: slice, pages: torch.Tensor, rows: int) -> torch.Tensor:
    """Pages ``pages`` of a pool tensor [N, H, ...] for KV heads ``heads``, [rows, tokens, ...]: one
    head at a time along the pool's leading dimension (a gather through the transposed pool
    runs PyTorch's strided path, 10-50x slower)."""
    out = pool.new_empty(heads.stop - heads.start, pages.numel(), *pool.shape[2:])
    for i, h in enumerate(range(heads.start, heads.stop)):
        torch.index_select(pool[:, h], 0, pages, out=out[i])
    return out.view(rows, -1, pool.shape[-1])


def _chunks(heads: int, seqs: int, rows: int) -> list[tuple[slice, slice]]:
    """``(heads, sequences)`` slices of about ``rows`` rows each whose rows ``h * S + s`` are one
    contiguous range: whole heads when a chunk holds every sequence, else runs of one head."""
    if rows >= seqs:
        per = rows // seqs
        return [(slice(h, min(h + per, heads)), slice(0, seqs)) for h in range(0, heads, per)]
    return [(slice(h, h + 1), slice(s, min(s + rows, seqs))) for h in range(heads) for s in range(0, seqs, rows)]


def _attend_rows(q, keys, values, residual_k, residual_v, mask, grid, softcap) -> torch.Tensor:
    """Attention [r, nq, D] of queries ``q`` [r, nq, D] over gathered pool tokens ``keys``,
    ``values`` ([r, P, ...] tensors; None: none) then residual ``residual_k/v`` [r, rest, D];
    ``mask`` [r, 1, P + rest] True where not seen."""
    key_grid, value_grid = grid or (None, None)  # None: unquantized
    scores = q @ residual_k.float().transpose(-1, -2)  # [r, nq, rest]
    if keys is not None:
        scores = torch.cat([_key_scores(keys, key_grid, q), scores], dim=-1)
    scores *= q.shape[-1] ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores.masked_fill_(mask, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    pooled = scores.shape[-1] - residual_k.shape[-2]
    out = p[..., pooled:] @ residual_v.float()
    if values is not None:
        out += _value_sums(values, value_grid, p[..., :pooled])
    return out


def _invalid(lengths, firsts, stored, lo: int, hi: int, rest: int, B: int, device) -> torch.Tensor | None:
    """[S, (hi-lo)*B + rest] True where a sequence holds nothing its query sees (None: all valid):
    pool positions before its window or past its stored blocks, residual rows past its length."""
    pooled = (hi - lo) * B
    residual = [n - s * B for n, s in zip(lengths, stored)]
    if all(f <= lo * B for f in firsts) and all(s == hi for s in stored) and all(r == rest for r in residual):
        return None
    position = torch.arange(lo * B, lo * B + pooled, device=device)
    row = torch.arange(rest, device=device)
    masks = [torch.cat([(position < f) | (position >= s * B), (row >= r) | (row + s * B < f)])
             for f, s, r in zip(firsts, stored, residual)]
    return torch.stack(masks)


def _fields(data: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed codes [..., W] int32 as float32 [F, ..., D/F]: field ``f`` of every byte (the module
    docstring's field order, fields leading), each unsigned code unchanged (exact in float32).
    One scalar shift and mask per field into one int32 buffer, then one conversion: every op
    runs on contiguous tensors with scalar operands (a broadcast [F, 1] shift runs PyTorch's
    slow scalar loop: 5x the time)."""
    if bits == 8:
        return data.view(torch.uint8).float()[None]
    F, mask = 8 // bits, _field_mask(bits)
    ints = torch.empty((F, *data.shape), dtype=torch.int32, device=data.device)
    torch.bitwise_and(data, mask, out=ints[0])
    for f in range(1, F):
        torch.bitwise_right_shift(data, f * bits, out=ints[f]).bitwise_and_(mask)
    return ints.view(torch.uint8).float()


@functools.cache
def _field_mask(bits: int) -> int:
    """The int32 mask keeping one field per byte (0x0F0F0F0F for 4 bits)."""
    return int.from_bytes(bytes([(1 << bits) - 1] * 4), "little", signed=True)


def _by_field(x: torch.Tensor, fields: int) -> torch.Tensor:
    """Channels [..., D] as [F, ..., D/F] in field order: ``[f, ..., j]`` is channel ``j*F + f``."""
    return x.unflatten(-1, (-1, fields)).movedim(-1, 0)


@functools.cache
def _field_order(head_dim: int, fields: int, device: torch.device) -> torch.Tensor:
    """Each channel's column in field order (flattened ``[F, D/F]``)."""
    return torch.arange(head_dim, device=device).view(-1, fields).t().flatten().argsort()


def _key_scores(keys: QuantizedKV, grid, q: torch.Tensor) -> torch.Tensor:
    """Raw scores q.k [R, nq, T] over gathered keys ``keys`` ([R, T, ...] tensors) on ``grid``,
    ``q`` [R, nq, D]."""
    data, scale, zero = keys
    if grid is None:  # unquantized: the stored floats
        return q @ data.float().transpose(-1, -2)
    F = 8 // grid.bits
    codes = _fields(data, grid.bits)  # [F, R, T, D/F]
    scale, zero = scale.float(), zero.float().add_(1 << (grid.bits - 1))
    qf = _by_field(q, F)  # [F, R, nq, D/F]
    if grid.over_tokens:  # per channel over groups of G tokens: scale, zero [R, T/G, D]
        qs = qf.unsqueeze(-3) * _by_field(scale, F).unsqueeze(-2)  # [F, R, T/G, nq, D/F]
        raw = (qs @ codes.unflatten(-2, (-1, grid.group)).transpose(-1, -2)).sum(0)  # [R, T/G, nq, G]
        bias = q @ zero.mul_(scale).transpose(-1, -2)  # [R, nq, T/G]
        return raw.transpose(-3, -2).sub_(bias.unsqueeze(-1)).flatten(-2)
    raw = (qf @ codes.transpose(-1, -2)).sum(0)  # per token: scale, zero [R, T, 1]
    return raw.sub_(q.sum(-1, keepdim=True) * zero.transpose(-1, -2)).mul_(scale.transpose(-1, -2))


def _value_sums(values: QuantizedKV, grid, p: torch.Tensor) -> torch.Tensor:
    """``p @ v`` [R, nq, D] for softmax weights ``p`` [R, nq, T] over gathered values ``values``
    ([R, T, ...] tensors; scale and zero [R, T, groups]) on ``grid``."""
    data, scale, zero = values
    if grid is None:
        return p @ data.float()
    F, groups = 8 // grid.bits, scale.shape[-1]
    codes = _fields(data, grid.bits)  # [F, R, T, D/F]
    D = codes.shape[-1] * F
    column = _field_order(D, F, codes.device)
    scale, zero = scale.float(), zero.float().add_(1 << (grid.bits - 1))
    if groups == 1:  # the scales fold into p
        ps = p * scale.transpose(-1, -2)  # [R, nq, T]
        sums = ps @ codes  # [F, R, nq, D/F]
        return sums.movedim(0, -2).flatten(-2).index_select(-1, column).sub_(ps @ zero)  # - [R, nq, 1]
    # byte j of a token holds channels j*F .. j*F+F-1, all in channel group (j*F) // G
    codes.view(*codes.shape[:-1], groups, -1).mul_(scale.unsqueeze(-1))
    zero_sums = p @ zero.mul_(scale)  # [R, nq, groups]
    sums = (p @ codes).movedim(0, -2).flatten(-2).index_select(-1, column)
    return sums.sub_(zero_sums.repeat_interleave(D // groups, dim=-1))
