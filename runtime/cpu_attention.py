"""Decode attention on CPU over the quantized cache's stored codes, scales folded (no dequantize).

The reference path (``PagedCache._read`` + SDPA) dequantizes every cached position of a layer
into a float buffer on every decode step: at long contexts that dominates the step, and an
INT4 cache cost twice the time of the unquantized one. Here a decode step (one new token per
sequence) reads the pool's integer codes, turns them into floats as they are (one conversion,
no scale or zero applied) and folds the scales where the math allows, as the CUDA kernel
does (``runtime/kernels/decode_folded.py``). With ``u`` the stored unsigned code and
``z' = zero + 2**(bits-1)`` (``x = (u - z') * s``):

* KIVI keys (scale and zero per channel ``c`` over a group of tokens):
  ``q.k_t = sum_c (q_c s_c) u_tc - sum_c q_c s_c z'_c``: the scales go into the query, once per
  group (a few hundred multiplies), the zero points into one bias per group;
* INT8 keys (per token ``t``): ``q.k_t = s_t (sum_c q_c u_tc - z'_t sum_c q_c)``;
* values (INT8: per token; KIVI: per token and group of channels):
  ``sum_t p_t s_t (u_tc - z'_t) = sum_t (p_t s_t) u_tc - sum_t p_t s_t z'_t``: the scales go
  into the softmax weights, the zero points into one sum per query row and channel group.

Packed codes are never re-laid in channel order: byte ``j`` of a token holds channels
``j*F .. j*F+F-1`` (``F = 8 / bits`` fields, the first in the low bits), so field ``f`` of
every byte is its own ``[tokens, D/F]`` operand, and the query (keys) or the output (values)
is split into / merged from the same fields, which costs ``D`` numbers per query row.

Everything is float32 (the scales as the cache stores them, widened), so results equal the
reference's to float32 rounding (summation order differs): tests/test_cpu_attention.py.
Which schemes take this path: :func:`folds`; FP8 and the unquantized cache keep the reference.
"""

from __future__ import annotations

import math

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

    def gather(pool: QuantizedKV) -> QuantizedKV:  # the rows' blocks lo..hi: [H, S, (hi-lo) * rows, ...]
        pages = paged.block_table[:, lo:hi].clamp_min(0).flatten()  # -1 (ring, shorter row): masked
        return pool.map(lambda t: t.transpose(0, 1).index_select(1, pages).view(H, S, -1, t.shape[-1]))

    residual_k = paged.residual_k[:, :, :rest].float().transpose(0, 1)  # [H, S, rest, D]
    scores = qf @ residual_k.transpose(-1, -2)  # [H, S, nq, rest]
    if pooled:
        scores = torch.cat([_key_scores(gather(paged.k), key_grid, qf), scores], dim=-1)
    scores *= D ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = _invalid(lengths, firsts, stored, lo, hi, rest, B, q.device)
    if mask is not None:
        scores.masked_fill_(mask[None, :, None], float("-inf"))
    p = torch.softmax(scores, dim=-1)

    out = p[..., pooled:] @ paged.residual_v[:, :, :rest].float().transpose(0, 1)  # [H, S, nq, D]
    if pooled:
        out += _value_sums(gather(paged.v), value_grid, p[..., :pooled])
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
    """Packed codes [..., W] int32 as float32 [..., D] in field order: column ``f*(D/F) + j`` is
    field ``f`` of byte ``j``, channel ``j*F + f`` (``F = 8 / bits``), its unsigned code unchanged
    (exact in float32). Fields are cut from whole words (the same mask in every byte): int32
    shifts, where PyTorch's uint8 shifts are slow."""
    if bits == 8:
        return data.view(torch.uint8).float()
    fields = 8 // bits
    mask = int.from_bytes(bytes([(1 << bits) - 1] * 4), "little", signed=True)  # e.g. 0x0F0F0F0F
    out = torch.empty((*data.shape[:-1], fields, data.shape[-1] * 4), dtype=torch.float32, device=data.device)
    for f in range(fields):
        out[..., f, :].copy_(((data >> (bits * f)) & mask).view(torch.uint8))
    return out.flatten(-2)


def _to_fields(x: torch.Tensor, fields: int) -> torch.Tensor:
    """``x`` [..., D] in channel order to :func:`_fields`' column order (contiguous)."""
    return x.unflatten(-1, (-1, fields)).transpose(-1, -2).flatten(-2)


def _from_fields(x: torch.Tensor, fields: int) -> torch.Tensor:
    """The inverse of :func:`_to_fields`."""
    return x.unflatten(-1, (fields, -1)).transpose(-1, -2).flatten(-2)


def _key_scores(keys: QuantizedKV, grid, q: torch.Tensor) -> torch.Tensor:
    """Raw scores q.k [H, S, nq, T] over gathered keys ``keys`` ([H, S, T, ...] tensors) on
    ``grid``, ``q`` [H, S, nq, D]."""
    data, scale, zero = keys
    F = 8 // grid.bits
    codes = _fields(data, grid.bits)  # [H, S, T, D], field order
    zero = zero.float() + (1 << (grid.bits - 1))
    if grid.over_tokens:  # per channel over groups of G tokens: scale, zero [H, S, T/G, D]
        scale = scale.float()
        codes.unflatten(2, (-1, grid.group)).mul_(_to_fields(scale, F)[:, :, :, None])  # in place
        raw = _to_fields(q, F) @ codes.transpose(-1, -2)  # [H, S, nq, T]
        bias = q @ (scale * zero).transpose(-1, -2)  # [H, S, nq, T/G]
        return (raw.unflatten(-1, (-1, grid.group)) - bias[..., None]).flatten(-2)
    raw = q @ codes.transpose(-1, -2)  # per token: scale, zero [H, S, T, 1]
    return (raw - q.sum(-1, keepdim=True) * zero.transpose(-1, -2)) * scale.float().transpose(-1, -2)


def _value_sums(values: QuantizedKV, grid, p: torch.Tensor) -> torch.Tensor:
    """``p @ v`` [H, S, nq, D] for softmax weights ``p`` [H, S, nq, T] over gathered values
    ``values`` ([H, S, T, ...] tensors; scale and zero [H, S, T, groups]) on ``grid``. One channel
    group per head (INT8, KIVI with ``group_size == head_dim``): the scales fold into ``p``; several: they
    scale the codes in place (a scale that changes along a dot's columns cannot fold into its rows)."""
    data, scale, zero = values
    F, groups = 8 // grid.bits, scale.shape[-1]
    codes = _fields(data, grid.bits)  # [H, S, T, D], field order
    scale, zero = scale.float(), zero.float() + (1 << (grid.bits - 1))
    if groups == 1:
        ps = p * scale.transpose(-1, -2)  # [H, S, nq, T]
        return _from_fields(ps @ codes, F) - ps @ zero  # [H, S, nq, D] - [H, S, nq, 1]
    D = codes.shape[-1]
    # field order: column f*(D/F) + j is in channel group (j*F) // G, for every field f
    codes.view(*codes.shape[:3], F, groups, -1).mul_(scale[:, :, :, None, :, None])
    zero_sums = p @ (scale * zero)  # [H, S, nq, groups]
    return _from_fields(p @ codes, F) - zero_sums.repeat_interleave(D // groups, dim=-1)
