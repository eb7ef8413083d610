"""Quantize every planned Linear of a model with a list of methods (``quant.methods``).

Without a method that needs data, each Linear is rounded on its own. Otherwise the
layer-by-layer calibration pipeline (``quant.sequential``) runs: each decoder layer's
pre-rounding steps (AWQ's scales), then one lockstep pass that rounds each Linear from
the statistics its rounding method asks for. Linears outside the decoder layers (a
quantized ``lm_head``) see no calibration statistics: the rounding method rounds them
when it needs none, else RTN does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from quant import distributed
from quant import methods as registry
from quant.affine import QuantScheme
from quant.architectures import Architecture, architecture_of, decoder_layers
from quant.format import QuantizedWeight
from quant.gptq import output_error
from quant.methods import Method
from quant.models import LazyLayers
from quant.sequential import lockstep_pass, quantize_sequential


def relative_error(weight: torch.Tensor, approx: torch.Tensor) -> float:
    """||W - Ŵ|| / ||W||: the weight-space error the manifest records per layer."""
    w = weight.float()
    return float((w - approx.float()).norm() / w.norm().clamp_min(1e-12))


def check_finite(name: str, weight: torch.Tensor) -> None:
    if not torch.isfinite(weight).all():
        raise ValueError(f"{name}.weight contains NaN or Inf; the source model is corrupt")


def round_each(model, plan: dict[str, QuantScheme], method: Method, settings, scale_dtype=None, progress: bool = True):
    """Each planned Linear rounded on its own, by a method that reads no statistics. Across ranks,
    each rounds the Linears it owns and rank 0 receives the rest (it alone writes the checkpoint)."""
    world = distributed.current()
    owner = world.owners({n: model.get_submodule(n).weight.numel() for n in plan})
    quantized, stats = {}, {}
    mine = [n for n in plan if owner[n] == world.rank]
    for name in tqdm(mine, desc=f"quantizing ({method.name})", unit="layer", disable=not progress or not world.main):
        weight = model.get_submodule(name).weight.detach()
        check_finite(name, weight)
        qw = method.round_linear(weight, plan[name], settings, scale_dtype, None, name)
        quantized[name] = qw
        stats[name] = {"scheme": plan[name].describe(),
                       "weight_rel_error": relative_error(weight, qw.dequantize(torch.float32))}
    if world.size > 1:  # in plan order on every rank
        shared = {n: world.share_quantized((quantized[n], stats[n]) if n in quantized else None, owner[n]) for n in plan}
        quantized, stats = {n: q for n, (q, _) in shared.items()}, {n: st for n, (_, st) in shared.items()}
    return quantized, stats


def layer_step(chain: list[Method], settings: dict, arch: Architecture, scale_dtype):
    """The per-layer step of the sequential pipeline: the chain's layer steps rewrite the layer's
    float weights, then one lockstep pass rounds each Linear given the inputs that reach it."""
    prepare, rounding = chain[:-1], chain[-1]
    rtn = registry.get("rtn")
    # whole-layer rounding decides every Linear before the pass; the pass then gathers xᵀx only
    # for the manifest's output errors and carries the quantized layer's outputs on
    hessian = rounding.statistics in ("hessian", "layer")
    # Linears that read one input: the pass quantizes them at once (spread over the ranks)
    together = tuple(p.linears for p in arch.scale_pairs if len(p.linears) > 1)

    def run(layer, inputs, plan, where: str = ""):
        for n in plan:
            check_finite(where + n, layer.get_submodule(n).weight)
        # a layer step rewrites the weights before they are rounded: keep the originals for the RTN baseline
        originals = {n: layer.get_submodule(n).weight.detach().clone() for n in plan} if prepare and hessian else {}
        col_scales = {}
        for m in prepare:
            col_scales.update(m.prepare_layer(layer, inputs, plan, settings[m.name], arch))
        learned, record = {}, {}
        if rounding.round_layer is not None:
            learned, record = rounding.round_layer(layer, inputs, plan, settings[rounding.name], scale_dtype, where)

        def quantize_linear(n: str, H: torch.Tensor | None):
            weight = layer.get_submodule(n).weight.detach()
            if n in learned:  # rounded with the whole layer (round_layer)
                method, qw = rounding, learned.pop(n)
            else:  # no Hessian where the method wants one: an expert no calibration token reached (quant.moe)
                method = rtn if hessian and H is None else rounding
                qw = method.round_linear(weight, plan[n], settings.get(method.name), scale_dtype, H, where + n)
            approx = qw.dequantize(torch.float32)
            stats = {"scheme": plan[n].describe(), "weight_rel_error": relative_error(weight, approx)}
            if method is not rounding:
                stats["rounded_by"] = f"{method.name} (no calibration token reached it)"
            if record:
                stats[rounding.name] = record  # the layer's learning: losses, kept step, seconds
            if H is None:
                return qw, stats
            original = originals.pop(n, weight)
            H_original = H  # a step that divided the inputs by s: undivided, their Hessian is H ∘ (s sᵀ)
            if n in col_scales:
                s = col_scales[n].float()
                H_original = H * torch.outer(s, s)
            plain = rtn.round_linear(original, plan[n], None, scale_dtype, None, n).dequantize(torch.float32)
            # relative output error on the calibration inputs that reach the Linear: plain
            # rounding of the original weight, then this chain's result
            stats["output_rel_error_rtn"] = output_error(original, plain, H_original)
            stats["output_rel_error"] = output_error(weight, approx, H)
            return qw, stats

        return lockstep_pass(layer, inputs, plan, quantize_linear, where, hessian=hessian, together=together)

    return run


def quantize_model(
    model: torch.nn.Module,
    plan: dict[str, QuantScheme],
    methods: str | list[str] = "rtn",
    *,
    samples: torch.Tensor | None = None,
    scale_dtype: torch.dtype | None = None,
    device: str = "cpu",
    work_dir: Path | None = None,
    resume: bool = False,
    run_id: str = "",
    progress: bool = True,
    lazy: LazyLayers | None = None,
    **settings,
) -> tuple[dict[str, QuantizedWeight], dict[str, dict]]:
    """Quantized weights per layer, and per-layer stats for the manifest.

    ``methods``: names in order (``["awq", "gptq"]``, or ``"awq+gptq"``); ``settings``: each
    method's settings by its name (``gptq=GPTQConfig(...)``), defaults for the rest. Settings
    for a method the list lacks are ignored here; the recipe refuses them. ``lazy``: the
    decoder layers are still on disk (:func:`quant.models.load_lazily`)."""
    chain = registry.chain(methods)
    used = {n: s for n, s in settings.items() if n in {m.name for m in chain}}
    settings = registry.check_settings(chain, used)
    rounding = chain[-1]
    if not any(m.needs_data for m in chain):
        if lazy is not None:
            raise ValueError(f"{rounding.name} rounds every weight of a model loaded whole; load it with load_float_model")
        return round_each(model, plan, rounding, settings[rounding.name], scale_dtype, progress)
    if samples is None:
        raise ValueError(f"{'+'.join(m.name for m in chain)} needs calibration samples")
    prefix, layers = decoder_layers(model)
    arch = architecture_of(model)
    for i, layer in enumerate(layers):  # a layout this family's entry does not describe: refused before any work
        arch.check_layer(layer, f"{prefix}.{i}")
    prefix += "."
    layer_plan = {n: s for n, s in plan.items() if n.startswith(prefix)}
    outside = {n: s for n, s in plan.items() if not n.startswith(prefix)}
    step = layer_step(chain, settings, arch, scale_dtype)
    quantized, stats = quantize_sequential(model, layer_plan, samples, step, device, work_dir=work_dir,
                                           resume=resume, run_id=run_id, progress=progress, lazy=lazy,
                                           float_stream=rounding.float_stream(settings[rounding.name]))
    if outside:
        plain = rounding if rounding.statistics is None else registry.get("rtn")
        q, st = round_each(model, outside, plain, settings.get(plain.name, plain.settings()), scale_dtype, progress=False)
        quantized.update(q)
        stats.update(st)
    return quantized, stats
