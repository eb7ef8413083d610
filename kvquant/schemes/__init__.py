"""The KV-cache families, one file each, found by name.

Every module here that defines ``FAMILY`` (a :class:`kvquant.schemes.base.KVFamily`) adds a
family: its name pattern, storage layout (bytes per token follow from it), reference
quantize/dequantize, and which Triton kernels serve it with which constants (none: the
runtime's PyTorch reference path serves it). Parsing names, the help texts, the memory
planner's default rows and ``lowbit diagnose``'s ratios all read this registry.

| family | names | keys | values | kernels |
|--------|-------|------|--------|---------|
| ``fp16`` | ``fp16`` (``bf16``, ``none``) | model dtype | model dtype | yes |
| ``int8`` | ``int8`` | INT8 per token | INT8 per token | yes |
| ``kivi`` | ``int4``, ``int2`` | per channel, groups of G tokens | per token, groups of G channels | yes |
| ``fp8`` | ``fp8`` | e4m3, scale per head and block | the same | yes (sm_89+) |
| ``kv-split`` | ``k8v4``, ``k4v2``, ... | 8: per token; 4/2: as KIVI's | 8: per token; 4/2: as KIVI's | no |

Adding a family is one file here, e.g. ``kvquant/schemes/mine.py``::

    class Mine(IntegerFamily):  # or KVFamily, declaring layout/quantize/dequantize itself
        name, summary, pattern, listed = "mine", "what it stores", r"mine(?P<bits>[42])", ("mine4",)
        def settings(self, match): return {"bits": int(match["bits"])}
        def base_name(self, scheme): return f"mine{scheme.bits}"
        def grids(self, scheme): return IntGrid(scheme.bits, 32), IntGrid(scheme.bits, 32)

    FAMILY = Mine()

plus kernel branches (``kernels``, ``kernel_constants``) only when it needs the speed.
"""

from __future__ import annotations

import importlib
import pkgutil
import re

from kvquant.schemes.base import KVFamily
from quant.names import did_you_mean

SUFFIX = r"(?:-g(?P<g>\d+))?(?:-r(?P<r>\d+))?"  # every name may set group_size and residual


REGISTRY: dict[str, KVFamily] = {}
_PATTERNS: dict[str, re.Pattern] = {}


def register(family: KVFamily) -> KVFamily:
    """Add ``family`` (what discovery does for every module here that defines ``FAMILY``)."""
    if family.name in REGISTRY:
        raise ValueError(f"two KV-cache families are named {family.name!r}")
    REGISTRY[family.name] = family
    ordered = sorted(REGISTRY.values(), key=lambda f: (f.order, f.name))  # the order lists are shown in
    REGISTRY.clear()
    REGISTRY.update((f.name, f) for f in ordered)
    _PATTERNS[family.name] = re.compile(rf"^(?:{family.pattern}){SUFFIX}$")
    return family


def _discover() -> None:
    for info in pkgutil.iter_modules(__path__):
        family = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if family is not None:
            register(family)


_discover()


def get(name: str) -> KVFamily:
    if name not in REGISTRY:
        raise ValueError(f"unknown KV cache family {name!r}{did_you_mean(name, REGISTRY)}; known families: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def claiming(bits: int, type_: str, value_bits: int) -> KVFamily:
    """The family of a scheme given without one (bits, type and value_bits only, as older
    checkpoints and recipes store it)."""
    for family in REGISTRY.values():
        if family.claims(bits, type_, value_bits):
            return family
    raise ValueError(f"no KV cache family stores keys at {bits} bits and values at {value_bits} bits of type "
                     f"{type_!r}; the families: {', '.join(REGISTRY)}")


def match(spec: str) -> tuple[KVFamily, dict] | None:
    """The family whose pattern a name matches, and the regex's groups (None: no family)."""
    text = str(spec).strip().lower()
    for name in REGISTRY:
        m = _PATTERNS[name].match(text)
        if m:
            return REGISTRY[name], m.groupdict()
    return None


def listed_names(quantized: bool | None = None) -> list[str]:
    """The names the families list (help texts, the planner's defaults), optionally only the
    quantized (or unquantized) ones."""
    return [n for f in REGISTRY.values() if quantized is None or f.quantized == quantized for n in f.listed]


def names_text() -> str:
    """``fp16, int8, int4, int2, fp8, k8v4 or k4v2``: every listed name, for messages."""
    names = listed_names()
    return f"{', '.join(names[:-1])} or {names[-1]}"
