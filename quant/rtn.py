"""Round-to-nearest: min/max scales per group, then plain rounding."""

from __future__ import annotations

import torch

from quant.affine import QuantScheme, choose_qparams, quantize
from quant.format import QuantizedWeight


def quantize_weight(weight: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype | None = None) -> QuantizedWeight:
    scale, zero = choose_qparams(weight, scheme, scale_dtype=scale_dtype)
    return QuantizedWeight(quantize(weight, scale, zero, scheme), scale, zero, scheme)
