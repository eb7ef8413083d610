"""The runtime's KV cache: preallocated, paged blocks of quantized keys and values.

One layout, two ways to fill it. :class:`KVCache` (here): each row is a slot that sequences
come and go from, each at its own length (the serving engine, ``Model.generate``);
:class:`runtime.cache_lockstep.LockstepCache`: every row advances together, one length per
layer (``decoder(ids, cache, position)``: evals, the speed bench). Both are a
:class:`runtime.cache_paged.PagedCache`, which stores and reads back (dequantized, the CPU reference path). A
fused GPU decode-attention kernel reads the same tensors directly; this docstring is the
contract.

Layout
------
``B = scheme.residual`` tokens make a block. A block is the unit of paging and
also the key-quantization group along tokens (KIVI keys are quantized per
channel over ``group_size`` tokens; a block holds ``B / group_size`` such groups).
With ``H`` KV heads of ``D`` channels, ``N`` physical blocks, ``S`` sequences
(the batch) and ``L`` layers:

Layers are grouped (``kvquant.memory.layer_groups``): every layer of a group has the same
sliding window (None: full attention), all groups have the same number of layers, and a
*page* is one block of every layer of one group, so one free list serves all layer types.
A model without sliding layers (or whose windows cover ``max_len``) is one group of every
layer: a page is then a block over all layers, and the table below has one column range.

* ``pool[layer]["k"]`` and ``pool[layer]["v"]`` (``runtime.cache_parts.BlockPool``; the layers
  at one position of every group share these tensors, a page belonging to one group at a
  time): a :class:`kvquant.QuantizedKV` ``(data, scale, zero)`` of tensors shaped
  ``[N, H, *per_block]``, where ``per_block`` is ``kvquant.layout(scheme, D, dtype, keys)``:

  - fp16 (unquantized): data ``[N, H, B, D]`` in the model dtype; no scale/zero;
  - int8: data ``[N, H, B, D/4]`` int32; scale, zero ``[N, H, B, 1]`` float16
    (one per token and head, keys and values alike);
  - int4/int2 keys: data ``[N, H, B, D*bits/32]`` int32; scale, zero
    ``[N, H, B/G, D]`` float16 (one per channel and group of ``G`` tokens);
  - int4/int2 values: data as keys; scale, zero ``[N, H, B, D/G]`` float16
    (one per token and group of ``G`` channels);
  - fp8: data ``[N, H, B, D]`` float8_e4m3fn; scale ``[N, H, 1, 1]`` float32.

  Integer data is packed along ``D`` per token: value ``i`` of a token occupies
  bits ``[i*bits, (i+1)*bits)`` of the token's little-endian int32 words, stored
  unsigned (``q + 2**(bits-1)``); ``x = (q - zero) * scale`` with signed ``q``.
  Everything is contiguous, so the token rows of one head of one block are
  consecutive in memory.
* ``block_table`` (``runtime.cache_parts.SequenceSlots``): ``[S, G * max_blocks]`` int32;
  entry ``g * max_blocks + j`` of sequence ``s`` is the page holding its positions
  ``j*B .. j*B+B-1`` in the layers of group ``g``, ``-1`` where none is held;
  ``table(layer, rows)`` is layer ``layer``'s ``[rows, max_blocks]`` view (row stride: the
  whole row). Blocks are allocated when they fill. ``host_table`` is the host's copy: every
  allocation decision reads it (reading the device table would be a host sync), and the rows
  it changes go to the device in one copy.
* sliding layers keep a ring: a write from position ``start`` reads nothing before
  ``start - W + 1``, so the pages of group ``g`` (window ``W``) wholly before it go back to the
  pool when the sequence's next write is prepared (``reserve``, ``LockstepCache.update``), and a write does
  not take pages for blocks it fills that are already out of the window when it ends (their
  entries stay ``-1``; the writers skip them). A sliding layer so holds at most
  ``ceil(W / B)`` pages per sequence while decoding (``kvquant.memory.ring_blocks``), and the
  kernels need no change: they index blocks by logical position and never read before the
  window.
* ``residual_k[layer]``, ``residual_v[layer]``: ``[S, H, B, D]`` in the model dtype:
  the newest ``length % B`` positions of each sequence (the partial block), never
  quantized. A block is quantized and moved into the pool when it fills.
* ``seq_lengths[s]`` (:class:`KVCache`): positions held by sequence ``s`` when sequences are
  used one by one (the serving engine: ``add_sequence``, ``reserve``, ``write_sequence``,
  ``advance``, ``free_sequence``, ``swap_sequences``): each sequence has its own length and its
  own blocks, and the rows of the block table and residual are slots that sequences come and
  go from. The layout above does not change: a slot is a row. A
  :class:`~runtime.cache_lockstep.LockstepCache` keeps one length per layer instead (its
  module docstring).

So position ``p < (length // B) * B`` of sequence ``s`` is row ``p % B`` of
physical block ``table(layer)[s, p // B]``; a later position is row ``p % B`` of
the residual.

What attention reads (``write_sequence``'s and ``LockstepCache.update``'s return, the same
rule as the GPU path in ``runtime/kernels/kv_reference.py``): the new tokens are written first, quantizing
any block that fills; positions before ``start`` then come back as the cache now
holds them. A decode step (one new token) reads itself from the cache too, so a
decode kernel that writes the token and attends over blocks + residual computes
exactly the reference. A prefill or chunk (several new tokens) reads its own
tokens fresh, as a flash-attention prefill does: prefill is compute-bound and the
fresh values are the better ones. In a sliding layer, positions that no query of the
write can see (before ``start - W + 1``) come back as zeros: the ring may have dropped them,
and the window masks them.
"""

