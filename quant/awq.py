"""AWQ: activation-aware scaling, then clipping (Lin et al., 2023).

For each pair "op -> Linears that read its output" (the family's ``scale_pairs`` in
``quant.architectures``; in the Llama layout a norm feeding q/k/v, v feeding o, a
norm feeding gate/up, up feeding down), search a per-channel scale ``s`` from
input and weight magnitudes that minimizes the error of the block's output when
the Linears are quantized as ``W·s`` on inputs ``x/s``;
fold ``1/s`` into the op and ``s`` into the Linears (exact in floating point).
Then search, per group, how far to shrink each Linear's range, and clamp its
weights there, so whatever rounds them next (RTN or GPTQ) sees the clipped
range. The float Hessian of a scaled Linear's input transforms exactly:
``H' = H / (s sᵀ)``. On a GGUF type (``quant.gguf_mix.GridScheme``, a recipe's ``gguf:`` target)
both searches score the type's own quantizer: its grid fitted to the scaled (or clamped) weights,
codes to nearest, dequantized as llama.cpp does (``quant.gguf_fit``).

Across ranks (``quant.distributed``) each rank scores its own calibration rows; the input
magnitudes, the grid's losses and the clipping errors are summed over the ranks before any
choice, so every rank folds the same scales and clamps to the same ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quant import distributed
from quant.affine import QuantScheme, choose_qparams, dequantize, fake_quantize, quantize
from quant.architectures import Architecture
from quant.gguf_mix import GridScheme
from quant.sequential import LayerInputs, run_layer


@dataclass(frozen=True)
class AWQConfig:
    grid: int = 20  # scale exponents tried: 0, 1/grid, ..., (grid-1)/grid
    search_samples: int = 8  # calibration samples (of seq_len tokens) the searches score on
    clip: bool = True
    clip_tokens: int = 512  # input rows the clipping search scores against
    clip_steps: int = 20
    clip_max_shrink: float = 0.5


@dataclass
class Mapping:
    prev: nn.Module  # RMSNorm or Linear whose output the Linears read
    linears: list[str]  # local names inside the decoder layer
    inspect: str  # local name of the module whose output the scale search compares
    norm_offset: float = 0.0  # a norm ``prev`` scales by (norm_offset + weight) (quant.architectures)


def scale_mappings(layer: nn.Module, arch: Architecture) -> list[Mapping]:
    """The scalable pairs of a decoder layer, from its family's entry in ``quant.architectures``."""
    arch.check_layer(layer)
    maps = []
    for pair in arch.scale_pairs:
        prev = layer.get_submodule(pair.prev)
        # a Linear feeding Linears (v -> o) scales only when its outputs are theirs channel for
        # channel: not with grouped-query attention, where v has fewer outputs than o has inputs
        if isinstance(prev, nn.Linear) and any(
                prev.out_features != layer.get_submodule(n).in_features for n in pair.linears):
            continue
        maps.append(Mapping(prev, list(pair.linears), pair.inspect, arch.norm_offset))
    return maps


