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
  ``-1`` where none is allocated. Blocks are allocated when they fill.
* ``residual_k[layer]``, ``residual_v[layer]``: ``[S, H, B, D]`` in the model dtype:
  the newest ``length % B`` positions of each sequence (the partial block), never
  quantized. A block is quantized and moved into the pool when it fills.
* ``lengths[layer]``: positions written in that layer (the CPU path advances all
  sequences of the batch together; ``seq_lens(layer)`` gives it as ``[S]`` int32).

So position ``p < (length // B) * B`` of sequence ``s`` is row ``p % B`` of
physical block ``block_table[s, p // B]``; a later position is row ``p % B`` of
the residual.

Attention reads what the cache holds: ``update`` writes first (quantizing any
block that fills) and then reads, so a decode kernel that writes the new token
and then attends over blocks + residual computes exactly the reference.
"""

from __future__ import annotations

import math

import torch

from kvquant import KVScheme, QuantizedKV, dequantize_blocks, layout, quantize_blocks


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
        self.lengths = [0] * num_layers
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out low ids first

    def _alloc_pool(self, keys: bool) -> QuantizedKV:
        parts = layout(self.scheme, self.head_dim, self.dtype, keys)
        tensors = {name: torch.zeros((self.num_blocks, self.kv_heads, *shape), dtype=dt, device=self.device)
                   for name, (shape, dt) in parts.items()}
        return QuantizedKV(tensors["data"], tensors.get("scale"), tensors.get("zero"))

    # ------------------------------------------------------------------ writes

    def _check(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        expected = (self.batch, self.kv_heads, k.shape[2] if k.ndim == 4 else -1, self.head_dim)
        if not 0 <= layer < self.num_layers or k.ndim != 4 or tuple(k.shape) != expected or k.shape != v.shape:
            raise ValueError(
                f"this KV cache was built for {self.num_layers} layers of {self.kv_heads} KV heads x head_dim "
                f"{self.head_dim} (batch {self.batch}); got layer {layer} with keys {tuple(k.shape)} and values "
                f"{tuple(v.shape)}: a cache cannot be shared across models (or batches) of different shapes"
            )

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store ``k, v`` [S, H, T, D] at positions ``start..start+T``; return keys and values of all
        positions up to there, [S, H, start+T, D], as attention will read them."""
        self._check(layer, k, v)
        if start != self.lengths[layer]:
            raise ValueError(
                f"layer {layer} of the KV cache holds {self.lengths[layer]} positions; new ones must follow them "
                f"(got start={start}); reset() starts over"
            )
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked to write up to {end}")
        B, r = self.block_size, start % self.block_size
        # The residual's tokens and the new ones, from the start of the current block.
        pending_k = torch.cat([self.residual_k[layer][:, :, :r], k.to(self.dtype)], dim=2)
        pending_v = torch.cat([self.residual_v[layer][:, :, :r], v.to(self.dtype)], dim=2)
        full = pending_k.shape[2] // B
        if full:
            ids = self._allocate(start // B, full)  # [S, full]
            self._write_blocks(layer, ids, pending_k[:, :, : full * B], pending_v[:, :, : full * B])
        rest = pending_k.shape[2] - full * B
        self.residual_k[layer][:, :, :rest] = pending_k[:, :, full * B:]
        self.residual_v[layer][:, :, :rest] = pending_v[:, :, full * B:]
        self.lengths[layer] = end
        return self.read(layer, end)

    def _allocate(self, first: int, count: int) -> torch.Tensor:
        """Physical ids of logical blocks ``first .. first+count`` of every sequence, allocating the
        missing ones (the first layer to fill a block allocates it; the others find it)."""
        table = self.block_table[:, first: first + count]
        missing = int((table < 0).sum())
        if missing > len(self._free):
            raise RuntimeError(
                f"the KV cache pool is full: {self.num_blocks} blocks of {self.block_size} tokens, "
                f"{missing} more needed; build the cache with more num_blocks or fewer sequences"
            )
        for s, j in (table < 0).nonzero().tolist():
            table[s, j] = self._free.pop()
        return table.long()

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
        B = self.block_size
        stored = self.lengths[layer] // B  # full blocks in the pool
        from_pool = min(math.ceil(length / B), stored)
        ids = self.block_table[:, :from_pool].long()  # [S, n]
        out = []
        for name, residual in (("k", self.residual_k[layer]), ("v", self.residual_v[layer])):
            tail = residual[:, :, : max(length - from_pool * B, 0)]
            if not from_pool:
                out.append(tail)
                continue
            q = self.pool[layer][name].map(lambda t: t[ids])  # [S, n, H, ...]
            x = dequantize_blocks(q, self.scheme, name == "k", self.head_dim, self.dtype)  # [S, H, n*B, D]
            out.append(torch.cat([x, tail], dim=2)[:, :, :length])
        return out[0], out[1]

    def seq_lens(self, layer: int) -> torch.Tensor:
        return torch.full((self.batch,), self.lengths[layer], dtype=torch.int32, device=self.device)

    def reset(self) -> None:
        """Forget every position (the memory stays allocated)."""
        self.lengths = [0] * self.num_layers
        self.block_table.fill_(-1)
        self._free = list(range(self.num_blocks - 1, -1, -1))

    def nbytes(self) -> int:
        """Bytes this cache holds: pool, residual blocks and block table."""
        tensors = [t for layer in self.pool for q in layer.values() for t in q if t is not None]
        tensors += self.residual_k + self.residual_v + [self.block_table]
        return sum(t.numel() * t.element_size() for t in tensors)
