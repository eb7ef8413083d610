"""Quantize every planned Linear of a model with one method.

RTN needs no data and rounds each weight on its own. GPTQ, AWQ and AWQ+GPTQ
run the layer-by-layer calibration pipeline (``quant.sequential``); Linears
outside the decoder layers (a quantized ``lm_head``) are rounded with RTN.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from quant import rtn
from quant.affine import QuantScheme
from quant.awq import AWQConfig, apply_awq
from quant.format import QuantizedWeight
from quant.gptq import GPTQConfig, gptq_quantize, output_error
from quant.models import LazyLayers
from quant.sequential import decoder_layers, lockstep_pass, quantize_sequential

METHODS = ("rtn", "gptq", "awq", "awq+gptq")


def relative_error(weight: torch.Tensor, approx: torch.Tensor) -> float:
    """||W - Ŵ|| / ||W||: the weight-space error the manifest records per layer."""
    w = weight.float()
    return float((w - approx.float()).norm() / w.norm().clamp_min(1e-12))


def check_finite(name: str, weight: torch.Tensor) -> None:
    if not torch.isfinite(weight).all():
        raise ValueError(f"{name}.weight contains NaN or Inf; the source model is corrupt")


def rtn_all(model, plan: dict[str, QuantScheme], scale_dtype=None, progress: bool = True):
    quantized, stats = {}, {}
    for name in tqdm(list(plan), desc="quantizing (rtn)", unit="layer", disable=not progress):
        weight = model.get_submodule(name).weight.detach()
        check_finite(name, weight)
        qw = rtn.quantize_weight(weight, plan[name], scale_dtype)
        quantized[name] = qw
        stats[name] = {"scheme": plan[name].describe(),
                       "weight_rel_error": relative_error(weight, qw.dequantize(torch.float32))}
    return quantized, stats


def layer_method(method: str, gptq: GPTQConfig, awq: AWQConfig, scale_dtype):
    """The per-layer step of the sequential pipeline for a calibrated method: AWQ's scales
    and clipping first (``awq``, ``awq+gptq``), then one lockstep pass that rounds each
    Linear (GPTQ, or RTN for plain AWQ) given the inputs that reach it."""

    def run(layer, inputs, plan, where: str = ""):
        for n in plan:
            check_finite(where + n, layer.get_submodule(n).weight)
        awq_first = method.startswith("awq")
        # AWQ rewrites the weights before they are rounded: keep the originals for the RTN baseline
        originals = {n: layer.get_submodule(n).weight.detach().clone() for n in plan} if awq_first else {}
        col_scales = apply_awq(layer, inputs, plan, awq) if awq_first else {}

        def quantize_linear(n: str, H: torch.Tensor):
            weight = layer.get_submodule(n).weight.detach()
            if method.endswith("gptq"):
                qw = gptq_quantize(weight, H, plan[n], gptq, scale_dtype, where + n)
            else:
                qw = rtn.quantize_weight(weight, plan[n], scale_dtype)
            original = originals.pop(n, weight)
            H_original = H  # AWQ divided the inputs by s: undivided, their Hessian is H ∘ (s sᵀ)
            if n in col_scales:
                s = col_scales[n].float()
                H_original = H * torch.outer(s, s)
            plain = rtn.quantize_weight(original, plan[n], scale_dtype).dequantize(torch.float32)
            approx = qw.dequantize(torch.float32)
            return qw, {
                "scheme": plan[n].describe(),
                "weight_rel_error": relative_error(weight, approx),
                # relative output error on the calibration inputs that reach the Linear: plain
                # rounding of the original weight, then this method's result
                "output_rel_error_rtn": output_error(original, plain, H_original),
                "output_rel_error": output_error(weight, approx, H),
            }

        return lockstep_pass(layer, inputs, plan, quantize_linear, where)

    return run


def quantize_model(
    model: torch.nn.Module,
    plan: dict[str, QuantScheme],
    method: str = "rtn",
    *,
    samples: torch.Tensor | None = None,
    gptq: GPTQConfig = GPTQConfig(),
    awq: AWQConfig = AWQConfig(),
    scale_dtype: torch.dtype | None = None,
    device: str = "cpu",
    work_dir: Path | None = None,
    resume: bool = False,
    run_id: str = "",
    progress: bool = True,
    lazy: LazyLayers | None = None,
) -> tuple[dict[str, QuantizedWeight], dict[str, dict]]:
    """Quantized weights per layer, and per-layer stats for the manifest. ``lazy``: the
    decoder layers are still on disk (:func:`quant.models.load_lazily`)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    if method == "rtn":
        if lazy is not None:
            raise ValueError("rtn rounds every weight of a model loaded whole; load it with load_float_model")
        return rtn_all(model, plan, scale_dtype, progress)
    if samples is None:
        raise ValueError(f"{method} needs calibration samples")
    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers) + "."
    layer_plan = {n: s for n, s in plan.items() if n.startswith(prefix)}
    outside = {n: s for n, s in plan.items() if not n.startswith(prefix)}
    quantized, stats = quantize_sequential(
        model, layer_plan, samples, layer_method(method, gptq, awq, scale_dtype), device,
        work_dir=work_dir, resume=resume, run_id=run_id, progress=progress, lazy=lazy,
    )
    if outside:
        q, st = rtn_all(model, outside, scale_dtype, progress=False)
        quantized.update(q)
        stats.update(st)
    return quantized, stats
