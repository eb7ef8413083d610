"""Plain PyTorch references for attention over the paged quantized KV cache.

The Triton kernels in :mod:`runtime.kernels.attention` compute the same functions with the
same signatures; tests run both on fresh random data. Every quantize/dequantize here is
``kvquant``'s (the one implementation of the affine math); this module only walks the
layout of ``runtime/cache.py`` (its module docstring is the contract):

* pool ``QuantizedKV`` tensors ``[N, H, *per_block]``, a block table ``[S, max_blocks]``,
  residual blocks ``[S, H, B, D]`` holding each sequence's newest ``len % B`` positions;
* a sliding ``window`` (the layer's ring): a sequence of length ``n`` may hold no block wholly
  before position ``n - window + 1`` (table entry -1); reads give 0 there, and a write skips
  the blocks it fills that are out of the window when it ends;
* per-sequence lengths ``[S]`` (the serving engine batches sequences of different lengths;
  ``runtime.cache_lockstep.LockstepCache`` advances them together).

This module imports no Triton: on CPU it is the implementation.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from kvquant import KVScheme, QuantizedKV, dequantize_kv, quantize_kv


class PagedKV(NamedTuple):
    """One layer of a paged cache, as ``runtime/cache.py`` lays it out."""

    k: QuantizedKV  # pool of keys [N, H, ...]
    v: QuantizedKV  # pool of values [N, H, ...]
    residual_k: torch.Tensor  # [S, H, B, D] model dtype
    residual_v: torch.Tensor
    block_table: torch.Tensor  # [S, max_blocks] int32, -1 where unallocated
    scheme: KVScheme
    window: int | None = None  # the layer's ring: blocks wholly out of the window may be gone

    @classmethod
    def from_cache(cls, cache, layer: int, rows: slice = slice(None)) -> "PagedKV":
        """Layer ``layer`` of ``cache``, its sequences ``rows`` (views: nothing is copied)."""
        k, v = cache.pool.layer(layer)
        return cls(k, v, cache.residual_k[layer][rows], cache.residual_v[layer][rows], cache.table(layer, rows),
                   cache.scheme, cache.window(layer))

    def first_kept(self, length: int) -> int:
        """The first position a sequence of ``length`` still holds for sure (0 without a window)."""
        return 0 if self.window is None else max(length - self.window + 1, 0)

    @property
    def block_size(self) -> int:
        return self.scheme.block_size

    @property
    def head_dim(self) -> int:
        return self.residual_k.shape[-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.residual_k.dtype

    def pool(self, keys: bool) -> QuantizedKV:
        return self.k if keys else self.v

    def residual(self, keys: bool) -> torch.Tensor:
        return self.residual_k if keys else self.residual_v


def check_lengths(paged: PagedKV, seq_lens: torch.Tensor, what: str = "seq_lens") -> None:
    """Clear errors for lengths the layout cannot hold (host-side: costs a sync on the GPU)."""
    S, max_blocks = paged.block_table.shape
    if seq_lens.shape != (S,):
        raise ValueError(f"{what} must have one entry per sequence ({S}), got shape {tuple(seq_lens.shape)}")
    if len(seq_lens) and (int(seq_lens.min()) < 0 or int(seq_lens.max()) > max_blocks * paged.block_size):
        raise ValueError(f"{what} must lie in 0..{max_blocks * paged.block_size} (the block table's reach), "
                         f"got {seq_lens.tolist()}")


# ---------------------------------------------------------------------------------- reads


def read_sequence(paged: PagedKV, s: int, length: int, keys: bool, first: int = 0) -> torch.Tensor:
    """Keys or values ``[H, length - first, D]`` (positions ``first .. length``) of sequence ``s``,
    dequantized to the cache dtype; the blocks before ``first``'s are not read."""
    B = paged.block_size
    full, skip = length // B, min(first // B, length // B)
    parts = []
    if full > skip:
        ids = paged.block_table[s, skip:full].long()
        if bool((ids < 0).any()):
            raise ValueError(f"sequence {s} has {length} positions but blocks {ids.tolist()} are not all allocated")
        blocks = paged.pool(keys).map(lambda t: t[ids])  # [n, H, ...]
        x = dequantize_kv(blocks, paged.scheme, keys, paged.head_dim, paged.dtype)  # [n, H, B, D]
        parts.append(x.transpose(0, 1).flatten(1, 2))
    parts.append(paged.residual(keys)[s, :, : length - full * B])
    return torch.cat(parts, dim=1)[:, first - skip * B:]


