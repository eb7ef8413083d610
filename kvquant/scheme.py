"""KV-cache schemes: how many bits, which groups, how many newest tokens stay unquantized.

| name | keys | values |
|------|------|--------|
| ``fp16`` | unquantized (the model's dtype) | unquantized |
| ``int8`` | per token: one scale and zero per token and head | per token, the same |
| ``int4``, ``int2`` | KIVI: per channel, groups of ``group_size`` tokens | per token, groups of ``group_size`` channels |
| ``fp8`` | float8 e4m3, one scale per head and block | the same |

Keys are quantized per channel at low bit widths because a few key channels carry
large, persistent offsets (KIVI, arXiv 2402.02750): a per-token group would spend
its whole range on them. Values have no such channels and are grouped per token.

Every quantized scheme keeps the newest, partially filled block of ``residual``
tokens in the model's dtype and quantizes a block when it fills: a per-channel key
group needs its tokens before it can be quantized, and the newest tokens, which
attention weighs most, stay exact. ``residual`` is therefore also the block size of
the runtime's paged cache.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

SUPPORTED_KV_BITS = (16, 8, 4, 2)  # 16 = unquantized
FP8_MAX = 448.0  # largest float8 e4m3 value
# Fraction of each group's min..max range the grid spans (shrunk about its centre), keys and values.
# INT2 values: four levels cannot afford to put two of them on a token's extremes; a grid 0.9 as
# wide rounds the bulk finer and clips only the largest values. Keys keep their whole range:
# clipping an outlier key channel distorts every attention score it feeds. Chosen on the
# calibration text (the five non-evaluation Austen novels), not on Persuasion, by bench/kv_range.py
# (bench/results/kv/int2-range-ratio.json: +27.4% -> +23.9% there).
RANGE_RATIO = {2: (1.0, 0.9)}


@dataclass(frozen=True)
class KVScheme:
    bits: int = 16
    type: str = "int"  # "int", or "float" for FP8 e4m3 (bits 8), as compressed-tensors names it
    group_size: int = 64  # int4/int2: tokens per key group and channels per value group
    residual: int = 128  # tokens per block; the newest partial block stays unquantized

    def __post_init__(self):
        if isinstance(self.bits, bool) or self.bits not in SUPPORTED_KV_BITS:
            raise ValueError(
                f"KV cache bits must be one of {', '.join(map(str, SUPPORTED_KV_BITS))} (16 = unquantized), got {self.bits!r}"
            )
        if self.type not in ("int", "float"):
            raise ValueError(f"KV cache type must be 'int' or 'float', got {self.type!r}")
        if self.type == "float" and self.bits != 8:
            raise ValueError(f"a float KV cache is FP8 (e4m3): bits must be 8, got {self.bits}")
        for key in ("group_size", "residual"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KV cache {key} must be a positive integer, got {value!r}")
        if self.kivi and self.residual % self.group_size:
            raise ValueError(
                f"KV cache residual {self.residual} is not a multiple of group_size {self.group_size}: keys are "
                f"quantized per channel in groups of {self.group_size} tokens, and a block of {self.residual} "
                "tokens must hold whole groups"
            )

    @property
    def quantized(self) -> bool:
        return self.bits != 16

    @property
    def fp8(self) -> bool:
        return self.type == "float"

    @property
    def kivi(self) -> bool:
        """Per-channel keys grouped over tokens, per-token values grouped over channels."""
        return self.bits in (4, 2)

    def range_ratio(self, keys: bool) -> float:
        """How much of each group's min..max range the integer grid spans (1: all of it)."""
        return RANGE_RATIO.get(self.bits, (1.0, 1.0))[0 if keys else 1]  # INT8, FP8: never listed

    @property
    def block_size(self) -> int:
        return self.residual

    @property
    def name(self) -> str:
        if not self.quantized:
            return "fp16"
        if self.fp8:
            return "fp8"
        if self.kivi:
            return f"int{self.bits}-g{self.group_size}-r{self.residual}"
        return f"int{self.bits}"

    def to_dict(self) -> dict:
        return asdict(self)

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError unless a model with heads of ``head_dim`` channels can take this scheme."""
        if self.kivi and head_dim % self.group_size:
            fits = [g for g in range(min(self.group_size, head_dim), 0, -1) if head_dim % g == 0 and self.residual % g == 0]
            raise ValueError(
                f"KV cache group_size {self.group_size} does not divide head_dim {head_dim}: values are quantized per "
                f"token in groups of {self.group_size} channels of one head, and a group cannot reach into the next "
                f"head; use a group_size that divides {head_dim} (e.g. {fits[0]})"
            )


_NAME = re.compile(r"^(?P<kind>fp16|bf16|float16|bfloat16|none|int8|int4|int2|fp8)(?:-g(?P<g>\d+))?(?:-r(?P<r>\d+))?$")


def parse_kv(spec: str, default: KVScheme | None = None) -> KVScheme:
    """A scheme from its name: ``fp16``, ``int8``, ``int4``, ``int2``, ``fp8``, optionally with
    ``-g<group_size>`` and ``-r<residual>`` (``int4-g32-r128``). Unnamed settings come from ``default``."""
    m = _NAME.match(str(spec).strip().lower())
    if m is None:
        raise ValueError(
            f"unknown KV cache scheme {spec!r}: use fp16, int8, int4, int2 or fp8, "
            "optionally with -g<group_size> and -r<residual> (e.g. int4-g64-r128)"
        )
    base = default or KVScheme()
    kind = m["kind"]
    bits, type_ = {"int8": (8, "int"), "int4": (4, "int"), "int2": (2, "int"), "fp8": (8, "float")}.get(kind, (16, "int"))
    group = int(m["g"]) if m["g"] else base.group_size
    residual = int(m["r"]) if m["r"] else base.residual
    return KVScheme(bits=bits, type=type_, group_size=group, residual=residual)


def kv_scheme_from_dict(data: dict | None) -> KVScheme:
    """The scheme a checkpoint or recipe stored with :meth:`KVScheme.to_dict` (None: unquantized)."""
    if not data:
        return KVScheme()
    unknown = sorted(set(data) - set(KVScheme.__dataclass_fields__))
    if unknown:
        raise ValueError(f"unknown KV cache settings {unknown}; known: {', '.join(KVScheme.__dataclass_fields__)}")
    return KVScheme(**data)
