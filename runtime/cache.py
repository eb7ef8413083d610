"""The runtime's KV cache: preallocated, paged blocks of quantized keys and values.

Two calls serve attention: ``update(layer, start, k, v)`` writes new positions and
returns every key and value up to them (dequantized, the CPU reference path), and
``read(layer, length)``. A fused GPU decode-attention kernel reads the same tensors
directly; this docstring is the contract.

Layout
------
``B = scheme.residual`` tokens make a block. A block is the unit of paging and
also the key-quantization group along tokens (KIVI keys are quantized per
channel over ``group_size`` tokens; a block holds ``B / group_size`` such groups).
With ``H`` KV heads of ``D`` channels, ``N`` physical blocks, ``S`` sequences
(the batch) and ``L`` layers:

* ``pool[layer]["k"]`` and ``pool[layer]["v"]``: a :class:`kvquant.QuantizedKV`
  ``(data, scale, zero)`` of tensors shaped ``[N, H, *per_block]``, where
  ``per_block`` is ``kvquant.layout(scheme, D, dtype, keys)``:

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
* ``block_table``: ``[S, max_blocks]`` int32, shared by all layers; entry ``j`` of
  sequence ``s`` is the physical block holding its positions ``j*B .. j*B+B-1``,
  ``-1`` where none is allocated. Blocks are allocated when they fill. ``host_table`` is the
  host's copy: every allocation decision reads it (reading the device table would be a host
  sync), and the rows it changes go to the device in one copy (``take_blocks``).
* ``residual_k[layer]``, ``residual_v[layer]``: ``[S, H, B, D]`` in the model dtype:
  the newest ``length % B`` positions of each sequence (the partial block), never
  quantized. A block is quantized and moved into the pool when it fills.
* ``lengths[layer]``: positions written in that layer when all sequences of the batch
  advance together (``update``; ``seq_lens(layer)`` gives it as ``[S]`` int32).
* ``seq_lengths[s]``: positions held by sequence ``s`` when sequences are used one by one
  (the serving engine: ``add_sequence``, ``reserve``, ``write_sequence``, ``advance``,
  ``free_sequence``, ``swap_sequences``): each sequence has its own length and its own blocks, and the rows
  of the block table and residual are slots that sequences come and go from. The layout
  above does not change: a slot is a row.

So position ``p < (length // B) * B`` of sequence ``s`` is row ``p % B`` of
physical block ``block_table[s, p // B]``; a later position is row ``p % B`` of
the residual.

What attention reads (``update``'s return, the same rule as the GPU path in
``runtime/kernels/kv_reference.py``): the new tokens are written first, quantizing
any block that fills; positions before ``start`` then come back as the cache now
holds them. A decode step (one new token) reads itself from the cache too, so a
decode kernel that writes the token and attends over blocks + residual computes
exactly the reference. A prefill or chunk (several new tokens) reads its own
tokens fresh, as a flash-attention prefill does: prefill is compute-bound and the
fresh values are the better ones.
"""

from __future__ import annotations

import math

import torch

from kvquant import KVScheme, QuantizedKV, dequantize_blocks, layout, quantize_blocks
from kvquant.memory import residual_bytes
from kvquant.quantize import block_bytes
from runtime.units import parse_bytes


