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

Codes are cut from whole int32 words (every field ``f`` of every byte with one shift and one
mask) and kept in that field order: column ``f*(D/F) + j`` is channel ``j*F + f`` (``F = 8 /
bits``), so the query (keys) and the output (values) are permuted instead, ``D`` numbers per
query row. Nothing the size of the history is written but the float codes; no copy of the cache
is kept between steps.

Everything is float32 (the stored float16 scales widened), so results equal the reference's to
float32 rounding (summation order differs; tests/test_cpu_attention.py). Which schemes take this
path: :func:`grids` (integer families: int8, kivi, kv-split); FP8 and the unquantized cache keep
the reference.
"""

from __future__ import annotations

import functools

import torch

from kvquant import KVScheme, QuantizedKV


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


def decode_attention(paged, q: torch.Tensor, lengths: list[int], window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over everything the cache holds for it.

    ``paged``: ``runtime.kernels.kv_reference.PagedKV`` of one layer and the batch's rows (the new
    token already stored: :meth:`runtime.cache.PagedCache.store`); ``q`` [S, Hq, 1, D];
    ``lengths[i]``: positions sequence ``i`` holds, the new one included; ``window``: the layer's
    sliding window (positions before ``length - window`` are not read; a ring may have dropped
    them). ``softcap``: scores through ``softcap * tanh(s / softcap)`` (Gemma 2). [S, Hq, 1, D]
    in ``q``'s dtype."""
    S, Hq, _, D = q.shape
    H, B = paged.residual_k.shape[1], paged.block_size
    # [H, S, nq, D]: query head h * nq + i reads KV head h (as SDPA's GQA); heads lead, so each
    # head's gathered tokens are one contiguous run
    qf = q.float().view(S, H, Hq // H, D).transpose(0, 1)
    firsts = [0 if window is None else max(n - window, 0) for n in lengths]
    stored = [n // B for n in lengths]
    lo, hi = min(f // B for f in firsts), max(stored)
    rest = max(n - s * B for n, s in zip(lengths, stored))  # residual positions read (the longest)
    pooled = (hi - lo) * B
    key_grid, value_grid = grids(paged.scheme, D)
    if pooled:  # the rows' blocks lo..hi, [H, S, (hi-lo) * B, ...]; -1 (ring, shorter row): page 0, masked
        pages = paged.block_table[:, lo:hi].clamp_min(0).flatten()
        gather = lambda t: t.transpose(0, 1).index_select(1, pages).view(H, S, -1, t.shape[-1])  # noqa: E731

    scores = qf @ paged.residual_k[:, :, :rest].float().transpose(0, 1).transpose(-1, -2)  # [H, S, nq, rest]
    if pooled:
        scores = torch.cat([_key_scores(paged.k.map(gather), key_grid, qf), scores], dim=-1)
    scores *= D ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = _invalid(lengths, firsts, stored, lo, hi, rest, B, q.device)
    if mask is not None:
        scores.masked_fill_(mask[None, :, None], float("-inf"))
    p = torch.softmax(scores, dim=-1)

    out = p[..., pooled:] @ paged.residual_v[:, :, :rest].float().transpose(0, 1)  # [H, S, nq, D]
    if pooled:
        out += _value_sums(paged.v.map(gather), value_grid, p[..., :pooled])
    return out.transpose(0, 1).reshape(S, Hq, 1, D).to(q.dtype)


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
    """Packed codes [..., W] int32 as float32 [..., D] in field order (the module docstring), each
    unsigned code unchanged (exact in float32): int32 shifts and masks (PyTorch's uint8 shifts
    are slow), then one contiguous conversion."""
    if bits == 8:
        return data.view(torch.uint8).float()
    shifts, mask = _field_shifts(bits, data.device)
    fields = (data.unsqueeze(-2) >> shifts).bitwise_and_(mask)  # [..., F, W]: field f of every byte
    return fields.view(torch.uint8).float().flatten(-2)


@functools.cache
def _field_shifts(bits: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Shifts [F, 1] that bring field ``f`` of every byte of a word to the byte's low bits, and the
    mask keeping one field per byte (0x0F0F0F0F for 4 bits)."""
    mask = int.from_bytes(bytes([(1 << bits) - 1] * 4), "little", signed=True)
    return torch.arange(0, 8, bits, dtype=torch.int32, device=device)[:, None], mask


@functools.cache
def _field_order(head_dim: int, fields: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The channel at each column of :func:`_fields`' order, and each channel's column."""
    order = torch.arange(head_dim, device=device).view(-1, fields).t().flatten()
    return order, order.argsort()


def _key_scores(keys: QuantizedKV, grid, q: torch.Tensor) -> torch.Tensor:
    """Raw scores q.k [H, S, nq, T] over gathered keys ``keys`` ([H, S, T, ...] tensors) on
    ``grid``, ``q`` [H, S, nq, D]."""
    data, scale, zero = keys
    codes = _fields(data, grid.bits)  # [H, S, T, D], field order
    scale, zero = scale.float(), zero.float().add_(1 << (grid.bits - 1))
    if grid.over_tokens:  # per channel over groups of G tokens: scale, zero [H, S, T/G, D]
        order, _ = _field_order(q.shape[-1], 8 // grid.bits, q.device)
        qs = q.index_select(-1, order).unsqueeze(2) * scale.index_select(-1, order).unsqueeze(3)  # [H, S, T/G, nq, D]
        raw = qs @ codes.unflatten(2, (-1, grid.group)).transpose(-1, -2)  # [H, S, T/G, nq, G]: one product per group
        bias = q @ zero.mul_(scale).transpose(-1, -2)  # [H, S, nq, T/G]
        return raw.transpose(2, 3).sub_(bias.unsqueeze(-1)).flatten(-2)
    raw = q @ codes.transpose(-1, -2)  # per token: scale, zero [H, S, T, 1]
    return raw.sub_(q.sum(-1, keepdim=True) * zero.transpose(-1, -2)).mul_(scale.transpose(-1, -2))


def _value_sums(values: QuantizedKV, grid, p: torch.Tensor) -> torch.Tensor:
    """``p @ v`` [H, S, nq, D] for softmax weights ``p`` [H, S, nq, T] over gathered values
    ``values`` ([H, S, T, ...] tensors; scale and zero [H, S, T, groups]) on ``grid``."""
    data, scale, zero = values
    F, groups = 8 // grid.bits, scale.shape[-1]
    codes = _fields(data, grid.bits)  # [H, S, T, D], field order
    D = codes.shape[-1]
    _, column = _field_order(D, F, codes.device)
    scale, zero = scale.float(), zero.float().add_(1 << (grid.bits - 1))
    if groups == 1:  # the scales fold into p
        ps = p * scale.transpose(-1, -2)  # [H, S, nq, T]
        return (ps @ codes).index_select(-1, column).sub_(ps @ zero)  # [H, S, nq, D] - [H, S, nq, 1]
    # field order: column f*(D/F) + j is in channel group (j*F) // G, for every field f
    codes.view(*codes.shape[:3], F, groups, -1).mul_(scale[:, :, :, None, :, None])
    zero_sums = p @ zero.mul_(scale)  # [H, S, nq, groups]
    return (p @ codes).index_select(-1, column).sub_(zero_sums.repeat_interleave(D // groups, dim=-1))
