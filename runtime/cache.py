"""A preallocated KV cache: per layer, keys and values for ``max_len`` positions.

Kept minimal on purpose: the quantized, block-paged cache of the KV issue
replaces it behind the same two calls, ``update`` (write new positions, get
everything up to them back) and ``read``.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, max_len: int, dtype, device):
        # Allocated once: growing tensors (torch.cat per token) would copy the whole cache every step.
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store ``k, v`` [B, H, T, D] at positions ``start..start+T``; return everything up to there."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked to write up to {end}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.read(layer, end)

    def read(self, layer: int, length: int):
        """Keys and values [B, H, length, D] of the first ``length`` positions (views, no copy)."""
        return self.k[layer][:, :, :length], self.v[layer][:, :, :length]