class KVCache:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, max_len: int, dtype, device,
                 scheme: KVScheme | None = None, num_blocks: int | None = None):
        """``max_len`` positions per sequence; ``num_blocks`` physical blocks shared by the
        sequences (default: enough for every sequence to reach ``max_len``)."""
        self.scheme = scheme or KVScheme()
        self.scheme.check_head_dim(head_dim)
        self.num_layers, self.batch, self.kv_heads, self.head_dim = num_layers, batch, kv_heads, head_dim
        self.max_len, self.dtype, self.device = max_len, dtype, torch.device(device)
        B = self.block_size = self.scheme.block_size
        max_blocks = math.ceil(max_len / B)
        self.num_blocks = batch * max_blocks if num_blocks is None else num_blocks
        # Allocated once: growing tensors (torch.cat per token) would copy the whole cache every step.
        self.pool = [{"k": self._alloc_pool(True), "v": self._alloc_pool(False)} for _ in range(num_layers)]
        residual = (batch, kv_heads, B, head_dim)
        self.residual_k = [torch.zeros(residual, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.residual_v = [torch.zeros(residual, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.block_table = torch.full((batch, max_blocks), -1, dtype=torch.int32, device=self.device)
        # The host's copy of the block table: allocation decisions read it, never the device's
        # (a read of the device table is a host sync); the device rows follow with one copy.
        self.host_table = [[-1] * max_blocks for _ in range(batch)]
        self.lengths = [0] * num_layers
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.seq_lengths = [0] * batch  # per sequence, when sequences are used one by one
        self._free_slots = list(range(batch - 1, -1, -1))

    def _alloc_pool(self, keys: bool) -> QuantizedKV:
        parts = layout(self.scheme, self.head_dim, self.dtype, keys)
        tensors = {name: torch.zeros((self.num_blocks, self.kv_heads, *shape), dtype=dt, device=self.device)
                   for name, (shape, dt) in parts.items()}
        return QuantizedKV(tensors["data"], tensors.get("scale"), tensors.get("zero"))

    # ------------------------------------------------------------------ writes

    def check_new_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        expected = (self.batch, self.kv_heads, k.shape[2] if k.ndim == 4 else -1, self.head_dim)
        if not 0 <= layer < self.num_layers or k.ndim != 4 or tuple(k.shape) != expected or k.shape != v.shape:
            raise ValueError(
                f"this KV cache was built for {self.num_layers} layers of {self.kv_heads} KV heads x head_dim "
                f"{self.head_dim} (batch {self.batch}); got layer {layer} with keys {tuple(k.shape)} and values "
                f"{tuple(v.shape)}: a cache cannot be shared across models (or batches) of different shapes"
            )

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store ``k, v`` [S, H, T, D] at positions ``start..start+T``; return keys and values of all
        positions up to there, [S, H, start+T, D], as attention reads them (module docstring)."""
        self.check_new_kv(layer, k, v)
        if start != self.lengths[layer]:
            raise ValueError(
                f"layer {layer} of the KV cache holds {self.lengths[layer]} positions; new ones must follow them "
                f"(got start={start}); reset() starts over"
            )
        keys, values = self._store_and_read(layer, slice(None), start, k, v)
        self.lengths[layer] = start + k.shape[2]
        return keys, values

    def _store_and_read(self, layer: int, rows: slice, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store ``k, v`` [rows, H, T, D] at ``start``; return what attention reads (the module
        docstring's rule): one new token reads itself back from the cache, several new tokens
        read themselves fresh after the earlier positions as stored."""
        end = self._store(layer, rows, start, k, v)
        stored = end // self.block_size
        if k.shape[2] == 1:
            return self._read(layer, rows, end, stored)
        old_k, old_v = self._read(layer, rows, start, stored)
        return torch.cat([old_k, k.to(self.dtype)], dim=2), torch.cat([old_v, v.to(self.dtype)], dim=2)

    def _store(self, layer: int, rows: slice, start: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Write ``k, v`` [rows, H, T, D] at ``start`` of the sequences in ``rows``; the end position."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked to write up to {end}")
        B, r = self.block_size, start % self.block_size
        residual_k, residual_v = self.residual_k[layer][rows], self.residual_v[layer][rows]  # views
        # The residual's tokens and the new ones, from the start of the current block.
        pending_k = torch.cat([residual_k[:, :, :r], k.to(self.dtype)], dim=2)
        pending_v = torch.cat([residual_v[:, :, :r], v.to(self.dtype)], dim=2)
        full = pending_k.shape[2] // B
        if full:
            ids = self._allocate(start // B, full, rows)  # [rows, full]
            self._write_blocks(layer, ids, pending_k[:, :, : full * B], pending_v[:, :, : full * B])
        rest = pending_k.shape[2] - full * B
        residual_k[:, :, :rest] = pending_k[:, :, full * B:]
        residual_v[:, :, :rest] = pending_v[:, :, full * B:]
        return end

    def _allocate(self, first: int, count: int, rows: slice = slice(None)) -> torch.Tensor:
        """Physical ids [rows, count] of logical blocks ``first .. first+count`` of every sequence in
        ``rows``, allocating the missing ones (the first layer to fill a block allocates it; the others find it)."""
        self.take_blocks(range(self.batch)[rows], first, count)
        return self.block_table[rows, first: first + count].long()

    def take_blocks(self, slots, first: int, count: int) -> bool:
        """Give ``slots`` physical blocks for logical blocks ``first .. first+count`` where they have
        none (decided on the host mirror; the changed device rows follow in one copy); whether any
        was taken. A RuntimeError, taking nothing, when the pool has too few free blocks."""
        missing = [(s, j) for s in slots for j in range(first, first + count) if self.host_table[s][j] < 0]
        if len(missing) > len(self._free):
            raise RuntimeError(
                f"the KV cache pool is full: {self.num_blocks} blocks of {self.block_size} tokens, "
                f"{len(missing)} more needed; build the cache with more num_blocks or fewer sequences"
            )
        for s, j in missing:
            self.host_table[s][j] = self._free.pop()
        changed = sorted({s for s, _ in missing})
        if changed:
            self._push_rows(changed)
        return bool(missing)

    def _push_rows(self, slots: list[int]) -> None:
        """Copy the host mirror's rows ``slots`` to the device block table: one host-to-device copy."""
        lo, hi = slots[0], slots[-1] + 1
        self.block_table[lo:hi].copy_(torch.tensor(self.host_table[lo:hi], dtype=torch.int32), non_blocking=True)

    def _write_blocks(self, layer: int, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize ``k, v`` [S, H, n*B, D] as n blocks per sequence into physical blocks ``ids`` [S, n]."""
        flat = ids.flatten()
        for name, x in (("k", k), ("v", v)):
            q = quantize_blocks(x, self.scheme, keys=name == "k")  # [S, n, H, ...]: one call for every block
            for dst, src in zip(self.pool[layer][name], q):
                if dst is not None:
                    dst[flat] = src.flatten(0, 1).to(dst.dtype)

    # ------------------------------------------------------------------- reads

    def read(self, layer: int, length: int):
        """Keys and values [S, H, length, D] of the first ``length`` positions, dequantized."""
        if length > self.lengths[layer]:
            raise ValueError(f"layer {layer} of the KV cache holds {self.lengths[layer]} positions, asked for {length}")
        return self._read(layer, slice(None), length, self.lengths[layer] // self.block_size)

    def _read(self, layer: int, rows: slice, length: int, stored: int):
        """Keys and values [rows, H, length, D] of the sequences in ``rows``, whose first ``stored``
        blocks are in the pool."""
        B = self.block_size
        from_pool = min(math.ceil(length / B), stored)
        ids = self.block_table[rows, :from_pool].long()  # [rows, n]
        out = []
        for name, residual in (("k", self.residual_k[layer][rows]), ("v", self.residual_v[layer][rows])):
            tail = residual[:, :, : max(length - from_pool * B, 0)]
            if not from_pool:
                out.append(tail)
                continue
            q = self.pool[layer][name].map(lambda t: t[ids])  # [rows, n, H, ...]
            x = dequantize_blocks(q, self.scheme, name == "k", self.head_dim, self.dtype)  # [rows, H, n*B, D]
            out.append(torch.cat([x, tail], dim=2)[:, :, :length])
        return out[0], out[1]

    def seq_lens(self, layer: int) -> torch.Tensor:
        return torch.full((self.batch,), self.lengths[layer], dtype=torch.int32, device=self.device)

    # ------------------------------------------------ sequences one by one (the serving engine)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def free_slot_ids(self) -> list[int]:
        return sorted(self._free_slots)

    def add_sequence(self, slot: int | None = None) -> int:
        """A free slot (row) for a new sequence of length 0: ``slot`` if given, else the lowest free one."""
        if not self._free_slots:
            raise RuntimeError(f"all {self.batch} sequence slots of the KV cache are in use; free_sequence() one first")
        if slot is None:
            slot = self._free_slots.pop()
        elif slot in self._free_slots:
            self._free_slots.remove(slot)
        else:
            raise ValueError(f"slot {slot} is in use or out of range (the cache has {self.batch} slots)")
        self.seq_lengths[slot] = 0
        return slot

    def blocks_needed(self, slot: int, end: int) -> int:
        """Pool blocks sequence ``slot`` still lacks to hold positions up to ``end`` (blocks fill at B tokens)."""
        return sum(1 for b in self.host_table[slot][: end // self.block_size] if b < 0)

    def reserve(self, slot: int, end: int) -> bool:
        """Allocate the blocks positions up to ``end`` of ``slot`` fill; False (allocating nothing)
        when the pool has too few free blocks. Writers that store tokens themselves (the GPU
        kernels) need their blocks allocated before they run."""
        self._check_slot(slot)
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions per sequence, asked for {end}")
        if self.blocks_needed(slot, end) > len(self._free):
            return False
        self.take_blocks([slot], 0, end // self.block_size)
        return True

    def write_sequence(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store ``k, v`` [H, T, D] of sequence ``slot`` at ``start`` (= its length: every layer
        writes at the same start until ``advance`` moves it); return the keys and values
        [H, start+T, D] attention reads, by the same rule as :meth:`update`."""
        self._check_slot(slot)
        if start != self.seq_lengths[slot]:
            raise ValueError(f"sequence {slot} of the KV cache holds {self.seq_lengths[slot]} positions; new ones "
                             f"must follow them (got start={start})")
        if not 0 <= layer < self.num_layers or k.ndim != 3 or k.shape != v.shape or (k.shape[0], k.shape[2]) != (
                self.kv_heads, self.head_dim):
            raise ValueError(f"a sequence's new keys and values are [H={self.kv_heads}, T, D={self.head_dim}] for one "
                             f"of {self.num_layers} layers; got layer {layer}, keys {tuple(k.shape)}, values "
                             f"{tuple(v.shape)}")
        keys, values = self._store_and_read(layer, slice(slot, slot + 1), start, k[None], v[None])
        return keys[0], values[0]

    def read_sequence(self, layer: int, slot: int, length: int):
        """Keys and values [H, length, D] of sequence ``slot``, dequantized; ``length`` is all it holds
        in this layer (its length, plus what this step wrote)."""
        self._check_slot(slot)
        k, v = self._read(layer, slice(slot, slot + 1), length, length // self.block_size)
        return k[0], v[0]

    def advance(self, slot: int, count: int) -> None:
        """Sequence ``slot`` now holds ``count`` more positions (every layer has written them)."""
        self._check_slot(slot)
        self.seq_lengths[slot] += count

    def free_sequence(self, slot: int) -> None:
        """Return the sequence's blocks to the pool and its slot to the free slots."""
        self._check_slot(slot)
        row = self.host_table[slot]
        self._free.extend(sorted((b for b in row if b >= 0), reverse=True))
        if any(b >= 0 for b in row):
            self.block_table[slot].fill_(-1)
        self.host_table[slot] = [-1] * len(row)
        self.seq_lengths[slot] = 0
        self._free_slots.append(slot)

    def swap_sequences(self, a: int, b: int) -> None:
        """Exchange the contents of slots ``a`` and ``b`` (block-table rows, residuals, lengths;
        either may be free). The pool blocks stay where they are. The engine keeps its decoding
        sequences in the first rows this way, so a batch of ``n`` is the views ``[:n]``."""
        if a == b:
            return
        for t in [self.block_table] + self.residual_k + self.residual_v:
            t[[a, b]] = t[[b, a]]
        self.host_table[a], self.host_table[b] = self.host_table[b], self.host_table[a]
        self.seq_lengths[a], self.seq_lengths[b] = self.seq_lengths[b], self.seq_lengths[a]
        free_a, free_b = a in self._free_slots, b in self._free_slots
        if free_a != free_b:
            self._free_slots[self._free_slots.index(a if free_a else b)] = b if free_a else a

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.batch or slot in self._free_slots:
            raise ValueError(f"slot {slot} holds no sequence (the cache has {self.batch} slots; add_sequence() first)")

    def slot_bytes(self) -> int:
        """Bytes one slot holds whatever its length: its residual block (keys and values, every
        layer) and its block-table row."""
        residual = sum(t[0].numel() * t.element_size() for t in self.residual_k + self.residual_v)
        return residual + self.block_table.shape[1] * self.block_table.element_size()

    def block_bytes(self) -> int:
        """Bytes of one pool block over all layers, keys and values (scales included)."""
        tensors = [t for layer in self.pool for q in layer.values() for t in q if t is not None]
        return sum(t[0].numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------- all

    def reset(self) -> None:
        """Forget every position (the memory stays allocated)."""
        self.lengths = [0] * self.num_layers
        self.block_table.fill_(-1)
        self.host_table = [[-1] * len(row) for row in self.host_table]
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self.seq_lengths = [0] * self.batch
        self._free_slots = list(range(self.batch - 1, -1, -1))

    def nbytes(self) -> int:
        """Bytes this cache holds: pool, residual blocks and block table."""
        tensors = [t for layer in self.pool for q in layer.values() for t in q if t is not None]
        tensors += self.residual_k + self.residual_v + [self.block_table]
        return sum(t.numel() * t.element_size() for t in tensors)


def cache_size(model, scheme: KVScheme, kv_memory, max_batch: int, max_len: int) -> tuple[int, int]:
    """``(budget, pool blocks)``: the slots' residual blocks come first, blocks take the rest.
    Default budget: every slot at ``max_len``, capped on CUDA at 80% of the free memory (activations
    and CUDA graphs need the rest)."""
    cfg = model.decoder.cfg
    per_block = cfg.num_layers * cfg.num_kv_heads * block_bytes(scheme, cfg.head_dim, model.dtype)
    per_slot = residual_bytes(scheme, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    if kv_memory is not None:
        budget = parse_bytes(kv_memory)
    else:
        budget = max_batch * (per_slot + -(-max_len // scheme.block_size) * per_block)
        if model.device.type == "cuda":
            budget = min(budget, int(0.8 * torch.cuda.mem_get_info(model.device)[0]))
    blocks = (budget - max_batch * per_slot) // per_block
    if blocks < 1:
        raise ValueError(
            f"a KV budget of {budget:,} bytes holds no cache block beside {max_batch} slots' residual blocks "
            f"({per_slot:,} bytes each, {scheme.name}); raise kv_memory or lower max_batch")
    return budget, int(blocks)
