"""The paged KV cache with every row advancing together: ``decoder(ids, cache, position)``
(``runtime.attention.WholeCache``: evals, the speed bench, chunked prefill of a batch).

The layout is :mod:`runtime.cache`'s (its module docstring is the contract the kernels read);
this mode adds one length per layer:

* ``lengths[layer]``: positions written in that layer by every sequence of the batch (they
  advance together; ``seq_lens(layer)`` gives it as ``[S]`` int32).

Two calls serve attention: ``update(layer, start, k, v)`` writes new positions and returns
every key and value up to them (dequantized, the CPU reference path), and ``read(layer,
length)``. Writers that store the tokens themselves (the kernels:
``runtime.kernels.kv_reference.cache_attention``) call ``prepare_write`` (checks, pages) and
``finish_write`` (the new length) around their write.
"""

from __future__ import annotations

import torch

from runtime.cache_paged import PagedCache


class LockstepCache(PagedCache):
    """Rows ``0 .. batch`` hold one batch of sequences, all at the same positions."""

    def __init__(self, *args, **kwargs):
        """As :class:`runtime.cache_paged.PagedCache`."""
        super().__init__(*args, **kwargs)
        self.lengths = [0] * self.num_layers  # per layer: every row advances together

    def check_new_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        expected = (self.batch, self.kv_heads, k.shape[2] if k.ndim == 4 else -1, self.head_dim)
        if not 0 <= layer < self.num_layers or k.ndim != 4 or tuple(k.shape) != expected or k.shape != v.shape:
            raise ValueError(
                f"this KV cache was built for {self.num_layers} layers of {self.kv_heads} KV heads x head_dim "
                f"{self.head_dim} (batch {self.batch}); got layer {layer} with keys {tuple(k.shape)} and values "
                f"{tuple(v.shape)}: a cache cannot be shared across models (or batches) of different shapes"
            )

    def prepare_write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """``update``'s checks and page allocation (rings kept) for every row, for writers that
        store the tokens themselves (the kernels); the end position. :meth:`finish_write` after."""
        self.check_new_kv(layer, k, v)
        if start != self.lengths[layer]:
            raise ValueError(
                f"layer {layer} of the KV cache holds {self.lengths[layer]} positions; new ones must follow them "
                f"(got start={start}); reset() starts over"
            )
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked to write up to {end}")
        g = self.slots.group_of(layer)
        if self.groups.windows[g] is None and start // self.block_size == end // self.block_size:
            return end  # no ring and no block filled: no page to give back or take (a decode step, mostly)
        earliest = min(self.lengths[i] for i in self.groups.layers[g])  # a group's pages serve all its layers
        self._apply(*self.slots.place(range(self.batch), [g], [earliest] * self.batch, end))
        return end

    def finish_write(self, layer: int, end: int) -> None:
        self.lengths[layer] = end

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store ``k, v`` [S, H, T, D] at positions ``start..start+T``; return keys and values of all
        positions up to there, [S, H, start+T, D], as attention reads them (``runtime.cache``'s
        module docstring)."""
        end = self.prepare_write(layer, start, k, v)
        keys, values = self._store_and_read(layer, range(self.batch), start, k, v)
        self.finish_write(layer, end)
        return keys, values

    def read(self, layer: int, length: int):
        """Keys and values [S, H, length, D] of the first ``length`` positions, dequantized (in a
        sliding layer, positions the next query cannot see read as 0)."""
        if length > self.lengths[layer]:
            raise ValueError(f"layer {layer} of the KV cache holds {self.lengths[layer]} positions, asked for {length}")
        w = self.window(layer)
        first = 0 if w is None else min(max(self.lengths[layer] - w + 1, 0), length)
        return self._read(layer, slice(None), length, self.lengths[layer] // self.block_size, first)

    def seq_lens(self, layer: int) -> torch.Tensor:
        return torch.full((self.batch,), self.lengths[layer], dtype=torch.int32, device=self.device)

    def reset(self) -> None:
        """Forget every position (the memory stays allocated)."""
        self.lengths = [0] * self.num_layers
        super().reset()
