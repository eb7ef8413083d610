"""Bytes a whole sequence's KV cache takes, as the runtime's paged cache allocates it.

``bytes_per_token`` is the per-token rate of the quantized blocks; a sequence of up
to ``n * B`` tokens gets ``n`` pool blocks per layer (``runtime.cache.KVCache`` allocates
``ceil(max_len / B)`` per sequence) and one unquantized residual block of
``residual`` tokens (keys and values in the model dtype, every layer and KV head),
whatever its length.

Sliding-window layers (``windows[layer] = W``) keep a *ring*: the cache hands the blocks that
fall wholly out of the window back to the pool, so such a layer holds at most
``ring_blocks(W, B) = ceil(W / B)`` pool blocks per sequence once it is past its window,
whatever the sequence's length (:func:`held_blocks`; the runtime's decode holds exactly that).
Layers are grouped by window into pages of equal size (:func:`layer_groups`), so one free list
serves every layer type. The memory planner and the engine's budget size with these functions;
tests hold them to the bytes an allocated cache really has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from kvquant.quantize import block_bytes
from kvquant.scheme import KVScheme


def ring_blocks(window: int, block_size: int) -> int:
    """Pool blocks a layer of sliding ``window`` keeps per sequence once past its window: the
    blocks holding its newest ``window`` positions (the newest partial block is the residual)."""
    return -(-window // block_size)


def held_blocks(tokens: int, window: int | None, block_size: int) -> int:
    """Pool blocks one layer holds for a sequence of ``tokens`` positions: one per ``block_size``
    tokens begun (as the cache is sized), capped at the ring for a sliding layer."""
    blocks = -(-tokens // block_size)
    return blocks if window is None else min(blocks, ring_blocks(window, block_size))


@dataclass(frozen=True)
class LayerGroups:
    """The cache's layers in groups of equal size that share one block table each: every layer
    of a group has the same window (None: full attention). A *page* is one block of every layer
    of one group, so pages of all groups are the same size and come from one free list; layer
    ``i`` of each group stores its blocks in the pool tensor ``i`` (:meth:`position`)."""

    windows: tuple  # per group: None or the window
    layers: tuple  # per group: its layers, ascending

    @property
    def size(self) -> int:
        """Layers per group (per page)."""
        return len(self.layers[0])

    def group(self, layer: int) -> int:
        return next(g for g, members in enumerate(self.layers) if layer in members)

    def position(self, layer: int) -> int:
        return self.layers[self.group(layer)].index(layer)

    def pages(self, tokens: int, block_size: int) -> int:
        """Pages one sequence of ``tokens`` positions holds (rings counted)."""
        return sum(held_blocks(tokens, w, block_size) for w in self.windows)


def layer_groups(windows: Sequence, max_len: int | None = None) -> LayerGroups:
    """Group layers by window (``windows[layer]``: None or W); a window of at least ``max_len``
    never drops a position, so such layers count as full. The group size is the gcd of the
    layer counts per window: Gemma-3-style 52 local + 10 global layers make groups of 2."""
    if not windows:
        raise ValueError("a KV cache needs at least one layer")
    for w in windows:
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"a sliding window is a positive number of positions (or None), got {w!r}")
    effective = [None if w is None or (max_len is not None and w >= max_len) else w for w in windows]
    by_window: dict = {}
    for layer, w in enumerate(effective):
        by_window.setdefault(w, []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_window.values()))
    groups = [(w, tuple(layers[i:i + size])) for w, layers in by_window.items() for i in range(0, len(layers), size)]
    groups.sort(key=lambda g: g[1][0])
    return LayerGroups(tuple(w for w, _ in groups), tuple(layers for _, layers in groups))


def residual_bytes(scheme: KVScheme, num_layers: int, kv_heads: int, head_dim: int,
                   dtype: torch.dtype = torch.float16) -> int:
    """The fixed per-sequence cost: one block of ``residual`` tokens, keys and values, unquantized."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * kv_heads * 2 * scheme.residual * head_dim * itemsize


def _windows(num_layers: int, windows) -> tuple:
    if windows is None:
        return (None,) * num_layers
    if len(windows) != num_layers:
        raise ValueError(f"windows names {len(windows)} layers, the model has {num_layers}")
    return tuple(windows)


def sequence_bytes(scheme: KVScheme, num_layers: int, kv_heads: int, head_dim: int, tokens: int,
                   dtype: torch.dtype = torch.float16, windows=None) -> int:
    """KV bytes allocated for one sequence of up to ``tokens`` positions: its pool blocks (scales included;
    a sliding layer's capped at its ring) and its residual block (the block table, 4 bytes per block, is
    left out). ``windows``: per layer None or the sliding window (None: no layer slides)."""
    per_layer_block = kv_heads * block_bytes(scheme, head_dim, dtype)
    blocks = sum(held_blocks(tokens, w, scheme.block_size) for w in _windows(num_layers, windows))
    return blocks * per_layer_block + residual_bytes(scheme, num_layers, kv_heads, head_dim, dtype)


def max_tokens(scheme: KVScheme, num_layers: int, kv_heads: int, head_dim: int, budget: int,
               dtype: torch.dtype = torch.float16, windows=None, limit: int = 2**40) -> int:
    """The longest sequence (at most ``limit``) whose KV cache fits in ``budget`` bytes (0 if not even
    the residual fits). With every layer sliding, a sequence fits at any length once its rings do."""
    if budget < residual_bytes(scheme, num_layers, kv_heads, head_dim, dtype):
        return 0
    fits = lambda n: sequence_bytes(scheme, num_layers, kv_heads, head_dim, n, dtype, windows) <= budget  # noqa: E731
    B = scheme.block_size
    lo, hi = 0, -(-limit // B)  # whole blocks: the largest n (in blocks) that fits
    if fits(hi * B):
        return limit
    while lo < hi - 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * B) else (lo, mid)
    return lo * B


def stored_bytes(scheme: KVScheme, num_layers: int, kv_heads: int, head_dim: int, tokens: int,
                 dtype: torch.dtype = torch.float16) -> int:
    """Bytes that hold ``tokens`` positions of one sequence: its full blocks and the filled part of the
    residual. What attention reads per decode step, as opposed to what is allocated."""
    full_blocks, partial = divmod(tokens, scheme.block_size)
    per_block = num_layers * kv_heads * block_bytes(scheme, head_dim, dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return full_blocks * per_block + num_layers * kv_heads * 2 * partial * head_dim * itemsize
