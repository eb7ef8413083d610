"""Which Linear layers get quantized, and with which scheme.

A plan maps each Linear's full module name to a :class:`QuantScheme`; layers
absent from the plan stay in floating point. Patterns are exact module names,
dotted suffixes (``down_proj`` matches ``model.layers.0.mlp.down_proj``) or
``re:`` regular expressions matched against the full name.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, replace

import torch

from quant.affine import QuantScheme, fit_group_size
from quant.architectures import ARCHITECTURES
from quant.moe import EXPERT_LINEAR


def matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def _suffixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


class Patterns:
    """Many patterns (``matches``'s rules) compiled once, so a recipe's long ``ignore`` list costs a set
    lookup per dotted suffix of a name plus one regex: linear in layers, however many patterns it lists
    (500,000 of them took minutes one ``matches`` call at a time)."""

    def __init__(self, patterns):
        self.patterns = list(patterns)
        self.plain = {p for p in self.patterns if not p.startswith("re:")}
        self.regexes = [p[3:] for p in self.patterns if p.startswith("re:")]
        try:  # one alternation; each pattern alone when they cannot be joined (numbered backreferences)
            self.joined = [re.compile("|".join(f"(?:{r})" for r in self.regexes))] if self.regexes else []
        except re.error:
            self.joined = [re.compile(r) for r in self.regexes]

    def __contains__(self, name: str) -> bool:
        return (any(s in self.plain for s in _suffixes(name))
                or any(r.fullmatch(name) for r in self.joined))

    def unmatched(self, names: list[str]) -> list[str]:
        """The patterns no name matches, in their order."""
        suffixes = {s for n in names for s in _suffixes(n)}
        regexes = {r: re.compile(r) for r in self.regexes}

        def matches_none(p: str) -> bool:
            if p.startswith("re:"):
                return not any(regexes[p[3:]].fullmatch(n) for n in names)
            return p not in suffixes

        return [p for p in self.patterns if matches_none(p)]


@dataclass(frozen=True)
class Override:
    """Per-module change to the default scheme; later overrides win."""

    match: str
    bits: int | None = None
    group_size: int | None = None
    symmetric: bool | None = None
    skip: bool = False


class PlanError(ValueError):
    pass


def linear_names(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def check_group_fits(group: int, widths: set[int]) -> None:
    """A group that fits none of its layers' input widths would silently make every one of them
    per-channel (a smaller group that divides a width is fine: see fit_group_size): an error naming
    the sizes that would work."""
    if group == -1 or any(fit_group_size(w, group) != -1 for w in widths):
        return
    common = math.gcd(*widths)
    fitting = [str(d) for d in range(8, common + 1) if common % d == 0]
    raise PlanError(
        f"group_size {group} fits the input width of no layer it applies to ({', '.join(map(str, sorted(widths)))}); "
        f"use one that divides them all: {', '.join(fitting + ['-1 (per channel)'])}"
    )


def plan_layers(
    model: torch.nn.Module,
    default: QuantScheme,
    ignore: list[str] = (),
    overrides: list[Override] = (),
) -> dict[str, QuantScheme]:
    """Resolve the scheme of every Linear in ``model``; warn about patterns that match nothing."""
    # a family's gates stay in float whatever the recipe says (quant.architectures.float_linears)
    arch = ARCHITECTURES.get(getattr(getattr(model, "config", None), "model_type", None))
    names = [n for n in linear_names(model) if not (arch and any(matches(n, p) for p in arch.float_linears))]
    widths = {n: model.get_submodule(n).in_features for n in names}
    ignore = Patterns(ignore)
    unmatched = Patterns([*ignore.patterns, *(o.match for o in overrides)]).unmatched(names)
    for pattern in unmatched[:10]:
        warnings.warn(f"pattern {pattern!r} matches no Linear layer of the model", stacklevel=2)
    if len(unmatched) > 10:
        warnings.warn(f"{len(unmatched) - 10} more patterns match no Linear layer of the model", stacklevel=2)

    plan: dict[str, QuantScheme] = {}
    requested: dict[int, set[int]] = {}  # group size asked for -> input widths of the layers asking
    refitted = []
    for name in names:
        if name in ignore:
            continue
        scheme, skip = default, False
        for o in overrides:
            if matches(name, o.match):
                skip = o.skip
                changes = {k: v for k, v in (("bits", o.bits), ("group_size", o.group_size), ("symmetric", o.symmetric)) if v is not None}
                scheme = replace(scheme, **changes)
        if skip:
            continue
        requested.setdefault(scheme.group_size, set()).add(widths[name])
        group = fit_group_size(widths[name], scheme.group_size)
        if group != scheme.group_size:
            refitted.append(f"{name} ({widths[name]} inputs: group {scheme.group_size} -> {group})")
            scheme = replace(scheme, group_size=group)
        plan[name] = scheme
    if not plan:
        raise PlanError("nothing to quantize: every Linear layer is ignored or skipped by the recipe")
    for group, layer_widths in requested.items():
        check_group_fits(group, layer_widths)
    asymmetric = [n for n, s in plan.items() if not s.symmetric and EXPERT_LINEAR.fullmatch(n)]
    if asymmetric:
        warnings.warn(
            f"{len(asymmetric)} expert Linears are asymmetric: lowbit runs them, but transformers 5.23 "
            "cannot load asymmetric MoE experts (its expert dequantizer drops zero points); "
            "symmetric: true loads everywhere", stacklevel=2)
    if refitted:
        warnings.warn(
            "input width not divisible by the group size; compressed-tensors cannot store a ragged "
            f"last group, so these layers use a smaller group: {', '.join(refitted[:4])}"
            + (f" and {len(refitted) - 4} more" if len(refitted) > 4 else ""),
            stacklevel=2,
        )
    return plan