def dequantize_cache(paged: PagedKV, seq_lens: torch.Tensor, length: int | None = None):
    """Keys and values ``[S, H, length, D]`` (default: the longest sequence) in the cache dtype:
    what transformers' quantized caches hand to attention. Positions past a sequence's length are 0,
    and in a sliding layer those before ``seq_lens[s] - window + 1`` (``PagedKV.first_kept``)."""
    check_lengths(paged, seq_lens)
    lens = seq_lens.tolist()
    length = max(lens, default=0) if length is None else length
    S, H, _, D = paged.residual_k.shape
    out = []
    for keys in (True, False):
        x = paged.residual_k.new_zeros(S, H, length, D)
        for s, n in enumerate(lens):
            first, n = min(paged.first_kept(n), length), min(n, length)
            x[s, :, first:n] = read_sequence(paged, s, n, keys, first)
        out.append(x)
    return out[0], out[1]


def check_query(q: torch.Tensor, paged: PagedKV) -> int:
    """Query heads per KV head, after checking ``q`` [S, Hq, D] against the cache."""
    S, H, _, D = paged.residual_k.shape
    if q.ndim != 3 or q.shape[0] != S or q.shape[2] != D or q.shape[1] % H:
        raise ValueError(f"decode attention takes queries [S={S}, Hq, D={D}] with Hq a multiple of the {H} KV "
                         f"heads (one new token per sequence), got {tuple(q.shape)}")
    return q.shape[1] // H


def decode_attention(q: torch.Tensor, paged: PagedKV, seq_lens: torch.Tensor, window: int | None = None,
                     scale: float | None = None, **_tuning) -> torch.Tensor:
    """Attention of one new query per sequence, ``q`` [S, Hq, D], over the first ``seq_lens[s]``
    cached positions of each sequence (the new token already written). A sliding ``window``
    keeps the newest ``window`` positions. Returns [S, Hq, D]; a sequence of length 0 gets zeros.
    Query head ``i`` reads KV head ``i // (Hq / H)``, as SDPA's ``enable_gqa``."""
    check_query(q, paged)
    check_lengths(paged, seq_lens)
    out = torch.zeros_like(q)
    for s, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        lo = max(n - window, 0) if window is not None else 0
        k = read_sequence(paged, s, n, True, lo)
        v = read_sequence(paged, s, n, False, lo)
        o = F.scaled_dot_product_attention(q[s, :, None].to(k.dtype), k, v, scale=scale, enable_gqa=True)
        out[s] = o[:, 0].to(q.dtype)
    return out


# --------------------------------------------------------------------------------- writes


