"""The two halves of the paged KV cache (``runtime.cache_paged.PagedCache`` composes them;
``runtime.cache``'s module docstring is the layout contract):

* :class:`BlockPool`: the physical blocks of quantized keys and values, one pool tensor per
  position in a layer group (the layers at position ``i`` of every group share tensor ``i``),
  and the free list of page ids, kept on the host;
* :class:`SequenceSlots`: the per-sequence rows: the block table (one column range per layer
  group) with its host mirror, the unquantized residual block of every layer, the lengths,
  which rows are free, and which blocks a write releases and takes (:meth:`SequenceSlots.place`:
  the sliding-window rings, decided on the host mirror).

Kernels and references read these through public attributes only (``PagedKV.from_cache``).
"""

from __future__ import annotations

import torch

from kvquant import KVScheme, QuantizedKV, layout
from kvquant.memory import LayerGroups


class BlockPool:
    """``num_blocks`` pages; page ``p`` is block ``p`` of every pool tensor, and belongs to one
    layer group at a time. ``layer(l)`` gives layer ``l``'s key and value tensors
    ``[N, H, *per_block]``. The free list lives on the host: allocation never reads the device."""

    def __init__(self, groups: LayerGroups, num_blocks: int, kv_heads: int, head_dim: int, scheme: KVScheme,
                 dtype: torch.dtype, device: torch.device):
        self.groups, self.num_blocks, self.kv_heads, self.head_dim = groups, num_blocks, kv_heads, head_dim
        self.scheme, self.dtype, self.device = scheme, dtype, device
        # Allocated once: growing tensors (torch.cat per token) would copy the whole cache every step.
        self.tensors = [(self._alloc(True), self._alloc(False)) for _ in range(groups.size)]
        layers = sum(len(members) for members in groups.layers)
        self._position = [groups.position(layer) for layer in range(layers)]
        self.reset()

    def _alloc(self, keys: bool) -> QuantizedKV:
        parts = layout(self.scheme, self.head_dim, self.dtype, keys)
        tensors = {name: torch.zeros((self.num_blocks, self.kv_heads, *shape), dtype=dt, device=self.device)
                   for name, (shape, dt) in parts.items()}
        return QuantizedKV(tensors["data"], tensors.get("scale"), tensors.get("zero"))

    def layer(self, layer: int) -> tuple[QuantizedKV, QuantizedKV]:
        """``(keys, values)`` pool tensors of ``layer``."""
        return self.tensors[self._position[layer]]

    def __getitem__(self, layer: int) -> dict:
        """``pool[layer]["k"]`` / ``["v"]``: the layout contract's spelling of :meth:`layer`."""
        k, v = self.layer(layer)
        return {"k": k, "v": v}

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return self._free.pop()

    def give(self, pages) -> None:
        self._free.extend(sorted(pages, reverse=True))

    def reset(self) -> None:
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out low ids first

    def page_bytes(self) -> int:
        """Bytes of one page: one block of keys and values (scales included) of every layer of a group."""
        return sum(t[0].numel() * t.element_size() for pair in self.tensors for q in pair for t in q if t is not None)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.tensors for q in pair for t in q if t is not None)


