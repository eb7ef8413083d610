"""The recipe: a YAML file saying which model to compress, how, and where to put it.

This module holds what a recipe is (its sections as dataclasses, ``to_dict``, the default output
path); ``lowbit.recipe_parse`` checks a parsed mapping key by key into a ``Recipe``;
``lowbit.recipe_files`` finds a recipe file (or a bundled one by name) and reads its YAML.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvquant.scheme import KVScheme
from quant import methods as registry
from quant.affine import QuantScheme
from quant.budget import Candidate, default_candidates
from quant.plan import Override  # a recipe's overrides are the plan's: one definition

DTYPES = ("auto", "float16", "bfloat16", "float32")


class RecipeError(ValueError):
    """A recipe problem, with the file and key path in the message."""


@dataclass
class Calibration:
    text: str = "default"  # default | .txt/.jsonl path | datasets name
    samples: int = 128
    seq_len: int = 512
    seed: int = 0
    bos: bool | None = None  # begin each window with the tokenizer's BOS; None: where it adds one to prompts


@dataclass
class Weights:
    methods: list[str] = field(default_factory=lambda: ["rtn"])  # in order: quant.methods
    bits: int = 4
    group_size: int = 64
    symmetric: bool = False
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    overrides: list[Override] = field(default_factory=list)
    # a bits budget instead of one ``bits``: bits per weight of the quantized Linears (quant.budget)
    target_bits: float | None = None
    candidates: list[Candidate] = field(default_factory=list)  # empty: quant.budget.default_candidates
    # each method's settings by its name (``weights.gptq:`` in YAML), defaults filled in
    settings: dict = field(default_factory=dict)

    def __post_init__(self):
        self.settings = registry.check_settings(self.chain, self.settings)

    @property
    def chain(self) -> list:
        """The methods in the order they run (RTN rounds when none listed does)."""
        return registry.chain(self.methods)

    @property
    def budget_candidates(self) -> list[Candidate]:
        """The schemes a bits budget chooses from: ``candidates``, or 3/4 bits at groups 32/64/128 and 8 bits (quant.budget)."""
        groups = [self.group_size] + [o.group_size for o in self.overrides if o.group_size is not None]
        return self.candidates or default_candidates(groups)

    @property
    def scheme(self) -> QuantScheme:
        """The scheme of every planned Linear that no override or budget changes; its act-order is the
        rounding method's (GPTQ's ``actorder``)."""
        rounding = self.chain[-1]
        return QuantScheme(self.bits, self.group_size, self.symmetric, rounding.actorder(self.settings[rounding.name]))

    @property
    def method(self) -> str:
        """The methods as one label, e.g. ``awq+gptq`` (the older ``weights.method`` form)."""
        return "+".join(self.methods)


@dataclass
class Recipe:
    model: str
    output: str = ""
    dtype: str = "bfloat16"
    calibration: Calibration = field(default_factory=Calibration)
    weights: Weights = field(default_factory=Weights)
    kv_cache: KVScheme = field(default_factory=KVScheme)  # used by the runtime, saved in the manifest
    serve_with: list[str] = field(default_factory=list)  # engines every choice is held to (quant.engines)
    gguf: str | None = None  # a llama.cpp type/mix (Q4_K_M, ...): write one GGUF file instead (quant.gguf_quantize)

    def to_dict(self) -> dict:
        """The recipe as YAML would write it (each method's settings under its own name)."""
        data = asdict(self)
        weights = data["weights"]
        weights.update({name: values for name, values in weights.pop("settings").items() if values})
        # a budget replaces ``bits``; without one the keys stay out, so today's recipes read as before
        for key in ("bits",) if self.weights.target_bits is not None else ("target_bits", "candidates"):
            weights.pop(key)
        if not self.serve_with:
            data.pop("serve_with")
        if self.gguf is None:
            data.pop("gguf")
        else:  # the mix sets every tensor's type: the keys it replaces stay out (parse_recipe refuses them)
            for key in ("bits", "group_size", "symmetric", "overrides", "target_bits", "candidates"):
                weights.pop(key, None)
        return data


def default_output(recipe: Recipe) -> str:
    w = recipe.weights
    base = Path(str(recipe.model).rstrip("/")).name
    group = "pc" if w.group_size == -1 else f"g{w.group_size}"
    width = f"w{w.bits}" if w.target_bits is None else f"b{w.target_bits:g}"
    if recipe.gguf:
        return f"out/{base}-{w.method.replace('+', '-')}-{recipe.gguf}.gguf"
    return f"out/{base}-{w.method.replace('+', '-')}-{width}{group}"
