"""The runtime's KV cache: preallocated, paged blocks of quantized keys and values.

One layout, two ways to fill it. :class:`KVCache` (here): each row is a slot that sequences
come and go from, each at its own length (the serving engine, ``Model.generate``);
:class:`runtime.cache_lockstep.LockstepCache`: every row advances together, one length per
layer (``decoder(ids, cache, position)``: evals, the speed bench). Both are a
:class:`PagedCache`, which stores and reads back (dequantized, the CPU reference path). A
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

import math

import torch

from kvquant import KVScheme, dequantize_blocks, quantize_blocks
from kvquant.memory import layer_groups, ring_blocks
from runtime.cache_parts import BlockPool, SequenceSlots
from runtime.cpu_attention import decodes


class PagedCache:
    """The pool and the slots of the layout above, and what both modes share: page allocation
    (rings kept), storing new keys and values, and reading positions back dequantized."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, max_len: int, dtype, device,
                 scheme: KVScheme | None = None, num_blocks: int | None = None, windows=None):
        """``max_len`` positions per sequence; ``num_blocks`` pages shared by the sequences (default:
        enough for every sequence to reach ``max_len``, rings counted); ``windows``: per layer None
        or its sliding window (None: no layer slides)."""
        self.scheme = scheme or KVScheme()
        self.scheme.check_head_dim(head_dim)
        self.num_layers, self.batch, self.kv_heads, self.head_dim = num_layers, batch, kv_heads, head_dim
        self.max_len, self.dtype, self.device = max_len, dtype, torch.device(device)
        windows = (None,) * num_layers if windows is None else tuple(windows)
        if len(windows) != num_layers:
            raise ValueError(f"windows names {len(windows)} layers, the cache has {num_layers}")
        self.groups = layer_groups(windows, max_len)
        B = self.block_size = self.scheme.block_size
        max_blocks = math.ceil(max_len / B)
        # default: every sequence at max_len; a sliding group's ring twice over, for a chunk written
        # after one (the first ring is read, the second written)
        per_sequence = sum(max_blocks if w is None else min(max_blocks, 2 * ring_blocks(w, B) + 2)
                           for w in self.groups.windows)
        self.num_blocks = batch * per_sequence if num_blocks is None else num_blocks
        self.pool = BlockPool(self.groups, self.num_blocks, kv_heads, head_dim, self.scheme, dtype, self.device)
        self.slots = SequenceSlots(self.groups, batch, max_blocks, kv_heads, head_dim, B, dtype, self.device)
        # Decode steps on the CPU reference path attend over the stored codes, scales folded
        # (runtime.cpu_attention; the unquantized cache's floats as stored), every row in one
        # call, where the scheme allows; False: read back, dequantized, and SDPA per sequence, as
        # a prefill does (and as the GPU reference does, which the Triton kernels are checked against).
        self.folded_decode = self.device.type == "cpu" and decodes(self.scheme, head_dim)

    # ----------------------------------------------------------- the layout's public names

    @property
    def block_table(self) -> torch.Tensor:
        return self.slots.block_table

    @property
    def host_table(self) -> list[list[int]]:
        return self.slots.host_table

    @property
    def residual_k(self) -> list[torch.Tensor]:
        return self.slots.residual_k

    @property
    def residual_v(self) -> list[torch.Tensor]:
        return self.slots.residual_v

    def window(self, layer: int) -> int | None:
        """The sliding window layer ``layer``'s ring keeps (None: every position)."""
        return self.groups.windows[self.slots.group_of(layer)]

    def table(self, layer: int, rows: slice = slice(None)) -> torch.Tensor:
        return self.slots.table(layer, rows)

    # ------------------------------------------------------------- pages: rings and allocation

    def _apply(self, release: list, take: list, tails: dict, strict: bool = True) -> bool:
        """Release, then take (all or, when the pool is short, none: a RuntimeError if ``strict``,
        else False); the changed rows go to the device in one copy."""
        self.pool.give(self.slots.entry(s, g, j) for s, g, j in release)
        for s, g, j in release:
            self.slots.set_entry(s, g, j, -1)
        for (s, g), tail in tails.items():
            self.slots.dropped[s][g] = max(self.slots.dropped[s][g], tail)
        ok = len(take) <= self.pool.free
        if ok:
            for s, g, j in take:
                self.slots.set_entry(s, g, j, self.pool.take())
        elif strict:
            raise RuntimeError(
                f"the KV cache pool is full: {self.num_blocks} blocks of {self.block_size} tokens, {len(take)} more "
                f"needed; build the cache with more num_blocks or fewer sequences")
        changed = {s for s, _, _ in release} | ({s for s, _, _ in take} if ok else set())
        if changed:
            self.slots.push(changed)
        return ok

    # ------------------------------------------------------------- stores and reads

    def _store_and_read(self, layer: int, slots: range, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store ``k, v`` [rows, H, T, D] at ``start`` (pages placed); return what attention reads
        (the module docstring's rule): one new token reads itself back from the cache, several
        new tokens read themselves fresh after the earlier positions as stored."""
        end = self.store(layer, slots, start, k, v)
        w = self.window(layer)
        first = 0 if w is None else max(start - w + 1, 0)  # nothing before it is seen (or kept)
        rows = slice(slots.start, slots.stop)
        if k.shape[2] == 1:
            return self._read(layer, rows, end, end // self.block_size, first)
        return self._read(layer, rows, start, end // self.block_size, first, new=(k, v))

    def store(self, layer: int, slots: range, start: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Write ``k, v`` [rows, H, T, D] at ``start`` of the sequences ``slots`` (their pages placed:
        ``reserve`` / ``prepare_write``), quantizing any block that fills; the end position."""
        end = start + k.shape[2]
        B, r = self.block_size, start % self.block_size
        rows = slice(slots.start, slots.stop)
        residual_k, residual_v = self.residual_k[layer][rows], self.residual_v[layer][rows]  # views
        if r + k.shape[2] < B:  # no block fills (a decode step, mostly): straight into the residual
            residual_k[:, :, r:r + k.shape[2]] = k
            residual_v[:, :, r:r + k.shape[2]] = v
            return end
        # The residual's tokens and the new ones, from the start of the current block.
        pending_k = torch.cat([residual_k[:, :, :r], k.to(self.dtype)], dim=2)
        pending_v = torch.cat([residual_v[:, :, :r], v.to(self.dtype)], dim=2)
        full = pending_k.shape[2] // B
        if full:
            self._write_blocks(layer, slots, start // B, pending_k[:, :, : full * B], pending_v[:, :, : full * B])
        rest = pending_k.shape[2] - full * B
        residual_k[:, :, :rest] = pending_k[:, :, full * B:]
        residual_v[:, :, :rest] = pending_v[:, :, full * B:]
        return end

    def _write_blocks(self, layer: int, slots: range, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize ``k, v`` [rows, H, n*B, D] as blocks ``first .. first+n`` of ``slots`` into the pages
        the host table names (a block out of the window when the write ends has none: skipped)."""
        g, n = self.slots.group_of(layer), k.shape[2] // self.block_size
        placed = [(i, j, self.slots.entry(s, g, first + j)) for i, s in enumerate(slots) for j in range(n)]
        placed = [p for p in placed if p[2] >= 0]
        if not placed:
            return
        rows, blocks, pages = (torch.tensor(c, device=self.device) for c in zip(*placed))
        for x, dst_kv, keys in ((k, self.pool.layer(layer)[0], True), (v, self.pool.layer(layer)[1], False)):
            q = quantize_blocks(x, self.scheme, keys=keys)  # [rows, n, H, ...]: one call for every block
            for dst, src in zip(dst_kv, q):
                if dst is not None:
                    dst[pages] = src[rows, blocks].to(dst.dtype)

    def _read(self, layer: int, rows: slice, length: int, stored: int, first: int = 0, new=None):
        """Keys and values [rows, H, length, D] of the sequences in ``rows``, whose first ``stored``
        blocks are in the pool; positions before ``first`` read as 0 (their blocks are not read).
        ``new``: keys and values [rows, H, T, D] that follow, read fresh: [rows, H, length + T, D].

        Each result is one buffer: the pool's blocks dequantized straight into it (block-major
        views), then the residual's positions and the new ones copied after them. It lives as long
        as attention reads it: the cache itself stays quantized."""
        B = self.block_size
        from_pool = min(math.ceil(length / B), stored)
        skip = min(first // B, from_pool)
        ids = self.table(layer, rows)[:, skip:from_pool].long()  # [rows, n]
        held = from_pool * B  # positions the pool's blocks give (the last may run past length)
        out = []
        for keys, residual, pool in ((True, self.residual_k[layer][rows], self.pool.layer(layer)[0]),
                                     (False, self.residual_v[layer][rows], self.pool.layer(layer)[1])):
            end = length + (0 if new is None else new[0].shape[2])
            x = residual.new_empty(*residual.shape[:2], max(end, held), self.head_dim)
            if from_pool > skip:
                q = pool.map(lambda t: t.index_select(0, ids.flatten()).unflatten(0, ids.shape))  # [rows, n, H, ...]
                dequantize_blocks(q, self.scheme, keys, self.head_dim, self.dtype, out=x[:, :, skip * B:held])
            if length > held:
                x[:, :, held:length] = residual[:, :, : length - held]
            if new is not None:
                x[:, :, length:end] = new[0 if keys else 1]
            if first:
                x[:, :, :first] = 0
            out.append(x[:, :, :end])
        return out[0], out[1]

    def block_bytes(self) -> int:
        """Bytes of one page: one block of keys and values (scales included) of every layer of a
        group (of every layer, when no layer slides)."""
        return self.pool.page_bytes()

    # ------------------------------------------------------------------- all

    def reset(self) -> None:
        """Forget every position (the memory stays allocated)."""
        self.block_table.fill_(-1)
        self.slots.reset()
        self.pool.reset()

    def nbytes(self) -> int:
        """Bytes this cache holds: pool, residual blocks and block table."""
        return self.pool.nbytes() + self.slots.nbytes()

    def pages_held(self) -> int:
        """Pages in use (the pool's size less its free pages)."""
        return self.num_blocks - self.pool.free


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

    def store_decode(self, layer: int, first: int, starts: list[int], k: torch.Tensor, v: torch.Tensor,
                     starts_tensor: torch.Tensor | None = None) -> None:
        """:meth:`store_sequence` of one new token for each sequence in rows ``first ..`` at ``starts``
        (``k, v`` [n, H, 1, D]; ``starts_tensor``: ``starts`` on the device, so no copy is made), as one
        write into the residual when all is in order, the layer does not slide and no sequence fills
        a block (nothing to place: the engine reserves a block before a step fills it)."""
        B, n, rows = self.block_size, len(starts), range(first, first + len(starts))
        if (not 0 <= layer < self.num_layers or self.window(layer) is not None or k.shape != v.shape
                or tuple(k.shape) != (n, self.kv_heads, 1, self.head_dim) or not 0 <= first <= self.batch - n
                or starts != self.seq_lengths[first:first + n] or max(starts) >= self.max_len
                or any(self.slots.is_free(slot) for slot in rows) or any((s + 1) % B == 0 for s in starts)):
            for i, start in enumerate(starts):  # each sequence's own checks (and errors) and pages
                self.store_sequence(layer, first + i, start, k[i], v[i])
            return
        at = (slice(first, first + n), slice(None), starts[0] % B)
        if any(s % B != starts[0] % B for s in starts):  # sequences at different places in their blocks
            on_device = torch.tensor(starts, device=self.device) if starts_tensor is None else starts_tensor
            at = (torch.arange(first, first + n, device=self.device), slice(None), on_device.long() % B)
        self.residual_k[layer][at] = k[:, :, 0]
        self.residual_v[layer][at] = v[:, :, 0]

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
