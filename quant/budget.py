"""A bits budget (``weights.target_bits``): each Linear's precision chosen from its measured sensitivity.

1. Sensitivities. Float forward and backward passes of the language-model loss over the calibration
   samples; at each Linear, for every candidate scheme, the weight is rounded to nearest and the error
   at the Linear's output weighed by the squared loss gradient there (the diagonal empirical Fisher):
   ``½ Σ_t Σ_j g_tj² (ΔW x_t)_j²`` per token, the loss that rounding is estimated to add. The plain
   output energy ``tr(ΔW H ΔWᵀ)`` ranked wrongly (bench/results/budget-curve-cpu.txt: it does not
   compare across layers whose outputs differ in scale and in how much the loss reads them); measured
   against it and the relative output error in bench/results/budget-estimators-cpu.json. The pass changes
   no weight, so every Linear is measured on the float model, whatever the others will get. It needs
   the whole model at once (a backward pass): for an 8B model its float weights plus one pass's
   activations (``PASS_TOKENS`` tokens, or one sample if longer), not one layer as the quantization
   pass does. Then the check: for the ``CHECKED_LINEARS`` Linears with the largest estimates, the
   loss is measured with each alone rounded (one forward pass over ``CHECK_TOKENS`` calibration
   tokens each) and their estimates scaled to it (:func:`check_largest`): the second-order estimate
   can miss by far where the loss reads a Linear's output non-linearly, and those few decide much
   of the assignment (README).
2. Assignment. Each Linear takes one candidate; the summed estimated loss is minimized under the
   budget, a multiple-choice knapsack solved by its Lagrangian: every Linear's candidates reduced to
   their lower convex hull of (bits, loss), then the upgrade steps with the most loss saved per bit
   taken first while they fit (the LP relaxation's order, so the result is within one step of its
   bound, recorded as ``lower_bound``), and the bits left over spent on whichever single change
   saves most. Ties break by name: the same inputs give the same assignment.
3. The pipeline then quantizes as usual with the chosen per-Linear schemes; the choice goes into the
   manifest's recipe as ordinary per-Linear overrides.

Cost is priced by ``quant.format.stored_bytes``: packed values, scales and zero points, the figure
``lowbit eval`` reports as bits/weight.
"""

from __future__ import annotations

import heapq
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from quant import methods as registry
from quant.affine import QuantScheme, fit_group_size
from quant.architectures import decoder_layers
from quant.format import stored_bytes
from quant.sequential import move_data

# The default candidates: 3 and 4 bits at groups 32, 64 and 128 (and the recipe's), 8 bits at the recipe's
# group size; no 2 bits. Measured (README, bench/results/budget-candidates-cpu.json): the Fisher estimate,
# second order about the float model, prices widths against each other wrongly (2-bit damage understated,
# 4-bit overstated), so trades across widths lose; steps within a width (group sizes) it prices well enough.
DEFAULT_BITS = (3, 4)
DEFAULT_GROUPS = (32, 64, 128)
WIDEST_BITS = 8
MAX_TARGET_BITS = 8
# calibration tokens per forward and backward pass of the sensitivities: several short samples share one
# pass (each Linear is rounded once per pass), a long one goes alone; autograd's activations grow with it
PASS_TOKENS = 2048
# the Linears whose estimates are checked by measurement (check_largest), and the calibration tokens the
# check reads (each checked Linear costs one forward pass over them): bench/results/budget-check16*-cpu.json
CHECKED_LINEARS = 8
CHECK_TOKENS = 8192
# what the pass's loss is taken against: the text's next tokens, or the float model's own draws
LABELS = ("data", "model")


class BudgetError(ValueError):
    """A budget no assignment meets, or a plan the budget cannot price."""


@dataclass(frozen=True)
class Candidate:
    """One scheme a Linear may take: bits and group size (-1: per channel)."""

    bits: int
    group_size: int

    @property
    def label(self) -> str:
        return f"w{self.bits} " + ("per-channel" if self.group_size == -1 else f"g{self.group_size}")


def default_candidates(group_sizes) -> list[Candidate]:
    """3 and 4 bits at groups 32, 64, 128 and each of the recipe's group sizes; 8 bits at the recipe's."""
    groups = list(dict.fromkeys([*DEFAULT_GROUPS, *group_sizes]))
    return [Candidate(b, g) for b in DEFAULT_BITS for g in groups] + [Candidate(WIDEST_BITS, g)
                                                                      for g in dict.fromkeys(group_sizes)]


