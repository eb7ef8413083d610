"""Round-to-nearest: min/max scales per group, each weight rounded on its own. No data."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant import rtn
from quant.gguf_mix import GridScheme
from quant.methods import Method


@dataclass(frozen=True)
class RTNSettings:
    """RTN has no settings of its own: the scheme (bits, group, symmetry) says everything."""


def round_linear(weight, scheme, settings: RTNSettings, scale_dtype, stats, name: str):
    if isinstance(scheme, GridScheme):  # a GGUF type: nearest rounding on its grid, searched with diag(H) if given
        from quant import gguf_fit  # imports the gguf package: only when a GGUF type is planned

        return gguf_fit.round_linear(weight, scheme, stats if isinstance(stats, torch.Tensor) else None)
    return rtn.quantize_weight(weight, scheme, scale_dtype)


METHOD = Method("rtn", RTNSettings, needs_data=False, stage="round", round_linear=round_linear)