def _capture(layer: nn.Module, inputs: LayerInputs, names: list[str]) -> tuple[dict, dict]:
    """Inputs (and keyword arguments) of the named submodules during a layer forward."""
    xs: dict[str, list] = {n: [] for n in names}
    kws: dict[str, list] = {n: [] for n in names}

    def hook(name):
        def fn(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            xs[name].append(x.detach())
            kws[name].append({k: v for k, v in kwargs.items() if k != "hidden_states"})

        return fn

    handles = [layer.get_submodule(n).register_forward_pre_hook(hook(n), with_kwargs=True) for n in names]
    try:
        for h, kw in zip(inputs.hidden, inputs.kwargs):
            layer(h, **kw)
    finally:
        for handle in handles:
            handle.remove()
    return xs, kws


def _weight_magnitude(weights: list[torch.Tensor], scheme: QuantScheme) -> torch.Tensor:
    """Mean over output rows of |w| relative to its group's largest |w|, per input channel."""
    w = torch.cat([x.float() for x in weights], 0)
    g = scheme.group_len(w.shape[1])
    wg = w.abs().view(w.shape[0], -1, g)
    return (wg / wg.amax(-1, keepdim=True).clamp_min(1e-8)).view_as(w).mean(0)


def search_scale(layer, mapping: Mapping, plan: dict, xs: dict, kws: dict, config: AWQConfig) -> torch.Tensor:
    world = distributed.current()
    first = mapping.linears[0]
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs[first]]).float()
    x_mag = world.mean_rows(x.abs())
    linears = [layer.get_submodule(n) for n in mapping.linears]
    originals = [lin.weight.data.clone() for lin in linears]
    w_mag = _weight_magnitude(originals, plan[first])
    inspect = layer.get_submodule(mapping.inspect)
    inspect_in = xs[mapping.inspect] if mapping.inspect in xs else xs[first]
    reference = run_layer(inspect, LayerInputs(inspect_in, kws[mapping.inspect]))

    def scale(step: int) -> torch.Tensor:
        ratio = step / config.grid
        s = (x_mag.pow(ratio) / w_mag.pow(1 - ratio).clamp_min(1e-4)).clamp_min(1e-4)
        return s / (s.max() * s.min()).sqrt()

    losses = torch.zeros(config.grid, dtype=torch.float64)
    try:
        for step in range(config.grid):
            s = scale(step)
            for lin, w, n in zip(linears, originals, mapping.linears):
                lin.weight.data = (_fake_quantize(w.float() * s, plan[n]) / s).to(w.dtype)
            out = run_layer(inspect, LayerInputs(inspect_in, kws[mapping.inspect]))
            losses[step] = sum(float((o.float() - r.float()).pow(2).sum()) for o, r in zip(out, reference))
    finally:
        for lin, w in zip(linears, originals):
            lin.weight.data = w
    losses = world.sum_(losses).nan_to_num(nan=float("inf"))
    if not torch.isfinite(losses).any():
        return torch.ones_like(x_mag)
    return scale(int(losses.argmin()))  # the first of equal losses, as a strict < over the grid picks


def apply_scale(mapping: Mapping, layer, s: torch.Tensor) -> None:
    prev = mapping.prev
    if isinstance(prev, nn.Linear):  # the rows that produce the scaled channels
        prev.weight.data = (prev.weight.data.float() / s.unsqueeze(1)).to(prev.weight.dtype)
        if prev.bias is not None:
            prev.bias.data = (prev.bias.data.float() / s).to(prev.bias.dtype)
    else:  # a norm's per-channel scale: weight, or (1 + weight) where the family stores it offset (Gemma)
        offset = mapping.norm_offset
        prev.weight.data = ((offset + prev.weight.data.float()) / s - offset).to(prev.weight.dtype)
    for n in mapping.linears:
        lin = layer.get_submodule(n)
        lin.weight.data = (lin.weight.data.float() * s).to(lin.weight.dtype)


def _fake_quantize(w: torch.Tensor, scheme: QuantScheme | GridScheme) -> torch.Tensor:
    """``w`` rounded to nearest on ``scheme`` and read back: lowbit's affine grid, or a GGUF type's
    grid fitted to ``w`` (``quant.gguf_fit``, searched without data), dequantized as llama.cpp does."""
    if isinstance(scheme, GridScheme):
        from quant import gguf_fit  # imports the gguf package: only when a GGUF type is planned

        return gguf_fit.round_to_nearest(w, scheme.type_name).dequantize(w.dtype)
    return fake_quantize(w, scheme)


def _clamped(wg: torch.Tensor, ratio, symmetric: bool) -> torch.Tensor:
    """Groups ``wg`` [out, groups, g] clamped to ``ratio`` (a number or [out, groups]) of their range."""
    if symmetric:
        limit = wg.abs().amax(-1) * ratio
        lo, hi = -limit, limit
    else:
        lo = wg.amin(-1).clamp(max=0) * ratio
        hi = wg.amax(-1).clamp(min=0) * ratio
    return torch.maximum(torch.minimum(wg, hi.unsqueeze(-1)), lo.unsqueeze(-1))


