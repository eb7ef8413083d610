"""Learned rounding and ranges per decoder layer by signed gradient descent (SignRound).

The algorithm of Intel's AutoRound (Cheng et al., 2023, "Optimize Weight Rounding via Signed
Gradient Descent"), written for lowbit's affine scheme. For every planned Linear of a decoder
layer it learns

- ``offset`` V, one per weight, in ``[-0.5, 0.5]`` grid steps, added before rounding: each
  weight may round up or down, whichever serves the layer's output;
- ``lo_ratio``, ``hi_ratio`` per group in ``[min_range, 1]``, shrinking the group's min and max
  (symmetric grids: one ratio on ``max |w|``): a finer grid for most weights at the price of
  clipping a few. They start at the ratio that rounds the group's own weights best
  (``init_range: search``; AutoRound starts at 1, ``minmax``).

It minimizes the squared difference between the layer's output with the fake-quantized
weights, on the outputs of the already quantized layers before it, and a reference (``loss: mse``:
averaged over every token and channel; ``loss: relative``: each token's divided by its
reference's mean square, as the norms that read the residual stream see it): with
``target: model`` (the default; AutoRound's reference) the float model's output of the layer,
from the float model's own activations, so each layer also learns to undo the error of the
layers before it; with ``target: layer`` the layer's float output on those same inputs (each
layer matches its own float self, as GPTQ does). Learning against the float model under
``mse`` broke text unlike the calibration's: the error was mostly one massive activation on
each window's first token, which later layers bent their rounding to match. It descends with
SignSGD: each step moves every parameter by ``lr`` times the sign of its gradient, ``lr``
decaying linearly to zero; rounding passes its gradient straight through.
Each step draws ``batch_size`` calibration windows at random, and the parameters of the step
with the lowest loss are kept (AutoRound's "best" iteration). The result is rounded by
``quant.affine`` with the learned offsets and ranges, so the checkpoint is an ordinary
min/max-style affine one: scales, integer zero points, integers.

Memory is one layer: its float weights, the parameters above (one float per weight), the
layer's float outputs on the calibration windows, and one batch's activations for backward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from quant.affine import QuantScheme, choose_qparams, clip_search, from_grid, quantize
from quant.format import QuantizedWeight
from quant.sequential import LayerInputs, run_layer


# the settings with a fixed set of values (the recipe reader checks them too: quant.methods.signround)
CHOICES = {"init_range": ("search", "minmax"), "target": ("model", "layer"), "loss": ("relative", "mse")}


@dataclass(frozen=True)
class SignRoundConfig:
    iters: int = 200  # SignSGD steps per decoder layer
    batch_size: int = 8  # calibration windows per step
    # the first step's size, which decays linearly to 0, in units of 1/iters (AutoRound's default; it
    # was doubled at 3 bits or fewer until measured: bench/results/quality/layer-error-signround-variants.json,
    # quality/w3-signround-layer-mse.json)
    lr_scale: float = 1.0
    min_range: float = 0.5  # the smallest fraction of a group's min / max the range may shrink to
    tune_range: bool = True  # learn the ranges too (False: offsets only, min/max ranges)
    # where the ranges start: "search" (the ratio in [min_range, 1] that minimizes the group's own rounding
    # error, as GPTQ's mse observer) or "minmax" (each group's min and max, AutoRound's start). At W2 the
    # min/max start left the descent (64 steps) far from a good range: "search" took Persuasion from 65.2 to
    # 59.7 and Python source from 519 to 328; level or better at W3 and W4
    # (bench/results/quality/w{2,3,4}-signround-search*.json against w{2,3,4}-signround-model-relative.json)
    init_range: str = "search"
    # the reference output: "model" (the float model's, from its own activations: each layer also undoes
    # the error upstream of it) or "layer" (the float layer on the quantized model's inputs). "model" with
    # loss "relative" beats "layer" on Persuasion at W3 (three draws) and W4 and is level or better on
    # Python source: bench/results/quality/w{3,4}-signround-model-relative*.json against
    # quality/w3-signround-layer-mse.json, quality/w4-signround-layer-mse.json
    target: str = "model"
    # "relative": each token's squared error divided by its reference's mean square; "mse": the mean over
    # every token and channel. The residual stream is read only through norms, which divide each token by
    # its size, and a window's first token carries activations thousands of times the others' (SmolLM2
    # from layer 11 on: 94% of the float and quantized streams' squared difference). Under "mse",
    # "model" spent layers 11-14 on that one number and one draw sent Python source from 16 to 224
    # perplexity (bench/results/quality/layer-blame-w3-signround-model-mse-seed2.json); "relative" gave 12.2
    loss: str = "relative"
    seed: int = 1  # which windows each step draws

    def __post_init__(self):
        if not 0 < self.min_range <= 1:
            raise ValueError(f"signround.min_range must be in (0, 1], got {self.min_range}")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"signround.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.lr_scale <= 0 or self.iters < 1 or self.batch_size < 1:
            raise ValueError(f"signround: iters, batch_size and lr_scale must be positive, got {self}")


class _Rounding:
    """One Linear's learned parameters and its fake-quantized weight."""

    def __init__(self, weight: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype, config: SignRoundConfig):
        self.weight, self.scheme, self.scale_dtype = weight.detach().float(), scheme, scale_dtype
        rows, cols = self.weight.shape
        groups = scheme.num_groups(cols)
        self.offset = torch.zeros_like(self.weight, requires_grad=True)
        # min/max qparams depend on each group's min and max alone: keep those two per group, so
        # every step computes the scales from them (groups of 2) instead of from the whole weight
        grouped = self.weight.unflatten(-1, (groups, scheme.group_len(cols)))
        self.extremes = torch.stack([grouped.amin(-1), grouped.amax(-1)], -1).flatten(-2)
        self.extremes_scheme = QuantScheme(scheme.bits, 2, scheme.symmetric)
        start = torch.ones(rows, groups)
        if config.init_range == "search":  # 1% steps of the range
            shrink = 1 - config.min_range
            start = clip_search(self.weight, scheme, scale_dtype, steps=round(shrink * 100) + 1, max_shrink=shrink)
        self.ratios = [start.clone().requires_grad_() for _ in range(1 if scheme.symmetric else 2)]

    def params(self) -> list[torch.Tensor]:
        return [self.offset, *self.ratios]

    def qparams(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scale (differentiable in the ratios, cast to the stored dtype) and integer zero point
        (it moves with the range but passes no gradient)."""
        ratio = self.ratios[0] if self.scheme.symmetric else tuple(self.ratios)
        return choose_qparams(self.extremes, self.extremes_scheme, ratio, self.scale_dtype)

    def fake_quantized(self) -> torch.Tensor:
        """The weight as it will be stored and read back, differentiable in every parameter:
        rounding passes its gradient straight through."""
        scale, zero = self.qparams()
        scale = scale.float().unsqueeze(-1)
        zero = None if zero is None else zero.float().unsqueeze(-1)
        shape = (self.scheme.num_groups(self.weight.shape[1]), self.scheme.group_len(self.weight.shape[1]))
        q = self.weight.unflatten(-1, shape) / scale + self.offset.unflatten(-1, shape)
        if zero is not None:
            q = q + zero
        q = q + (q.round() - q).detach()
        q = q.clamp(self.scheme.qmin, self.scheme.qmax)
        return from_grid(q, scale, zero).flatten(-2)

    def clamp_(self, min_range: float) -> None:
        with torch.no_grad():
            self.offset.clamp_(-0.5, 0.5)
            for r in self.ratios:
                r.clamp_(min_range, 1.0)

    def result(self) -> QuantizedWeight:
        with torch.no_grad():
            scale, zero = self.qparams()
            q = quantize(self.weight, scale, zero, self.scheme, offset=self.offset)
        return QuantizedWeight(q, scale, zero, self.scheme)


def _all_windows(inputs: LayerInputs) -> tuple[torch.Tensor, dict]:
    """The calibration windows as one batch, and keyword arguments that fit any subset of them:
    a tensor with one row per window (a padding mask) is joined like the windows, anything
    else (rotary embeddings, position ids: one row for all) is shared."""
    hidden = torch.cat(inputs.hidden)
    kwargs = {}
    for key, first in inputs.kwargs[0].items():
        per_window = isinstance(first, torch.Tensor) and first.dim() > 0 and first.shape[0] == inputs.hidden[0].shape[0] > 1
        kwargs[key] = torch.cat([kw[key] for kw in inputs.kwargs]) if per_window else first
    return hidden, kwargs


def _rows(kwargs: dict, windows: int, idx: torch.Tensor) -> dict:
    return {k: v[idx] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == windows > 1 else v
            for k, v in kwargs.items()}


def learn_rounding(layer: torch.nn.Module, inputs: LayerInputs, plan: dict[str, QuantScheme],
                   config: SignRoundConfig = SignRoundConfig(), scale_dtype: torch.dtype | None = None,
                   where: str = "", parameters=None) -> tuple[dict[str, QuantizedWeight], dict]:
    """Quantize the Linears ``plan`` names in ``layer`` with learned offsets and ranges.

    ``parameters(name, weight, scheme, scale_dtype, config)``: what is learnt for one Linear on a
    grid other than lowbit's affine one (a GGUF type's: ``quant.gguf_signround.grid_parameters``).

    Leaves the layer's float weights as they were. Returns each Linear's quantized weight and
    one record for the layer: the loss (mean squared output error) at the first step and at
    the kept step, which step that was, and the seconds it took."""
    start = time.perf_counter()
    with torch.no_grad():
        target = torch.cat(inputs.target if inputs.target is not None else run_layer(layer, inputs)).float()
        # each token's weight in the loss: 1, or 1 / its reference's mean square ("relative")
        token_weight = 1 / target.pow(2).mean(-1, keepdim=True).clamp_min(1e-12) if config.loss == "relative" else None
    hidden, kwargs = _all_windows(inputs)
    windows = hidden.shape[0]
    linears = {n: layer.get_submodule(n) for n in plan}
    make = parameters or (lambda n, weight, scheme, dtype, config: _Rounding(weight, scheme, dtype, config))
    rounding = {n: make(n, linears[n].weight, plan[n], scale_dtype or linears[n].weight.dtype, config) for n in plan}
    lr = config.lr_scale / config.iters
    params = [p for r in rounding.values() for p in (r.params() if config.tune_range else [r.offset])]
    generator = torch.Generator().manual_seed(config.seed)
    first_loss = best_loss = None
    best_step, best = 0, [p.detach().clone() for p in params]
    frozen = [p for p in layer.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        with torch.enable_grad():
            bar = tqdm(range(config.iters), desc=f"{where}signround", unit="step", leave=False, disable=None)
            for step in bar:
                idx = torch.randperm(windows, generator=generator)[:config.batch_size]
                weights = {f"{n}.weight": r.fake_quantized().to(linears[n].weight.dtype) for n, r in rounding.items()}
                out = torch.func.functional_call(layer, weights, (hidden[idx],), _rows(kwargs, windows, idx))
                out = out[0] if isinstance(out, tuple) else out
                error = (out.float() - target[idx]).pow(2)
                loss = (error if token_weight is None else error * token_weight[idx]).mean()
                if not torch.isfinite(loss):
                    raise ValueError(f"{where.rstrip('.') or 'layer'}: the layer's output error became {float(loss)} at step {step}; "
                                     "its calibration inputs overflow, or lower signround.lr_scale")
                value = float(loss.detach())
                first_loss = value if first_loss is None else first_loss
                if best_loss is None or value < best_loss:
                    best_loss, best_step, best = value, step, [p.detach().clone() for p in params]
                grads = torch.autograd.grad(loss, params)
                with torch.no_grad():
                    step_lr = lr * (1 - step / config.iters)
                    for p, g in zip(params, grads):
                        p.sub_(step_lr * g.sign())
                for r in rounding.values():
                    r.clamp_(config.min_range)
                bar.set_postfix(loss=f"{value:.3g}")
    finally:
        for p in frozen:
            p.requires_grad_(True)
    with torch.no_grad():
        for p, b in zip(params, best):
            p.copy_(b)
    quantized = {n: r.result() for n, r in rounding.items()}
    record = {"loss_first": first_loss, "loss_best": best_loss, "best_step": best_step,
              "seconds": time.perf_counter() - start}
    return quantized, record
