"""Keys and values at different widths: ``k8v4``, ``k8v2``, ``k4v2`` (any two of 8, 4, 2 bits).

Keys need more bits than values: a key's rounding error moves every attention score it
takes part in (through the softmax), a value's only its share of one output. Each side uses
its width's grid from the uniform families: 8 bits per token over the whole head (as
``int8``), 4 or 2 bits KIVI's (keys per channel over groups of G tokens, values per token
over groups of G channels, INT2 values on a grid 0.9 as wide). No Triton kernel takes two
widths yet: on CUDA these caches run attention on the PyTorch reference path.
"""

from __future__ import annotations

from kvquant.schemes import int8, kivi
from kvquant.schemes.integer import IntegerFamily, IntGrid

WIDTHS = (8, 4, 2)


def _grid(bits: int, group_size: int, keys: bool) -> IntGrid:
    if bits == 8:
        return int8.PER_TOKEN
    return kivi.key_grid(bits, group_size) if keys else kivi.value_grid(bits, group_size)


class KVSplit(IntegerFamily):
    name = "kv-split"
    summary = "keys at one width, values at another (8, 4 or 2 bits each; no Triton kernel yet)"
    pattern = r"k(?P<key_bits>[842])v(?P<value_bits>[842])"
    listed = ("k8v4", "k4v2")
    order = 40
    grouped = True

    def settings(self, match: dict) -> dict:
        return {"bits": int(match["key_bits"]), "value_bits": int(match["value_bits"])}

    def claims(self, bits, type_, value_bits) -> bool:
        return bits != value_bits and type_ == "int" and bits in WIDTHS and value_bits in WIDTHS

    def validate(self, scheme) -> None:
        k, v = scheme.bits, scheme.value_bits
        if k not in WIDTHS or v not in WIDTHS or k == v or scheme.type != "int":
            raise ValueError(f"a kv-split KV cache stores keys and values at two different widths out of "
                             f"{', '.join(map(str, WIDTHS))} bits (type int), got keys {k}, values {v}, type "
                             f"{scheme.type!r}" + ("; one width for both is int8, int4 or int2" if k == v else ""))
        super().validate(scheme)

    def base_name(self, scheme) -> str:
        return f"k{scheme.bits}v{scheme.value_bits}"

    def grids(self, scheme):
        return _grid(scheme.bits, scheme.group_size, True), _grid(scheme.value_bits, scheme.group_size, False)


FAMILY = KVSplit()