def candidate_schemes(base: QuantScheme, width: int, candidates: list[Candidate]) -> dict[str, QuantScheme]:
    """Each candidate as a Linear of ``width`` inputs would store it (groups refitted as the plan does)."""
    return {c.label: replace(base, bits=c.bits, group_size=fit_group_size(width, c.group_size)) for c in candidates}


# ------------------------------------------------------------------ sensitivities

def fisher(x: torch.Tensor, grad: torch.Tensor, error: torch.Tensor) -> float:
    """Σ_t Σ_j g_tj² e_tj²: the diagonal empirical Fisher's weight on an error ``e`` at a Linear's output."""
    return float((grad ** 2 * error ** 2).sum())


def measure_sensitivities(model, plan: dict[str, QuantScheme], candidates: list[Candidate], samples: torch.Tensor,
                          scale_dtype: torch.dtype, device="cpu", lazy=None, progress: bool = True) -> dict:
    """{Linear: {candidate label: estimated rise of the mean next-token loss, nats per token}} of
    rounding that Linear alone to nearest at each candidate, from the diagonal empirical Fisher at its
    output: ``½ Σ_t Σ_j g_tj² (ΔW x_t)_j² / tokens`` (:func:`weigh_rounding`)."""
    sums, tokens = weigh_rounding(model, plan, candidates, samples, scale_dtype, device, lazy, progress)
    return {n: {k: v / (2 * tokens) for k, v in by_label.items()} for n, by_label in sums["fisher"].items()}


def weigh_rounding(model, plan: dict[str, QuantScheme], candidates: list[Candidate], samples: torch.Tensor,
                   scale_dtype: torch.dtype, device="cpu", lazy=None, progress: bool = True,
                   measures: dict | None = None, labels: str = "data",
                   float_weights: dict | None = None) -> tuple[dict, int]:
    """({measure: {Linear: {candidate label: Σ over the calibration batches}}}, tokens) where each of
    ``measures`` (default: :func:`fisher`) maps a batch's Linear input ``x``, loss gradient at its
    output ``g`` and round-to-nearest's error there ``ΔW x`` (rows: tokens) to a number.

    Float forward and backward passes over the samples, as many per pass as fit in ``PASS_TOKENS``
    tokens (at least one): the loss is a sum over tokens with no sample reading another, so every
    token's gradient is what a pass of its sample alone gives. Each Linear's candidates are weighed
    inside the backward hook on its output, rounded there anew for each pass (rounding reads no data;
    keeping the rounded grids instead would hold one byte per weight and candidate for the whole
    model); only one Linear's float rounding error is held at a time besides autograd's own
    activations. The weights are left as they were; the whole model takes part (a lazily loaded one
    is filled for the pass and its decoder layers emptied again after).

    ``labels``: ``data``, the loss of the text's own next tokens (the empirical Fisher); ``model``,
    of next tokens drawn from the model's own prediction at each position (seeded), whose squared
    gradients average to the model's Fisher: on the float model the estimate is then of the rise of
    the KL divergence from its predictions, whatever the text's next token is.

    ``float_weights`` ({Linear: float weight}): the model runs with the weights it holds (say, an
    assignment already rounded), and each named Linear's candidates are rounded from its float weight
    there: the same error, weighed by the inputs and gradients of the rounded model."""
    if labels not in LABELS:
        raise ValueError(f"labels must be one of {', '.join(LABELS)}, got {labels!r}")
    measures = measures or {"fisher": fisher}
    draw = torch.Generator().manual_seed(0)
    rtn = registry.get("rtn")
    sums = {m: {n: {c.label: 0.0 for c in candidates} for n in plan} for m in measures}

    def weigh(name: str, linear: torch.nn.Linear, x: torch.Tensor, grad: torch.Tensor) -> None:
        weight = (float_weights or {}).get(name, linear.weight).detach()
        x, grad = x.reshape(-1, x.shape[-1]).float(), grad.reshape(-1, grad.shape[-1]).float()
        for label, scheme in candidate_schemes(plan[name], linear.in_features, candidates).items():
            delta = weight.float() - rtn.round_linear(weight, scheme, None, scale_dtype, None, name).dequantize(torch.float32)
            error = x @ delta.T
            for measure, fn in measures.items():
                sums[measure][name][label] += fn(x, grad, error)

    def watch(name: str, linear: torch.nn.Linear):
        def forward_hook(module, args, out):
            x = args[0].detach()
            out.register_hook(lambda grad: weigh(name, module, x, grad.detach()))
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
                targets = next_tokens(logits, ids, labels, draw)
                loss = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
                loss.backward()
                tokens += ids[:, 1:].numel()
    finally:
        for h in hooks:
            h.remove()
        for p, flag in wanted.items():
            p.requires_grad_(flag)
    return sums, tokens


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