def check_write(paged: PagedKV, starts: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    S, H, _, D = paged.residual_k.shape
    if k.ndim != 4 or k.shape != v.shape or (k.shape[0], k.shape[1], k.shape[3]) != (S, H, D):
        raise ValueError(f"new keys and values must both be [S={S}, H={H}, T, D={D}], got keys {tuple(k.shape)} "
                         f"and values {tuple(v.shape)}")
    check_lengths(paged, starts, "starts")
    check_lengths(paged, starts + k.shape[2], "starts + new tokens")


def write_kv(paged: PagedKV, starts: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new ``k, v`` [S, H, T, D] at positions ``starts[s] .. starts[s]+T`` of each sequence:
    the residual's rows and the new tokens fill blocks, each filled block is quantized
    (``kvquant.quantize_kv``) into the physical block the table names (the caller allocates it),
    and the remainder becomes the residual. In a sliding layer a filled block already out of the
    window when the write ends (``paged.window``) may have no page: it is skipped."""
    check_write(paged, starts, k, v)
    B = paged.block_size
    for s, start in enumerate(starts.tolist()):
        r = start % B
        for keys, new in ((True, k), (False, v)):
            residual = paged.residual(keys)
            pending = torch.cat([residual[s, :, :r], new[s].to(paged.dtype)], dim=1)  # [H, r+T, D]
            full = pending.shape[1] // B
            if full:
                ids = paged.block_table[s, start // B: start // B + full].long()
                kept = torch.arange(start // B, start // B + full) >= paged.first_kept(start + k.shape[2]) // B
                if bool((ids[kept.to(ids.device)] < 0).any()):
                    raise ValueError(f"sequence {s}: blocks {start // B}..{start // B + full - 1} fill but the "
                                     f"block table has no physical block for some of them ({ids.tolist()})")
                blocks = pending[:, : full * B].unflatten(1, (full, B)).transpose(0, 1)  # [n, H, B, D]
                placed = ids >= 0
                for dst, src in zip(paged.pool(keys), quantize_kv(blocks, paged.scheme, keys)):
                    if dst is not None:
                        dst[ids[placed]] = src[placed].to(dst.dtype)
            rest = pending.shape[1] - full * B
            residual[s, :, :rest] = pending[:, full * B:]


# ------------------------------------------------------------------- the cache's attention


class AttentionOps(NamedTuple):
    """The three operations attention over the cache needs: these references, or the kernels."""

    write_kv: Callable
    dequantize_cache: Callable
    decode_attention: Callable


REFERENCE_OPS = AttentionOps(write_kv, dequantize_cache, decode_attention)


def cache_attention(cache, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None = None, window: int | None = None,
                    ops: AttentionOps = REFERENCE_OPS) -> torch.Tensor:
    """Store ``k, v`` [S, H, T, D] in ``cache`` at ``start`` and return the attention of ``q``
    [S, Hq, T, D] (the GPU path of ``runtime.model.Attention``).

    * decode (T = 1): the new token is written first, then one query per sequence attends over
      the cache's blocks and residual: exactly what ``cache.update`` + SDPA computes;
    * prefill (T > 1): the new tokens are stored quantized while attention reads them fresh in
      the model dtype; positions before ``start`` (earlier chunks of a chunked prefill) are
      read back from the cache. ``mask`` is the model's [T, start+T] causal (and window) mask.

    As with ``cache.update`` + SDPA (the CPU path), a prefill chunk's own tokens are not seen
    through the quantizer: prefill is compute-bound, and the fresh values are the better ones.
    """
    end = cache.prepare_write(layer, start, k, v)
    starts = torch.full((k.shape[0],), start, dtype=torch.int32, device=k.device)
    out = paged_attention(PagedKV.from_cache(cache, layer), starts, q, k, v, mask, window, ops, max_seq_len=end,
                          start=start)
    cache.finish_write(layer, end)
    return out


def paged_attention(paged: PagedKV, starts: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None = None, window: int | None = None, ops: AttentionOps = REFERENCE_OPS,
                    max_seq_len: int | None = None, start: int | None = None,
                    lengths: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`cache_attention` on one layer's tensors, sequence ``s`` writing at ``starts[s]``
    (its blocks allocated by the caller). Decode (T = 1) takes a different start per sequence;
    prefill (T > 1) one start for all (``start``, when the host knows it), and ``mask`` for it.
    ``max_seq_len`` bounds the lengths (None: the block table's reach; decode then needs no host
    sync, as CUDA graphs require). ``lengths``: ``starts + 1`` for decode when the caller has it
    (computed once per step instead of once per layer)."""
    T = k.shape[2]
    ops.write_kv(paged, starts, k, v)
    gqa = q.shape[1] != k.shape[1]
    if T == 1:
        lengths = starts + 1 if lengths is None else lengths
        return ops.decode_attention(q[:, :, 0], paged, lengths, window=window, max_seq_len=max_seq_len)[:, :, None]
    start = int(starts[0]) if start is None else start
    if start:  # chunked prefill: earlier chunks come back from the quantized cache
        old_k, old_v = ops.dequantize_cache(paged, starts, length=start)
        k = torch.cat([old_k, k.to(old_k.dtype)], dim=2)
        v = torch.cat([old_v, v.to(old_v.dtype)], dim=2)
    if start == 0 and (window is None or T <= window):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # the flash path
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def num_splits(lengths_bound: int, block_size: int, programs: int, target: int, max_splits: int = 64) -> int:
    """How many parts to split each sequence into (flash-decoding): enough programs to fill
    ``target`` slots, at least one block per part."""
    blocks = max(math.ceil(lengths_bound / block_size), 1)
    splits = max(1, min(math.ceil(target / max(programs, 1)), blocks, max_splits))
    per_split = math.ceil(blocks / splits)
    return math.ceil(blocks / per_split)
