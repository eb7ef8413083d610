"""What both modes of the paged KV cache share (:class:`runtime.cache.KVCache`, rows as slots;
:class:`runtime.cache_lockstep.LockstepCache`, rows in lockstep): the pool and the slots of the
layout (``runtime.cache``'s module docstring, the contract the kernels read) composed, page
allocation with the sliding windows' rings, storing new keys and values (quantizing the blocks
they fill) and reading positions back dequantized (the CPU reference path).
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
        T = k.shape[2]
        end = start + T
        B, r = self.block_size, start % self.block_size
        residual_k, residual_v = self.slots.residual_k[layer], self.slots.residual_v[layer]
        if len(slots) != self.batch:  # some rows: views of theirs (every row: the tensors, no op)
            rows = slice(slots.start, slots.stop)
            residual_k, residual_v = residual_k[rows], residual_v[rows]
        if r + T < B:  # no block fills (a decode step, mostly): straight into the residual
            residual_k.narrow(2, r, T).copy_(k)
            residual_v.narrow(2, r, T).copy_(v)
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
