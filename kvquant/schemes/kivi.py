"""KIVI INT4 and INT2 (arXiv 2402.02750): keys per channel over groups of tokens, values per
token over groups of channels.

Keys are quantized per channel at low bit widths because a few key channels carry large,
persistent offsets: a per-token group would spend its whole range on them. Values have no
such channels and are grouped per token. A key group needs its ``group_size`` tokens before it
can be quantized, so ``residual`` (the block) holds whole groups.
"""

from __future__ import annotations

from kvquant.schemes.base import KERNELS
from kvquant.schemes.integer import IntegerFamily, IntGrid

BITS = (4, 2)
# Fraction of each group's min..max range the grid spans (shrunk about its centre), keys and values.
# INT2 values: four levels cannot afford to put two of them on a token's extremes; a grid 0.9 as
# wide rounds the bulk finer and clips only the largest values. Keys keep their whole range:
# clipping an outlier key channel distorts every attention score it feeds. Chosen on the
# calibration text (the five non-evaluation Austen novels), not on Persuasion, by bench/kv_range.py
# (bench/results/kv-range-ratio-cpu.json: +27.4% -> +23.9% there).
RANGE_RATIO = {2: (1.0, 0.9)}


def key_grid(bits: int, group_size: int) -> IntGrid:
    """KIVI's keys: one scale and zero per channel and group of ``group_size`` tokens."""
    return IntGrid(bits, group_size, over_tokens=True, range_ratio=RANGE_RATIO.get(bits, (1.0, 1.0))[0])


def value_grid(bits: int, group_size: int) -> IntGrid:
    """KIVI's values: one scale and zero per token and group of ``group_size`` channels."""
    return IntGrid(bits, group_size, range_ratio=RANGE_RATIO.get(bits, (1.0, 1.0))[1])


class Kivi(IntegerFamily):
    name = "kivi"
    summary = "INT4/INT2, keys per channel over groups of G tokens, values per token over groups of G channels (KIVI)"
    pattern = r"int(?P<bits>[42])"
    listed = ("int4", "int2")
    order = 20
    grouped = True
    kernels = KERNELS

    def settings(self, match: dict) -> dict:
        return {"bits": int(match["bits"])}

    def claims(self, bits, type_, value_bits) -> bool:
        return bits == value_bits and bits in BITS and type_ == "int"

    def validate(self, scheme) -> None:
        if scheme.bits not in BITS or scheme.value_bits != scheme.bits or scheme.type != "int":
            raise ValueError(f"a KIVI KV cache stores keys and values at the same width, 4 or 2 bits (type int), got "
                             f"bits {scheme.bits}, value_bits {scheme.value_bits}, type {scheme.type!r}")
        super().validate(scheme)

    def base_name(self, scheme) -> str:
        return f"int{scheme.bits}"

    def grids(self, scheme):
        return key_grid(scheme.bits, scheme.group_size), value_grid(scheme.bits, scheme.group_size)

    def kernel_constants(self, scheme) -> dict:
        return dict(BITS=scheme.bits, FP8=False, KIVI=True, G=scheme.group_size)


FAMILY = Kivi()