from __future__ import annotations

import torch

from kvquant.memory import ring_blocks
from runtime.cache_paged import PagedCache  # noqa: F401 (what both modes share; callers read it here too)


class KVCache(PagedCache):
    """Rows are slots: sequences come and go, each at its own length (module docstring)."""

    @property
    def seq_lengths(self) -> list[int]:
        return self.slots.lengths

    def pages_for(self, tokens: int, chunk: int | None = None) -> int:
        """Pages a sequence keeps once it holds ``tokens`` positions (its full blocks, a sliding group's
        capped at its ring); with ``chunk``, the most it holds while those are written in chunks of
        ``chunk`` (a sliding group keeps its ring before a chunk besides the chunk's blocks, and
        the ring at the end of a write reserved whole, as the engine reserves a prompt)."""
        B, full = self.block_size, tokens // self.block_size
        caps = [ring_blocks(w, B) + (0 if chunk is None else ring_blocks(w, B) + 2 + -(-chunk // B))
                for w in self.groups.windows if w is not None]
        return full * sum(w is None for w in self.groups.windows) + sum(min(full, cap) for cap in caps)

    def longest_sequence(self, chunk: int | None = None) -> int:
        """The most positions one sequence can reach with the whole pool to itself (at most ``max_len``;
        ``chunk``: its prompt prefilled in chunks of that many tokens, as :meth:`pages_for` counts)."""
        lo, hi = 0, self.max_len  # pages_for grows with tokens: the largest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.pages_for(mid, chunk) <= self.num_blocks else (lo, mid - 1)
        return lo

    @property
    def free_blocks(self) -> int:
        return self.pool.free

    @property
    def free_slots(self) -> int:
        return self.slots.free_count

    @property
    def free_slot_ids(self) -> list[int]:
        return self.slots.free_ids

    def add_sequence(self, slot: int | None = None) -> int:
        """A free slot (row) for a new sequence of length 0: ``slot`` if given, else the lowest free one."""
        return self.slots.take(slot)

    def reserve(self, slot: int, end: int) -> bool:
        """Release the pages of ``slot`` its next write (from its length on) cannot read, and take the
        ones positions up to ``end`` fill; False (taking nothing) when the pool has too few free
        pages. Writers that store tokens themselves (the GPU kernels) need their pages first."""
        self._check_slot(slot)
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions per sequence, asked for {end}")
        placed = self.slots.place([slot], range(len(self.groups.layers)), self.slots.lengths, end)
        return self._apply(*placed, strict=False)

    def write_sequence(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store ``k, v`` [H, T, D] of sequence ``slot`` at ``start`` (= its length: every layer
        writes at the same start until ``advance`` moves it); return the keys and values
        [H, start+T, D] attention reads (the module docstring's rule)."""
        self._place_sequence(layer, slot, start, k, v)
        keys, values = self._store_and_read(layer, range(slot, slot + 1), start, k[None], v[None])
        return keys[0], values[0]

    def store_sequence(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """:meth:`write_sequence` without the read: for attention that reads the cache itself
        (``runtime.cpu_attention``)."""
        self._place_sequence(layer, slot, start, k, v)
        self.store(layer, range(slot, slot + 1), start, k[None], v[None])

    def decode_writes(self, first: int, starts: list[int], starts_tensor: torch.Tensor | None = None):
        """Where :meth:`store_decode` writes one new token of each sequence in rows ``first ..`` at
        ``starts`` in every layer's residual (the index of ``residual_k[layer]``), or None when some
        sequence needs its own checks and pages: out of order, in a free slot, or filling a block
        (the engine reserves a block before a step fills it). The same for every layer of a step:
        a forward works it out once (``SequenceBatch``), not once per layer."""
        B, n = self.block_size, len(starts)
        if (not 0 <= first <= self.batch - n or starts != self.seq_lengths[first:first + n]
                or max(starts) >= self.max_len or any(self.slots.is_free(slot) for slot in range(first, first + n))
                or any((s + 1) % B == 0 for s in starts)):
            return None
        if all(s % B == starts[0] % B for s in starts):  # every sequence at one place in its block
            return slice(first, first + n), slice(None), slice(starts[0] % B, starts[0] % B + 1)
        on_device = torch.tensor(starts, device=self.device) if starts_tensor is None else starts_tensor
        return torch.arange(first, first + n, device=self.device), slice(None), on_device.long() % B

    def store_decode(self, layer: int, first: int, starts: list[int], k: torch.Tensor, v: torch.Tensor,
                     starts_tensor: torch.Tensor | None = None, at=...) -> None:
        """:meth:`store_sequence` of one new token for each sequence in rows ``first ..`` at ``starts``
        (``k, v`` [n, H, 1, D]; ``starts_tensor``: ``starts`` on the device, so no copy is made), as one
        write into the residual where :meth:`decode_writes` (``at``: its answer, when the caller has
        it) finds all in order and the layer does not slide."""
        at = self.decode_writes(first, starts, starts_tensor) if at is ... else at
        if (at is None or not 0 <= layer < self.num_layers or self.window(layer) is not None or k.shape != v.shape
                or tuple(k.shape) != (len(starts), self.kv_heads, 1, self.head_dim)):
            for i, start in enumerate(starts):  # each sequence's own checks (and errors) and pages
                self.store_sequence(layer, first + i, start, k[i], v[i])
            return
        one_place = isinstance(at[2], slice)  # a slice keeps the token axis: k as it is, no select
        self.residual_k[layer][at] = k if one_place else k[:, :, 0]
        self.residual_v[layer][at] = v if one_place else v[:, :, 0]

    def _place_sequence(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A sequence write's checks, and its pages placed."""
        self._check_slot(slot)
        if start != self.seq_lengths[slot]:
            raise ValueError(f"sequence {slot} of the KV cache holds {self.seq_lengths[slot]} positions; new ones "
                             f"must follow them (got start={start})")
        if not 0 <= layer < self.num_layers or k.ndim != 3 or k.shape != v.shape or (k.shape[0], k.shape[2]) != (
                self.kv_heads, self.head_dim):
            raise ValueError(f"a sequence's new keys and values are [H={self.kv_heads}, T, D={self.head_dim}] for one "
                             f"of {self.num_layers} layers; got layer {layer}, keys {tuple(k.shape)}, values "
                             f"{tuple(v.shape)}")
        end = start + k.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked to write up to {end}")
        self._apply(*self.slots.place([slot], [self.slots.group_of(layer)], self.slots.lengths, end))

    def read_sequence(self, layer: int, slot: int, length: int):
        """Keys and values [H, length, D] of sequence ``slot``, dequantized; ``length`` is all it holds
        in this layer (its length, plus what this step wrote). In a sliding layer, positions before
        ``length - W + 1`` read as 0."""
        self._check_slot(slot)
        w = self.window(layer)
        first = 0 if w is None else max(length - w + 1, 0)
        k, v = self._read(layer, slice(slot, slot + 1), length, length // self.block_size, first)
        return k[0], v[0]

    def advance(self, slot: int, count: int) -> None:
        """Sequence ``slot`` now holds ``count`` more positions (every layer has written them)."""
        self._check_slot(slot)
        self.slots.lengths[slot] += count

    def free_sequence(self, slot: int) -> None:
        """Return the sequence's pages to the pool and its slot to the free slots."""
        self._check_slot(slot)
        self.pool.give(self.slots.clear(slot))

    def swap_sequences(self, a: int, b: int) -> None:
        """Exchange the contents of slots ``a`` and ``b`` (block-table rows, residuals, lengths;
        either may be free). The pages stay where they are. The engine keeps its decoding
        sequences in the first rows this way, so a batch of ``n`` is the views ``[:n]``."""
        self.slots.swap(a, b)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.batch or self.slots.is_free(slot):
            raise ValueError(f"slot {slot} holds no sequence (the cache has {self.batch} slots; add_sequence() first)")

    def slot_bytes(self) -> int:
        """Bytes one slot holds whatever its length: its residual block (keys and values, every
        layer) and its block-table row."""
        return self.slots.slot_bytes()


from runtime.cache_budget import cache_size  # noqa: E402,F401 (the engine's import; its home is cache_budget)