class SequenceSlots:
    """``batch`` rows. ``block_table`` ``[S, G * M]`` int32 on the device (``M`` logical blocks per
    group, ``G`` groups): entry ``g * M + j`` of row ``s`` is the page holding positions
    ``j*B .. j*B+B-1`` of sequence ``s`` in the layers of group ``g``, ``-1`` where none is held.
    ``host_table`` mirrors it; every allocation decision reads the mirror (a read of the device
    table is a host sync) and the changed rows follow in one copy (:meth:`push`)."""

    def __init__(self, groups: LayerGroups, batch: int, max_blocks: int, kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, device: torch.device):
        self.groups, self.batch, self.max_blocks, self.block_size = groups, batch, max_blocks, block_size
        width = len(groups.layers) * max_blocks
        layers = sum(len(members) for members in groups.layers)
        self.block_table = torch.full((batch, width), -1, dtype=torch.int32, device=device)
        residual = (batch, kv_heads, block_size, head_dim)
        self.residual_k = [torch.zeros(residual, dtype=dtype, device=device) for _ in range(layers)]
        self.residual_v = [torch.zeros(residual, dtype=dtype, device=device) for _ in range(layers)]
        self._group = [groups.group(layer) for layer in range(layers)]
        self.reset()

    def reset(self) -> None:
        self.host_table = [[-1] * self.block_table.shape[1] for _ in range(self.batch)]
        self.lengths = [0] * self.batch  # per sequence, when sequences are used one by one
        # per row and group: every block before this one has gone back to the pool (a ring's tail)
        self.dropped = [[0] * len(self.groups.layers) for _ in range(self.batch)]
        self._free = list(range(self.batch - 1, -1, -1))

    def group_of(self, layer: int) -> int:
        return self._group[layer]

    def table(self, layer: int, rows: slice = slice(None)) -> torch.Tensor:
        """Layer ``layer``'s block table ``[rows, M]`` (a view: its row stride is the whole row)."""
        g = self._group[layer]
        return self.block_table[rows, g * self.max_blocks:(g + 1) * self.max_blocks]

    def entry(self, slot: int, group: int, j: int) -> int:
        return self.host_table[slot][group * self.max_blocks + j]

    def set_entry(self, slot: int, group: int, j: int, page: int) -> None:
        self.host_table[slot][group * self.max_blocks + j] = page

    def push(self, slots) -> None:
        """Copy the host mirror's rows ``min(slots) .. max(slots)`` to the device: one host-to-device copy."""
        lo, hi = min(slots), max(slots) + 1
        self.block_table[lo:hi].copy_(torch.tensor(self.host_table[lo:hi], dtype=torch.int32), non_blocking=True)

    # ----------------------------------------------------------------------- rings

    def live_from(self, group: int, position: int) -> int:
        """First logical block of ``group`` a write from ``position`` on can read."""
        w = self.groups.windows[group]
        return 0 if w is None else max(position - w + 1, 0) // self.block_size

    def place(self, slots, groups, release_from, end: int) -> tuple[list, list, dict]:
        """``(entries to release, entries to take, the ring's new tail per (slot, group))`` for writes
        up to ``end`` whose earliest query is at ``release_from[slot]``; an entry is (slot, group, block)."""
        release, take, tails = [], [], {}
        for s in slots:
            for g in groups:
                live = tails[s, g] = self.live_from(g, release_from[s])
                release += [(s, g, j) for j in range(self.dropped[s][g], live) if self.entry(s, g, j) >= 0]
                # blocks before the write's own are held already (or out of the window)
                first = max(self.live_from(g, end), release_from[s] // self.block_size)
                take += [(s, g, j) for j in range(first, end // self.block_size) if self.entry(s, g, j) < 0]
        return release, take, tails

    # ----------------------------------------------------------------------- rows

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def free_ids(self) -> list[int]:
        return sorted(self._free)

    def is_free(self, slot: int) -> bool:
        return slot in self._free

    def take(self, slot: int | None) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.batch} sequence slots of the KV cache are in use; free_sequence() one first")
        if slot is None:
            slot = self._free.pop()
        elif slot in self._free:
            self._free.remove(slot)
        else:
            raise ValueError(f"slot {slot} is in use or out of range (the cache has {self.batch} slots)")
        self.lengths[slot] = 0
        return slot

    def clear(self, slot: int) -> list[int]:
        """Free row ``slot``; the pages it held (for the pool's free list)."""
        row = self.host_table[slot]
        pages = [b for b in row if b >= 0]
        if pages:
            self.block_table[slot].fill_(-1)
        self.host_table[slot] = [-1] * len(row)
        self.dropped[slot] = [0] * len(self.groups.layers)
        self.lengths[slot] = 0
        self._free.append(slot)
        return pages

    def swap(self, a: int, b: int) -> None:
        """Exchange rows ``a`` and ``b`` (table, residuals, lengths; either may be free)."""
        if a == b:
            return
        for t in [self.block_table] + self.residual_k + self.residual_v:
            t[[a, b]] = t[[b, a]]
        self.host_table[a], self.host_table[b] = self.host_table[b], self.host_table[a]
        self.lengths[a], self.lengths[b] = self.lengths[b], self.lengths[a]
        self.dropped[a], self.dropped[b] = self.dropped[b], self.dropped[a]
        free_a, free_b = a in self._free, b in self._free
        if free_a != free_b:
            self._free[self._free.index(a if free_a else b)] = b if free_a else a

    def slot_bytes(self) -> int:
        """Bytes one row holds whatever its length: its residual blocks (every layer) and its table row."""
        residual = sum(t[0].numel() * t.element_size() for t in self.residual_k + self.residual_v)
        return residual + self.block_table.shape[1] * self.block_table.element_size()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.residual_k + self.residual_v + [self.block_table])
