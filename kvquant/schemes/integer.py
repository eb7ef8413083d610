"""Integer grids: what the INT8, KIVI and K/V-split families share.

A family of integer schemes only says which :class:`IntGrid` its keys and its values use
(:meth:`IntegerFamily.grids`); storage, quantize/dequantize and the checks follow from the
grids. The math is ``quant.affine``'s (groups along the last dimension, so a grid whose
groups run over tokens quantizes the transpose) and the bit packing ``quant.packing``'s:

| grid | data | scale, zero |
|------|------|-------------|
| per token, whole head (``group=None``) | ``[T, D*bits/32]`` int32 | ``[T, 1]`` float16 each |
| per token, groups of G channels | ``[T, D*bits/32]`` int32 | ``[T, D/G]`` float16 each |
| per channel, groups of G tokens (``over_tokens``) | ``[T, D*bits/32]`` int32 | ``[T/G, D]`` float16 each |

Data is packed along ``D`` for every token (value ``i`` of a token in bits
``[i*bits, (i+1)*bits)`` of its little-endian words, stored unsigned as ``q + 2**(bits-1)``);
``x = (q - zero) * scale`` with ``q`` signed and ``zero`` a float (KIVI's min/max grid,
``quant.affine.choose_qparams(float_zero=True)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvquant.schemes.base import SCALE_DTYPE, KVFamily, Layout, QuantizedKV
from quant.affine import QuantScheme, choose_qparams, from_grid, quantize
from quant.packing import pack, packed_length, unpack


@dataclass(frozen=True)
class IntGrid:
    """One side's (keys' or values') integer grid."""

    bits: int
    group: int | None = None  # channels per group (per token) or tokens per group (over_tokens); None: whole head
    over_tokens: bool = False  # one scale per channel and group of ``group`` tokens (KIVI's keys)
    range_ratio: float = 1.0  # of each group's min..max range the grid spans, shrunk about its centre

    @property
    def affine(self) -> QuantScheme:
        return QuantScheme(bits=self.bits, group_size=self.group or -1)

    def groups(self, tokens: int, head_dim: int) -> tuple[int, int]:
        """Shape of the scales (and zeros) of ``tokens`` tokens."""
        if self.over_tokens:
            return tokens // self.group, head_dim
        return tokens, 1 if self.group is None else head_dim // self.group

    def quantize(self, x: torch.Tensor) -> QuantizedKV:
        if self.over_tokens:
            x = x.transpose(-1, -2)  # [..., D, T]: groups of G tokens along the last dim
        scale, zero = choose_qparams(x, self.affine, self.range_ratio, scale_dtype=SCALE_DTYPE, float_zero=True)
        q = quantize(x, scale, zero, self.affine)
        if self.over_tokens:
            q, scale, zero = q.transpose(-1, -2), scale.transpose(-1, -2), zero.transpose(-1, -2)
        d = q.shape[-1]
        data = pack(q.reshape(-1, d), self.bits).reshape(*q.shape[:-1], -1)
        return QuantizedKV(data, scale.contiguous(), zero.contiguous())

    def dequantize(self, qx: QuantizedKV, head_dim: int, out: torch.Tensor) -> torch.Tensor:
        data, scale, zero = qx
        q = unpack(data.reshape(-1, data.shape[-1]), self.bits, head_dim).reshape(*data.shape[:-1], head_dim)
        # Each scale and zero broadcast over its group, in the [..., T, D] layout itself: no transposes.
        if self.over_tokens:  # one per channel and group of G tokens: [..., T/G, D]
            split, expand = (-2, (-1, self.group)), -2
        else:  # one per token and group of channels: [..., T, D/g]
            split, expand = (-1, (-1, self.affine.group_len(head_dim))), -1
        from_grid(q.unflatten(*split), scale.unsqueeze(expand), zero.unsqueeze(expand), out=out.unflatten(*split))
        return out

    def layout(self, tokens: int, head_dim: int) -> Layout:
        groups = self.groups(tokens, head_dim)
        return {"data": ((tokens, packed_length(head_dim, self.bits)), torch.int32),
                "scale": (groups, SCALE_DTYPE), "zero": (groups, SCALE_DTYPE)}

    def check_residual(self, residual: int) -> None:
        if self.over_tokens and residual % self.group:
            raise ValueError(
                f"KV cache residual {residual} is not a multiple of group_size {self.group}: keys are "
                f"quantized per channel in groups of {self.group} tokens, and a block of {residual} "
                "tokens must hold whole groups"
            )

    def check_head_dim(self, head_dim: int, residual: int) -> None:
        if self.over_tokens or self.group is None or head_dim % self.group == 0:
            return
        fits = [g for g in range(min(self.group, head_dim), 0, -1) if head_dim % g == 0 and residual % g == 0]
        raise ValueError(
            f"KV cache group_size {self.group} does not divide head_dim {head_dim}: values are quantized per "
            f"token in groups of {self.group} channels of one head, and a group cannot reach into the next "
            f"head; use a group_size that divides {head_dim} (e.g. {fits[0]})"
        )


class IntegerFamily(KVFamily):
    """A family whose keys and values are integer grids: it declares :meth:`grids`."""

    def grids(self, scheme) -> tuple[IntGrid, IntGrid]:
        """(keys' grid, values' grid). *Required*."""
        raise NotImplementedError

    def grid(self, scheme, keys: bool) -> IntGrid:
        return self.grids(scheme)[0 if keys else 1]

    def validate(self, scheme) -> None:
        for grid in self.grids(scheme):
            grid.check_residual(scheme.residual)

    def check_head_dim(self, scheme, head_dim: int) -> None:
        for grid in self.grids(scheme):
            grid.check_head_dim(head_dim, scheme.residual)

    def range_ratio(self, scheme, keys: bool) -> float:
        return self.grid(scheme, keys).range_ratio

    def layout(self, scheme, head_dim, dtype, keys) -> Layout:
        return self.grid(scheme, keys).layout(scheme.block_size, head_dim)

    def quantize(self, x, scheme, keys) -> QuantizedKV:
        return self.grid(scheme, keys).quantize(x)

    def dequantize(self, qx, scheme, keys, head_dim, out) -> torch.Tensor:
        return self.grid(scheme, keys).dequantize(qx, head_dim, out)
