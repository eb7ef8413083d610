"""A bits budget (``weights.target_bits``): each Linear's precision chosen from its measured sensitivity.

1. Sensitivities (``quant.sensitivity``): for each Linear and candidate, the loss that rounding it
   to nearest is estimated to add (the diagonal empirical Fisher at its output, from float forward
   and backward passes over the calibration samples, the whole model at once), then the
   ``CHECKED_LINEARS`` largest estimates checked by measurement over ``CHECK_TOKENS`` calibration
   tokens and scaled to it.
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

import torch

from quant.affine import QuantScheme
from quant.format import stored_bytes
from quant.sensitivity import Candidate, candidate_schemes, check_largest, measure_sensitivities, whole_model

# The default candidates: 3 and 4 bits at groups 32, 64 and 128 (and the recipe's), 8 bits at the recipe's
# group size; no 2 bits. Measured (bench/results/budget/NOTES.md, candidates.json): the Fisher estimate,
# second order about the float model, prices widths against each other wrongly (2-bit damage understated,
# 4-bit overstated), so trades across widths lose; steps within a width (group sizes) it prices well enough.
DEFAULT_BITS = (3, 4)
DEFAULT_GROUPS = (32, 64, 128)
WIDEST_BITS = 8
MAX_TARGET_BITS = 8
# the Linears whose estimates are checked by measurement (check_largest), and the calibration tokens the
# check reads (each checked Linear costs one forward pass over them): bench/results/budget/check16*.json
CHECKED_LINEARS = 8
CHECK_TOKENS = 8192


class BudgetError(ValueError):
    """A budget no assignment meets, or a plan the budget cannot price."""


def default_candidates(group_sizes) -> list[Candidate]:
    """3 and 4 bits at groups 32, 64, 128 and each of the recipe's group sizes; 8 bits at the recipe's."""
    groups = list(dict.fromkeys([*DEFAULT_GROUPS, *group_sizes]))
    return [Candidate(b, g) for b in DEFAULT_BITS for g in groups] + [Candidate(WIDEST_BITS, g)
                                                                      for g in dict.fromkeys(group_sizes)]


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


def _served_costs(costs: dict, plan: dict[str, QuantScheme], model, candidates: list[Candidate], refuse) -> dict:
    """``costs`` without the candidates ``refuse`` rules out per Linear; a Linear left with none is an error."""
    out = {}
    for name, by_label in costs.items():
        schemes = candidate_schemes(plan[name], model.get_submodule(name).in_features, candidates)
        reasons = {k: refuse(name, schemes[k]) for k in by_label}
        out[name] = {k: v for k, v in by_label.items() if reasons[k] is None}
        if not out[name]:
            raise BudgetError(f"{name}: no candidate can be served: " + "; ".join(f"{k}: {r}" for k, r in reasons.items()))
    return out


def _assign_tied(costs: dict, losses: dict, budget: int, tied: list[list[str]]) -> dict:
    """:func:`assign` with each group of ``tied`` chosen as one item (costs and losses summed over the
    candidates all of its Linears may take), the choice then given to each."""
    costs, losses = dict(costs), dict(losses)
    for group in tied:
        labels = set.intersection(*(set(costs[n]) for n in group))
        if not labels:
            raise BudgetError(f"{', '.join(group)} must share a scheme, but no candidate suits them all")
        costs[group[0]] = {k: sum(costs[n][k] for n in group) for k in labels}
        losses[group[0]] = {k: sum(losses[n][k] for n in group) for k in labels}
        for n in group[1:]:
            del costs[n], losses[n]
    result = assign(costs, losses, budget)
    for group in tied:
        result["choice"].update(dict.fromkeys(group[1:], result["choice"][group[0]]))
    return result


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
                   progress: bool = True, refuse=None, tied=()) -> tuple[dict[str, QuantScheme], dict]:
    """The plan with each unpinned Linear's scheme chosen under ``target_bits``, and the record
    (sensitivities, costs, choice) the manifest keeps. ``pinned`` Linears (an override gave their
    bits) keep their scheme; their bits count against the budget. ``refuse(name, scheme)``: why a
    Linear may not take a candidate (a recipe's ``serve_with``, ``quant.engines``), None when it may;
    ``tied``: groups of Linears that must take one candidate (an engine runs them as one matmul)."""
    free = {n: s for n, s in plan.items() if n not in pinned}
    if not free:
        raise BudgetError("weights.target_bits: every quantized Linear has its bits from an override; "
                          "nothing is left for the budget to place")
    params = sum(model.get_submodule(n).weight.numel() for n in plan)
    pinned_bits = sum(8 * stored_bytes(tuple(model.get_submodule(n).weight.shape), plan[n], scale_dtype)
                      for n in plan if n in pinned)
    costs = linear_costs(model, free, candidates, scale_dtype)
    if refuse is not None:
        costs = _served_costs(costs, free, model, candidates, refuse)
    check_budget(target_bits, costs, pinned_bits, params)
    start = time.perf_counter()
    base = check_base(candidates, free)
    with whole_model(model, lazy, device):
        losses = measure_sensitivities(model, free, candidates, samples, scale_dtype, device, None, progress)
        losses, checked = check_largest(model, free, losses, candidates, base,
                                        samples[:max(1, CHECK_TOKENS // samples.shape[1])], scale_dtype,
                                        CHECKED_LINEARS, device)
    seconds = time.perf_counter() - start
    result = _assign_tied(costs, losses, int(target_bits * params) - pinned_bits, [g for g in tied if set(g) <= set(free)])
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
