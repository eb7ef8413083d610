"""Quantize every planned Linear of a model with one method."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from quant import rtn
from quant.affine import QuantScheme
from quant.format import QuantizedWeight

# method name -> function(weight, scheme) -> QuantizedWeight. Calibrated methods
# (GPTQ, AWQ) run a layer-by-layer pipeline instead and join this table later.
METHODS = {"rtn": rtn.quantize_weight}


def relative_error(weight: torch.Tensor, qw: QuantizedWeight) -> float:
    """||W - Ŵ|| / ||W||: the weight-space error the manifest records per layer."""
    w = weight.float()
    return float((w - qw.dequantize(torch.float32)).norm() / w.norm().clamp_min(1e-12))


def quantize_model(
    model: torch.nn.Module,
    plan: dict[str, QuantScheme],
    method: str = "rtn",
    progress: bool = True,
) -> tuple[dict[str, QuantizedWeight], dict[str, dict]]:
    """Quantized weights per layer, and per-layer stats for the manifest."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    quantize_weight = METHODS[method]
    quantized, stats = {}, {}
    for name in tqdm(list(plan), desc=f"quantizing ({method})", unit="layer", disable=not progress):
        weight = model.get_submodule(name).weight.detach()
        if not torch.isfinite(weight).all():
            raise ValueError(f"{name}.weight contains NaN or Inf; the source model is corrupt")
        qw = quantize_weight(weight, plan[name])
        quantized[name] = qw
        stats[name] = {"scheme": plan[name].describe(), "weight_rel_error": relative_error(weight, qw)}
    return quantized, stats
