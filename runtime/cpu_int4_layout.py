"""How ``aten._convert_weight_to_int4pack_for_cpu`` lays out the nibbles of a weight (it depends on the
CPU's vector width), found once per process on a probe, so :class:`runtime.cpu_linear.Int4Slots`
keeps only the kernel's copy of a layer and reads its codes back from it (checkpoint saving,
dequantizing, lowbit's own int4 matmul and dequantizer, which walk the same bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

@dataclass(frozen=True)
class Int4Layout:
    """How ``_convert_weight_to_int4pack_for_cpu`` orders nibbles (it depends on the CPU's vector
    width): outputs in blocks of ``block_n``, each block stored ``[K, block_n / 2]`` bytes; byte
    ``j`` of a full block holds outputs ``j`` (low nibble) and ``j + block_n / 2`` (high) when
    ``halves``, else ``2 j`` and ``2 j + 1`` (as every partial block does)."""

    block_n: int
    halves: bool

    def pairs(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = torch.arange(size // 2)
        if size == self.block_n and self.halves:
            return j, j + size // 2
        return 2 * j, 2 * j + 1

    def pack(self, u: torch.Tensor) -> torch.Tensor:
        """Nibbles ``u`` [N, K] (0..15) in this layout: uint8 [N, K / 2]."""
        n, k = u.shape
        out = []
        for start in range(0, n, self.block_n):
            block = u[start:start + self.block_n].to(torch.uint8)
            lo, hi = self.pairs(block.shape[0])
            out.append((block[lo] | (block[hi] << 4)).t().contiguous().flatten())  # [K, size / 2]
        return torch.cat(out).view(n, k // 2)

    def unpack(self, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """The nibbles uint8 [N, K] of ``packed`` (whole blocks at once, then the partial one)."""
        flat, full = packed.flatten(), n // self.block_n * self.block_n
        parts = []
        if full:
            parts.append(self._nibbles(flat[: full * k // 2].view(-1, k, self.block_n // 2), self.block_n))
        if full < n:
            parts.append(self._nibbles(flat[full * k // 2:].view(1, k, (n - full) // 2), n - full))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _nibbles(self, blocks: torch.Tensor, size: int) -> torch.Tensor:
        """Bytes [blocks, K, size / 2] to the nibbles [blocks * size, K] of their outputs."""
        lo, hi = blocks & 15, blocks >> 4
        if size == self.block_n and self.halves:
            u = torch.cat([lo, hi], dim=2)  # outputs j, then j + size / 2
        else:
            u = torch.stack([lo, hi], dim=3).flatten(2)  # outputs 2 j, 2 j + 1
        return u.transpose(1, 2).reshape(-1, blocks.shape[1])


@lru_cache(maxsize=1)
def int4_layout() -> Int4Layout | None:
    """The layout this process's int4 kernel uses, found on a probe that has full and partial blocks
    (None: an order lowbit does not know; layers then keep the checkpoint's codes beside it)."""
    probe = torch.randint(0, 16, (64 + 48, 8), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    for layout in (Int4Layout(64, True), Int4Layout(32, True), Int4Layout(32, False), Int4Layout(64, False)):
        if torch.equal(layout.pack(probe), packed):
            return layout
    return None


def unpack_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The nibbles uint8 [N, K] of a ``_convert_weight_to_int4pack_for_cpu`` result."""
    layout = int4_layout()
    if layout is None:
        raise RuntimeError("the CPU int4 kernel packs weights in an order lowbit does not know (torch "
                           f"{torch.__version__}, {torch.backends.cpu.get_cpu_capability()}): the codes cannot be read back")
    return layout.unpack(packed, n, k)
