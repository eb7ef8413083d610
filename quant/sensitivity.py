"""How much rounding each Linear would add to the loss: the pass a bits budget (``quant.budget``) reads.

Float forward and backward passes of the language-model loss over the calibration samples; at each
Linear, for every candidate scheme, the weight is rounded to nearest and the error at the Linear's
output weighed by the squared loss gradient there (the diagonal empirical Fisher):
``½ Σ_t Σ_j g_tj² (ΔW x_t)_j²`` per token, the loss that rounding is estimated to add
(:func:`measure_sensitivities`). The plain output energy ``tr(ΔW H ΔWᵀ)`` ranked wrongly
(bench/results/budget/curve-energy.txt: it does not compare across layers whose outputs differ in scale
and in how much the loss reads them); measured against it and the relative output error in
bench/results/budget/estimators.json. The pass changes no weight, so every Linear is measured on
the float model, whatever the others will get. It needs the whole model at once (a backward pass,
:func:`whole_model`): for an 8B model its float weights plus one pass's activations
(``PASS_TOKENS`` tokens, or one sample if longer), not one layer as the quantization pass does.

Then the check (:func:`check_largest`): the Linears with the largest estimates have the loss
measured with each alone rounded, and their estimates scaled to it: the second-order estimate can
miss by far where the loss reads a Linear's output non-linearly, and those few decide much of the
assignment (docs/budget.md).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from quant import methods as registry
from quant.affine import QuantScheme, fit_group_size
from quant.architectures import decoder_layers
from quant.sequential import move_data

# calibration tokens per forward and backward pass of the sensitivities: several short samples share one
# pass (each Linear is rounded once per pass), a long one goes alone; autograd's activations grow with it
PASS_TOKENS = 2048


@dataclass(frozen=True)
class Candidate:
    """One scheme a Linear may take: bits and group size (-1: per channel)."""

    bits: int
    group_size: int

    @property
    def label(self) -> str:
        return f"w{self.bits} " + ("per-channel" if self.group_size == -1 else f"g{self.group_size}")


def candidate_schemes(base: QuantScheme, width: int, candidates: list[Candidate]) -> dict[str, QuantScheme]:
    """Each candidate as a Linear of ``width`` inputs would store it (groups refitted as the plan does)."""
    return {c.label: replace(base, bits=c.bits, group_size=fit_group_size(width, c.group_size)) for c in candidates}


def fisher(grad: torch.Tensor, error: torch.Tensor) -> float:
    """Σ_t Σ_j g_tj² e_tj²: the diagonal empirical Fisher's weight on an error ``e`` at a Linear's output."""
    return float((grad ** 2 * error ** 2).sum())


def measure_sensitivities(model, plan: dict[str, QuantScheme], candidates: list[Candidate], samples: torch.Tensor,
                          scale_dtype: torch.dtype, device="cpu", lazy=None, progress: bool = True) -> dict:
    """{Linear: {candidate label: estimated rise of the mean next-token loss, nats per token}} of
    rounding that Linear alone to nearest at each candidate, from the diagonal empirical Fisher at its
    output: ``½ Σ_t Σ_j g_tj² (ΔW x_t)_j² / tokens`` (:func:`weigh_rounding`)."""
    sums, tokens = weigh_rounding(model, plan, candidates, samples, scale_dtype, device, lazy, progress)
    return {n: {k: v / (2 * tokens) for k, v in by_label.items()} for n, by_label in sums.items()}


def weigh_rounding(model, plan: dict[str, QuantScheme], candidates: list[Candidate], samples: torch.Tensor,
                   scale_dtype: torch.dtype, device="cpu", lazy=None, progress: bool = True) -> tuple[dict, int]:
    """({Linear: {candidate label: Σ_t Σ_j g_tj² (ΔW x_t)_j² over the calibration samples}}, tokens):
    :func:`fisher` of each candidate's rounding error at each planned Linear's output, in
    :func:`gradient_passes`."""
    sums = {n: {c.label: 0.0 for c in candidates} for n in plan}

    def weigh(name: str, linear: torch.nn.Linear, x: torch.Tensor, grad: torch.Tensor) -> None:
        for label, error in rounding_errors(linear.weight, x, plan[name], candidates, scale_dtype, name):
            sums[name][label] += fisher(grad, error)

    return sums, gradient_passes(model, plan, samples, weigh, device, lazy, progress)


def rounding_errors(weight: torch.Tensor, x: torch.Tensor, scheme: QuantScheme, candidates: list[Candidate],
                    scale_dtype: torch.dtype, name: str):
    """(candidate label, ``ΔW x``) for each candidate: the error at the Linear's output, for inputs ``x``
    (rows: tokens), of ``weight`` rounded to nearest at that candidate (groups refitted as the plan does)."""
    rtn = registry.get("rtn")
    weight = weight.detach()
    for label, candidate in candidate_schemes(scheme, weight.shape[1], candidates).items():
        rounded = rtn.round_linear(weight, candidate, None, scale_dtype, None, name).dequantize(torch.float32)
        yield label, x @ (weight.float() - rounded).T


def next_text_tokens(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The targets of the passes' loss: the text's own next tokens (the empirical Fisher)."""
    return ids[:, 1:].flatten()


