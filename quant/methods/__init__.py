"""The weight-quantization methods, one file each, found by name.

Every module in this package (its name not starting with ``_``) defines ``METHOD``, a
:class:`Method` that declares:

- ``name``: what a recipe writes in ``weights.methods``;
- ``settings``: a frozen dataclass of its settings (``weights.<name>:`` in a recipe; the
  recipe checks each key against its field's default type and ``choices``);
- ``needs_data``: whether it reads calibration inputs;
- ``stage``: ``"layer"`` for a step that rewrites a decoder layer's float weights before they
  are rounded (AWQ's scales and clipping; ``prepare_layer``), ``"round"`` for the step that
  turns one Linear into integers (``round_linear``), or all of a decoder layer's Linears at
  once against the layer's output (``round_layer``: learned rounding);
- ``statistics``: what the lockstep pass gathers for ``round_linear`` from the inputs that
  reach each Linear (``"hessian"``: ``H = 2/n Σ xᵀx``; None: nothing, no pass cost;
  ``"layer"``: the decoder layer's own inputs, for ``round_layer``).

A recipe lists methods in order, layer steps first and at most one rounding method last
(none: RTN rounds). Adding a method is one file here plus its tests, e.g. ``quant/methods/mine.py``::

    @dataclass(frozen=True)
    class MySettings:
        steps: int = 10

    def round_linear(weight, scheme, settings, scale_dtype, stats, name):
        ...  # return a QuantizedWeight

    METHOD = Method("mine", MySettings, needs_data=False, stage="round", round_linear=round_linear)
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable

from quant.names import did_you_mean

STAGES = ("layer", "round")  # the order steps run in


class MethodError(ValueError):
    """An unknown method, methods that cannot follow each other, or settings for a method not used."""


@dataclass(frozen=True)
class Method:
    name: str
    settings: type
    needs_data: bool
    stage: str
    statistics: str | None = None
    # stage "layer": (layer, inputs, plan, settings, arch) -> {Linear: input-channel scale s} for
    # each Linear whose inputs it divided by s (its Hessian then transforms as H ∘ (s sᵀ))
    prepare_layer: Callable | None = None
    # stage "round": (weight, scheme, settings, scale_dtype, stats, name) -> QuantizedWeight;
    # ``stats`` is what ``statistics`` names for this Linear (None when it names nothing)
    round_linear: Callable | None = None
    # stage "round", whole layer: (layer, inputs, plan, settings, scale_dtype, where) ->
    # ({Linear: QuantizedWeight}, a record for the manifest); Linears outside the decoder layers
    # (a quantized lm_head) are then rounded by RTN
    round_layer: Callable | None = None
    # stage "round": settings -> the act-order the plan's schemes carry (None: column order)
    actorder: Callable = lambda settings: None
    # stage "round", whole layer: settings -> whether it learns against the float model's own
    # output of each layer (the pipeline then carries the float model's activations beside the
    # quantized ones: ``LayerInputs.target``)
    float_stream: Callable = lambda settings: False
    choices: dict = field(default_factory=dict)  # settings field -> its allowed values
    # whether its statistics are summed across torchrun ranks (quant.distributed); a method that
    # learns from its own captures without that would differ with the number of ranks
    ranks: bool = True

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"method {self.name}: stage must be one of {', '.join(STAGES)}, not {self.stage!r}")
        step = self.prepare_layer if self.stage == "layer" else self.round_linear or self.round_layer
        if step is None:
            raise ValueError(f"method {self.name}: a {self.stage!r} method needs its "
                             f"{'prepare_layer' if self.stage == 'layer' else 'round_linear or round_layer'}")
        if self.round_layer is not None and (self.statistics != "layer" or not self.needs_data):
            raise ValueError(f"method {self.name}: round_layer reads the layer's inputs: needs_data=True, "
                             f"statistics='layer'")


def _discover() -> dict[str, Method]:
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        method = importlib.import_module(f"{__name__}.{info.name}").METHOD
        found[method.name] = method
    return found


REGISTRY: dict[str, Method] = _discover()
DEFAULT_ROUNDING = "rtn"  # rounds when a list names no rounding method


def get(name: str) -> Method:
    if name not in REGISTRY:
        raise MethodError(f"unknown method {name!r}{did_you_mean(name, REGISTRY)}; known methods: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def parse_names(spec) -> list[str]:
    """A method list from a list of names or the older one-string form (``"awq+gptq"``)."""
    names = spec.split("+") if isinstance(spec, str) else list(spec)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise MethodError(f"expected a non-empty list of method names, got {spec!r}")
    return names


def chain(names) -> list[Method]:
    """The methods ``names`` lists, checked: known, each once, layer steps before the one rounding
    method, which comes last; RTN appended when none rounds."""
    methods = [get(n) for n in parse_names(names)]
    seen = set()
    for i, m in enumerate(methods):
        if m.name in seen:
            raise MethodError(f"method {m.name} is listed twice")
        seen.add(m.name)
        if i > 0 and methods[i - 1].stage == "round":
            what = "a second rounding method" if m.stage == "round" else f"a {m.stage} step"
            raise MethodError(f"{m.name} cannot follow {methods[i - 1].name}: {methods[i - 1].name} rounds the "
                              f"weights, so {what} after it has nothing left to work on; list "
                              f"layer steps first and one rounding method last")
    if methods[-1].stage != "round":
        methods.append(get(DEFAULT_ROUNDING))
    return methods


def check_settings(methods: list[Method], settings: dict) -> dict:
    """``settings`` (method name -> its settings object) completed with defaults for every method
    in ``methods``; settings for a method not among them are an error (they would do nothing)."""
    names = [m.name for m in methods]
    unused = sorted(set(settings) - set(names))
    if unused:
        raise MethodError(f"settings for {', '.join(unused)}, which the method list ({', '.join(names)}) "
                          f"does not use; add the method or remove its settings")
    done = {}
    for m in methods:
        given = settings.get(m.name)
        if given is not None and not isinstance(given, m.settings):
            raise MethodError(f"settings for {m.name} must be a {m.settings.__name__}, got {type(given).__name__}")
        done[m.name] = given if given is not None else m.settings()
    return done