def next_tokens(logits: torch.Tensor, ids: torch.Tensor, labels: str, draw: torch.Generator) -> torch.Tensor:
    """The targets of the pass's loss: the text's next tokens, or tokens drawn from the model's logits."""
    if labels == "data":
        return ids[:, 1:].flatten()
    probs = torch.softmax(logits.detach(), -1).cpu()
    return torch.multinomial(probs, 1, generator=draw).flatten().to(logits.device)


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
    W4's rounding at +0.064 nats where the model measures -0.014 (README), and the budget bought
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


# ------------------------------------------------------------------ assignment

def _hull(options: list[tuple[int, float, str]]) -> list[tuple[int, float, str]]:
    """The lower convex hull of (cost, loss, label), cheapest first: the choices a Lagrangian can make."""
    best = []
    for cost, loss, label in sorted(options, key=lambda o: (o[0], o[1], o[2])):
        if best and loss >= best[-1][1]:
            continue  # costs more and saves nothing
        while len(best) >= 2:
            (c0, l0, _), (c1, l1, _) = best[-2], best[-1]
            # drop the middle point when the line from best[-2] to this one passes below it
            if (l0 - l1) * (cost - c0) <= (l0 - loss) * (c1 - c0):
                best.pop()
            else:
                break
        best.append((cost, loss, label))
    return best


def assign(costs: dict[str, dict[str, int]], losses: dict[str, dict[str, float]], budget: int) -> dict:
    """The candidate of each Linear minimizing the summed loss with the summed cost (bits) within ``budget``.

    Returns {"choice": {Linear: label}, "cost", "loss", "lower_bound"}; a BudgetError when even the
    cheapest candidates do not fit."""
    names = sorted(costs)
    options = {n: [(costs[n][k], losses[n][k], k) for k in sorted(costs[n])] for n in names}
    hulls = {n: _hull(options[n]) for n in names}
    step = dict.fromkeys(names, 0)
    spent = sum(hulls[n][0][0] for n in names)
    if spent > budget:
        raise BudgetError(f"the cheapest candidates need {spent} bits, the budget has {budget}")
    queue = []

    def push(n: str) -> None:
        i = step[n]
        if i + 1 < len(hulls[n]):
            (c0, l0, _), (c1, l1, _) = hulls[n][i], hulls[n][i + 1]
            heapq.heappush(queue, (-(l0 - l1) / (c1 - c0), n))

    for n in names:
        push(n)
    bound = None
    while queue:
        _, n = heapq.heappop(queue)
        (c0, l0, _), (c1, l1, _) = hulls[n][step[n]], hulls[n][step[n] + 1]
        if spent + c1 - c0 > budget:
            if bound is None:  # the LP relaxation takes this step in part and stops: no assignment does better
                total = sum(hulls[m][step[m]][1] for m in names)
                bound = total - (l0 - l1) * (budget - spent) / (c1 - c0)
            continue  # this Linear's further hull points cost still more
        spent += c1 - c0
        step[n] += 1
        push(n)
    choice = {n: hulls[n][step[n]][2] for n in names}
    spent = _spend_leftover(options, choice, costs, losses, budget, spent)
    loss = sum(losses[n][choice[n]] for n in names)
    return {"choice": choice, "cost": spent, "loss": loss, "lower_bound": loss if bound is None else min(bound, loss)}


def _spend_leftover(options, choice: dict, costs, losses, budget: int, spent: int) -> int:
    """Bits the hull steps left unused: make the single change (any candidate) that saves the most
    loss and still fits, until none does."""
    while True:
        best = None
        for n, opts in options.items():
            here_cost, here_loss = costs[n][choice[n]], losses[n][choice[n]]
            for cost, loss, label in opts:
                if loss < here_loss and spent + cost - here_cost <= budget:
                    gain = (here_loss - loss, n, label)
                    best = gain if best is None or gain[0] > best[0] else best
        if best is None:
            return spent
        _, n, label = best
        spent += costs[n][label] - costs[n][choice[n]]
        choice[n] = label


# ------------------------------------------------------------------ the pipeline's step

def linear_costs(model, plan: dict[str, QuantScheme], candidates: list[Candidate], scale_dtype) -> dict:
    """{Linear: {candidate label: bits stored}}, as ``lowbit eval`` counts them."""
    out = {}
    for name, scheme in plan.items():
        linear = model.get_submodule(name)
        shape = (linear.out_features, linear.in_features)
        out[name] = {label: 8 * stored_bytes(shape, s, scale_dtype)
                     for label, s in candidate_schemes(scheme, shape[1], candidates).items()}
    return out