def _clip_rounded(w: torch.Tensor, scheme: QuantScheme | GridScheme, ratio: float) -> torch.Tensor:
    """``w`` [out, in] read back after rounding with each group's range shrunk to ``ratio``: on a GGUF
    type, its grid fitted to the clamped weights (what the rounding after AWQ will see)."""
    if isinstance(scheme, GridScheme):
        g = scheme.group_len(w.shape[1])
        return _fake_quantize(_clamped(w.view(w.shape[0], -1, g), ratio, scheme.symmetric).view_as(w), scheme)
    scale, zero = choose_qparams(w, scheme, ratio)
    return dequantize(quantize(w, scale, zero, scheme), scale, zero, scheme, torch.float32)


def search_clip(weight: torch.Tensor, x: torch.Tensor, scheme: QuantScheme | GridScheme,
                config: AWQConfig) -> torch.Tensor:
    """Clamp each group of ``weight`` to the shrunk range that minimizes its output error on ``x``."""
    w = weight.float()
    out, cols = w.shape
    g = scheme.group_len(cols)
    xg = x.float().reshape(x.shape[0], cols // g, g).transpose(0, 1)  # [groups, n, g] (this rank may have n = 0)
    wg = w.view(out, -1, g)
    best_ratio = torch.ones(out, cols // g)
    best_err = torch.full((out, cols // g), float("inf"))
    for step in range(int(config.clip_steps * config.clip_max_shrink) + 1):
        ratio = 1.0 - step / config.clip_steps
        delta = (w - _clip_rounded(w, scheme, ratio)).view(out, -1, g)
        # [out, groups], summed over every rank's rows (a sum, not a mean: the same choice, one scale fewer)
        err = distributed.current().sum_(torch.einsum("gnk,ogk->ogn", xg, delta).pow(2).sum(-1))
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    return _clamped(wg, best_ratio, scheme.symmetric).view(out, cols).to(weight.dtype)


def apply_awq(layer: nn.Module, inputs: LayerInputs, plan: dict, config: AWQConfig, arch: Architecture) -> dict:
    """Fold searched scales into the layer and clip its Linears; return each Linear's
    input-channel scale (for transforming its Hessian)."""
    mappings = [m for m in scale_mappings(layer, arch) if all(n in plan for n in m.linears)]
    world = distributed.current()
    per_batch = int(world.total(inputs.hidden[0].shape[0]))  # a global batch: the ranks' first batches together
    keep = max(1, -(-config.search_samples // per_batch))
    subset = LayerInputs(inputs.hidden[:keep], inputs.kwargs[:keep])
    names = sorted({n for m in mappings for n in m.linears} | {m.inspect for m in mappings})
    xs, kws = _capture(layer, subset, names)
    col_scales: dict[str, torch.Tensor] = {}
    for m in mappings:
        s = search_scale(layer, m, plan, xs, kws, config)
        apply_scale(m, layer, s)
        for n in m.linears:
            col_scales[n] = s
    if config.clip:
        generator = torch.Generator().manual_seed(0)
        for n, scheme in plan.items():
            if n in arch.no_clip or n not in xs:
                continue
            x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs[n]])
            # the same rows as one process would draw: drawn from every rank's rows, each rank keeps its own
            chosen = torch.randperm(int(world.total(x.shape[0])), generator=generator)[: config.clip_tokens]
            x = x[world.local_rows(chosen, xs[n][0].shape[-2])] if world.size > 1 else x[chosen]
            if n in col_scales:
                x = x / col_scales[n]
            lin = layer.get_submodule(n)
            lin.weight.data = search_clip(lin.weight.data, x, scheme, config)
    return col_scales
