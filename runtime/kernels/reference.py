"""Reference kernels in plain PyTorch, built on quant's affine math and packing."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quant.affine import QuantScheme, dequantize
from quant.packing import unpack


def dequantize_weight(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero_packed: torch.Tensor | None,
    shape: tuple[int, int],
    scheme: QuantScheme,
    dtype: torch.dtype,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The float weight ``[out, in]`` of a pack-quantized Linear (``g_idx``: act-order groups)."""
    out_features, in_features = shape
    q = unpack(packed, scheme.bits, in_features, dim=1)
    zero = None if zero_packed is None else unpack(zero_packed, scheme.bits, out_features, dim=0)
    return dequantize(q, scale, zero, scheme, dtype, None if g_idx is None else g_idx.long())


def quant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` with the dequantized weight (the fused GPU kernels replace this)."""
    return F.linear(x, weight, bias)