def check_budget(target_bits: float, costs: dict, pinned_bits: int, params: int) -> None:
    """Refuse, before the calibration pass, a target no assignment of these candidates meets."""
    if target_bits > MAX_TARGET_BITS:
        raise BudgetError(f"weights.target_bits {target_bits:g} is above {MAX_TARGET_BITS} bits per weight; use "
                          "weights.bits: 8 for every Linear, or keep Linears in floating point with weights.ignore")
    cheapest = {n: min(c, key=lambda k: (c[k], k)) for n, c in costs.items()}
    least = (pinned_bits + sum(costs[n][k] for n, k in cheapest.items())) / params
    if target_bits < least:
        labels = sorted(set(cheapest.values()))
        raise BudgetError(f"weights.target_bits {target_bits:g} is below the smallest assignment the candidates "
                          f"allow, {least:.3f} bits per weight (every Linear it places at {', '.join(labels)}"
                          + (", those an override sets as set" if pinned_bits else "")
                          + ", scales and zero points included); raise target_bits or add a cheaper candidate to "
                            "weights.candidates")


def check_base(candidates: list[Candidate], plan: dict[str, QuantScheme]) -> Candidate:
    """The candidate the check rounds at: the widest below 8 bits, at the plan's most common group
    size when that is among them (4 bits at the recipe's group for the default candidates)."""
    narrow = [c for c in candidates if c.bits < WIDEST_BITS] or candidates
    at_width = [c for c in narrow if c.bits == max(c.bits for c in narrow)]
    groups = [s.group_size for s in plan.values()]
    common = max(set(groups), key=lambda g: (groups.count(g), g))
    return next((c for c in at_width if c.group_size == common), at_width[0])


def choose_schemes(model, plan: dict[str, QuantScheme], pinned: set[str], target_bits: float,
                   candidates: list[Candidate], samples: torch.Tensor, scale_dtype, device="cpu", lazy=None,
                   progress: bool = True) -> tuple[dict[str, QuantScheme], dict]:
    """The plan with each unpinned Linear's scheme chosen under ``target_bits``, and the record
    (sensitivities, costs, choice) the manifest keeps. ``pinned`` Linears (an override gave their
    bits) keep their scheme; their bits count against the budget."""
    free = {n: s for n, s in plan.items() if n not in pinned}
    if not free:
        raise BudgetError("weights.target_bits: every quantized Linear has its bits from an override; "
                          "nothing is left for the budget to place")
    params = sum(model.get_submodule(n).weight.numel() for n in plan)
    pinned_bits = sum(8 * stored_bytes(tuple(model.get_submodule(n).weight.shape), plan[n], scale_dtype)
                      for n in plan if n in pinned)
    costs = linear_costs(model, free, candidates, scale_dtype)
    check_budget(target_bits, costs, pinned_bits, params)
    start = time.perf_counter()
    base = check_base(candidates, free)
    with whole_model(model, lazy, device):
        losses = measure_sensitivities(model, free, candidates, samples, scale_dtype, device, None, progress)
        losses, checked = check_largest(model, free, losses, candidates, base,
                                        samples[:max(1, CHECK_TOKENS // samples.shape[1])], scale_dtype,
                                        CHECKED_LINEARS, device)
    seconds = time.perf_counter() - start
    result = assign(costs, losses, int(target_bits * params) - pinned_bits)
    schemes = {n: candidate_schemes(free[n], model.get_submodule(n).in_features, candidates) for n in free}
    chosen = {n: schemes[n][result["choice"][n]] if n in free else s for n, s in plan.items()}
    record = {
        "target_bits": target_bits,
        "bits_per_weight": (result["cost"] + pinned_bits) / params,
        "candidates": [c.label for c in candidates],
        "estimator": f"fisher, the {len(checked)} largest at {base.label} checked by measurement",
        "sensitivity": "rise of the mean next-token loss (nats/token) estimated for rounding the Linear alone "
                       "to nearest at each candidate: ½ Σ g² (ΔW x)² over the calibration tokens, x its input and "
                       "g the loss gradient at its output (diagonal empirical Fisher, float model); the Linears in "
                       "'checked' scaled to the rise measured with each alone rounded at the check's candidate",
        "estimated_loss": result["loss"],
        "lower_bound": result["lower_bound"],
        "sensitivity_s": seconds,
        "checked": checked,
        "pinned": sorted(pinned & set(plan)),
        "layers": {n: {"choice": result["choice"][n], "loss": losses[n],
                       "bits_per_weight": {k: v / model.get_submodule(n).weight.numel() for k, v in costs[n].items()}}
                   for n in sorted(free)},
    }
    return chosen, record
