"""KV-cache schemes: which family, how many bits, which groups, how many newest tokens stay unquantized.

A scheme is a family (:mod:`kvquant.schemes`, one file each: what keys and values become)
and its settings. The families today:

| name | family | keys | values |
|------|--------|------|--------|
| ``fp16`` | ``fp16`` | unquantized (the model's dtype) | unquantized |
| ``int8`` | ``int8`` | per token: one scale and zero per token and head | per token, the same |
| ``int4``, ``int2`` | ``kivi`` | per channel, groups of ``group_size`` tokens | per token, groups of ``group_size`` channels |
| ``fp8`` | ``fp8`` | float8 e4m3, one scale per head and block | the same |
| ``k8v4``, ``k4v2``, ... | ``kv-split`` | its width's grid (8: per token; 4/2: KIVI's) | its width's grid |

Every quantized scheme keeps the newest, partially filled block of ``residual``
tokens in the model's dtype and quantizes a block when it fills: a per-channel key
group needs its tokens before it can be quantized, and the newest tokens, which
attention weighs most, stay exact. ``residual`` is therefore also the block size of
the runtime's paged cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvquant import schemes
from kvquant.schemes.kivi import RANGE_RATIO  # noqa: F401 (its old home: bench/kv_range.py sweeps it here)

SUPPORTED_KV_BITS = (16, 8, 4, 2)  # 16 = unquantized


@dataclass(frozen=True)
class KVScheme:
    bits: int = 16  # keys' width; values' too unless value_bits differs
    type: str = "int"  # "int", or "float" for FP8 e4m3 (bits 8), as compressed-tensors names it
    group_size: int = 64  # grouped families: tokens per key group and channels per value group
    residual: int = 128  # tokens per block; the newest partial block stays unquantized
    value_bits: int | None = None  # None: as bits
    family: str | None = None  # a kvquant.schemes family; None: the one that claims bits/type/value_bits

    def __post_init__(self):
        for key in ("bits", "value_bits"):
            value = getattr(self, key)
            if key == "value_bits" and value is None:
                object.__setattr__(self, key, self.bits)
            elif isinstance(value, bool) or value not in SUPPORTED_KV_BITS:
                raise ValueError(f"KV cache {key} must be one of {', '.join(map(str, SUPPORTED_KV_BITS))} "
                                 f"(16 = unquantized), got {value!r}")
        if self.type not in ("int", "float"):
            raise ValueError(f"KV cache type must be 'int' or 'float', got {self.type!r}")
        for key in ("group_size", "residual"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KV cache {key} must be a positive integer, got {value!r}")
        if self.family is None:
            object.__setattr__(self, "family", schemes.claiming(self.bits, self.type, self.value_bits).name)
        schemes.get(self.family).validate(self)

    @property
    def definition(self):
        """The family's declaration (:class:`kvquant.schemes.base.KVFamily`): layout, math, kernels."""
        return schemes.get(self.family)

    @property
    def quantized(self) -> bool:
        return self.definition.quantized

    @property
    def key_bits(self) -> int:
        return self.bits

    # The families' own flags, kept for callers that test them; new code asks ``definition``.
    @property
    def fp8(self) -> bool:
        return self.family == "fp8"

    @property
    def kivi(self) -> bool:
        """Per-channel keys grouped over tokens, per-token values grouped over channels, one width."""
        return self.family == "kivi"

    def range_ratio(self, keys: bool) -> float:
        """How much of each group's min..max range the integer grid spans (1: all of it)."""
        return self.definition.range_ratio(self, keys)

    @property
    def block_size(self) -> int:
        return self.residual

    @property
    def name(self) -> str:
        return self.definition.name_of(self)

    def to_dict(self) -> dict:
        return asdict(self)

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError unless a model with heads of ``head_dim`` channels can take this scheme."""
        self.definition.check_head_dim(self, head_dim)


def parse_kv(spec: str, default: KVScheme | None = None) -> KVScheme:
    """A scheme from its name: ``fp16``, ``int8``, ``int4``, ``int2``, ``fp8``, ``k8v4``, ``k4v2`` ...
    (every family's pattern), optionally with ``-g<group_size>`` and ``-r<residual>``
    (``int4-g32-r128``). Unnamed settings come from ``default``."""
    found = schemes.match(spec)
    if found is None:
        raise ValueError(
            f"unknown KV cache scheme {spec!r}: use {schemes.names_text()}, optionally with -g<group_size> and "
            "-r<residual> (e.g. int4-g64-r128); the families: "
            + "; ".join(f"{f.name}: {f.summary}" for f in schemes.REGISTRY.values())
        )
    family, groups = found
    base = default or KVScheme()
    group = int(groups["g"]) if groups["g"] else base.group_size
    residual = int(groups["r"]) if groups["r"] else base.residual
    return KVScheme(**family.settings(groups), group_size=group, residual=residual, family=family.name)


def kv_scheme_from_dict(data: dict | None) -> KVScheme:
    """The scheme a checkpoint or recipe stored with :meth:`KVScheme.to_dict` (None: unquantized;
    one written before families existed gets the family that claims its bits and type)."""
    if not data:
        return KVScheme()
    unknown = sorted(set(data) - set(KVScheme.__dataclass_fields__))
    if unknown:
        raise ValueError(f"unknown KV cache settings {unknown}; known: {', '.join(KVScheme.__dataclass_fields__)}")
    return KVScheme(**data)