def gradient_passes(model, plan: dict[str, QuantScheme], samples: torch.Tensor, at_output, device="cpu", lazy=None,
                    progress: bool = True, targets=next_text_tokens) -> int:
    """Float forward and backward passes of the next-token loss over ``samples``; at each planned
    Linear, ``at_output(name, linear, x, grad)`` with the batch's Linear input ``x`` and the loss
    gradient at its output ``grad`` (float32, rows: tokens). Returns the tokens scored.

    As many samples per pass as fit in ``PASS_TOKENS`` tokens (at least one): the loss is a sum over
    tokens with no sample reading another, so every token's gradient is what a pass of its sample
    alone gives. ``at_output`` runs inside the backward hook on the Linear's output, so only one
    Linear's inputs and gradients are held at a time besides autograd's own activations (a caller
    that rounds there rounds anew for each pass: keeping the rounded grids would hold one byte per
    weight and candidate for the whole model). The weights are left as they were; the whole model
    takes part (a lazily loaded one is filled for the passes and its decoder layers emptied again
    after). ``targets(logits, ids)``: what the loss is taken against (the text's next tokens)."""

    def watch(name: str, linear: torch.nn.Linear):
        def forward_hook(module, args, out):
            x = args[0].detach()
            out.register_hook(lambda grad: at_output(name, module, x.reshape(-1, x.shape[-1]).float(),
                                                     grad.detach().reshape(-1, grad.shape[-1]).float()))
        return linear.register_forward_hook(forward_hook)

    def track(module, args, out):  # the embeddings' output needs a gradient for any to flow back
        return out.detach().requires_grad_(True)

    hooks = [watch(n, model.get_submodule(n)) for n in plan]
    hooks.append(model.get_input_embeddings().register_forward_hook(track))
    wanted = {p: p.requires_grad for p in model.parameters()}
    tokens = 0
    try:
        for p in wanted:
            p.requires_grad_(False)
        with whole_model(model, lazy, device), torch.enable_grad():
            per_pass = max(1, PASS_TOKENS // samples.shape[1])
            for ids in tqdm(samples.split(per_pass), desc="sensitivities", unit="pass", disable=not progress):
                ids = ids.to(device)
                logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float().flatten(0, 1)
                loss = torch.nn.functional.cross_entropy(logits, targets(logits, ids), reduction="sum")
                loss.backward()
                tokens += ids[:, 1:].numel()
    finally:
        for h in hooks:
            h.remove()
        for p, flag in wanted.items():
            p.requires_grad_(flag)
    return tokens


@contextmanager
def whole_model(model, lazy=None, device="cpu"):
    """The whole model on ``device`` for the block: a lazily loaded one's decoder layers filled, and
    emptied again after (the quantization pass reads each anew); the data moved back where it was.
    Inside another such block (``lazy=None``) it only moves what is already there."""
    prefix, layers = decoder_layers(model)
    home = next(p.device for p in model.parameters() if not p.is_meta)
    for i, layer in enumerate(layers if lazy is not None else ()):
        lazy.fill(layer, f"{prefix}.{i}.", device)
    move_data(model, torch.device(device))
    try:
        yield
    finally:
        for layer in layers if lazy is not None else ():
            for module in layer.modules():
                for key, param in module._parameters.items():
                    if param is not None:
                        module._parameters[key] = torch.nn.Parameter(param.detach().to("meta"), requires_grad=False)
        move_data(model, home)


def mean_loss(model, samples: torch.Tensor, device="cpu") -> float:
    """The model's mean next-token loss (nats) over the samples, ``PASS_TOKENS`` tokens a batch."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for ids in samples.split(max(1, PASS_TOKENS // samples.shape[1])):
            ids = ids.to(device)
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
            total += float(loss)
            tokens += ids[:, 1:].numel()
    return total / tokens


def check_largest(model, plan: dict[str, QuantScheme], losses: dict, candidates: list[Candidate], base: Candidate,
                  samples: torch.Tensor, scale_dtype, count: int, device="cpu") -> tuple[dict, dict]:
    """The estimate where it weighs most, checked by measurement: for the ``count`` Linears with the
    largest estimated loss at ``base``, the model's real mean loss over ``samples`` with that Linear
    alone rounded at ``base`` against the float model's; each one's estimates (every candidate)
    scaled by measured / estimated (none below 0). Returns (losses so corrected, {Linear: {"estimated",
    "measured"}}).

    Why: the second-order estimate can miss by far on a Linear whose output the loss reads
    non-linearly; on SmolLM2 layer 11's down_proj (it writes the outsized activations) it estimates
    W4's rounding at +0.064 nats where the model measures -0.014 (docs/budget.md), and the budget bought
    it 8 bits with 3-bit MLPs elsewhere. The few largest estimates decide most of the assignment, and
    a rise that large is measurable on the calibration tokens."""
    rtn = registry.get("rtn")
    chosen = sorted(losses, key=lambda n: (-losses[n][base.label], n))[:count]
    floor = mean_loss(model, samples, device)
    corrected, record = dict(losses), {}
    for name in chosen:
        linear = model.get_submodule(name)
        weight = linear.weight.detach().clone()
        scheme = candidate_schemes(plan[name], linear.in_features, [base])[base.label]
        with torch.no_grad():
            rounded = rtn.round_linear(weight, scheme, None, scale_dtype, None, name)
            linear.weight.copy_(rounded.dequantize(weight.dtype))
        try:
            measured = mean_loss(model, samples, device) - floor
        finally:
            with torch.no_grad():
                linear.weight.copy_(weight)
        estimated = losses[name][base.label]
        factor = max(measured, 0.0) / estimated if estimated > 0 else 1.0
        corrected[name] = {k: v * factor for k, v in losses[name].items()}
        record[name] = {"estimated": estimated, "measured": measured}
    return corrected, record
