"""Round-to-nearest: min/max scales per group, each weight rounded on its own. No data."""

from __future__ import annotations

from dataclasses import dataclass

from quant import rtn
from quant.methods import Method


@dataclass(frozen=True)
class RTNSettings:
    """RTN has no settings of its own: the scheme (bits, group, symmetry) says everything."""


def round_linear(weight, scheme, settings: RTNSettings, scale_dtype, stats, name: str):
    return rtn.quantize_weight(weight, scheme, scale_dtype)


METHOD = Method("rtn", RTNSettings, needs_data=False, stage="round", round_linear=round_linear)
