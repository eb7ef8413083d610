"""The recipe: a YAML file saying which model to compress, how, and where to put it.

Validation names the offending key path (``weights.overrides[1].bits``) and
suggests the closest known key for a typo. Only YAML's safe loader is used (libyaml's when
installed: a recipe of 500,000 ``ignore`` patterns parses in seconds rather than a minute).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import yaml

from kvquant import schemes as kv_families
from kvquant.scheme import SUPPORTED_KV_BITS, KVScheme
from quant import engines
from quant import methods as registry
from quant.affine import SUPPORTED_BITS, QuantScheme
from quant.budget import DEFAULT_BITS, MAX_TARGET_BITS, Candidate, default_candidates
# A recipe's overrides and patterns are the plan's: one definition of each, re-exported here.
from quant.plan import Override, matches  # noqa: F401

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


# ------------------------------------------------------------------ checks

class _Checker:
    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, message: str):
        raise RecipeError(f"{self.source}: {path}: {message}")

    def mapping(self, value, path: str, known: list[str]) -> dict:
        if not isinstance(value, dict):
            if not path:  # the whole recipe: there is no key path to name
                raise RecipeError(f"{self.source}: the top level must be a mapping of keys, got {type(value).__name__}")
            self.fail(path, f"expected a mapping, got {type(value).__name__}")
        for key in value:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(known)})"
                self.fail(f"{path}.{key}" if path else str(key), f"unknown key{hint}")
        return value

    def integer(self, value, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"expected an integer, got {value!r}")
        return value

    def boolean(self, value, path: str) -> bool:
        if not isinstance(value, bool):
            self.fail(path, f"expected true/false, got {value!r}")
        return value

    def string(self, value, path: str) -> str:
        if not isinstance(value, str) or not value:
            self.fail(path, f"expected a non-empty string, got {value!r}")
        return value

    def choice(self, value, path: str, options) -> object:
        if value not in options:
            self.fail(path, f"must be one of {', '.join(map(str, options))} (got {value!r})")
        return value

    def positive(self, value, path: str) -> int:
        if self.integer(value, path) < 1:
            self.fail(path, f"must be at least 1 (got {value})")
        return value

    def bits(self, value, path: str) -> int:
        return self.choice(self.integer(value, path), path, SUPPORTED_BITS)

    def group_size(self, value, path: str) -> int:
        if self.integer(value, path) != -1 and value < 1:
            self.fail(path, f"must be a positive group length or -1 for per-channel (got {value})")
        return value

    def pattern(self, value, path: str) -> str:
        self.string(value, path)
        if value.startswith("re:"):
            try:
                re.compile(value[3:])
            except re.error as e:
                self.fail(path, f"invalid regular expression {value[3:]!r}: {e}")
        return value

    def patterns(self, value, path: str) -> list[str]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            self.fail(path, f"expected a list of names or 're:' patterns, got {value!r}")
        return [self.pattern(v, f"{path}[{i}]") for i, v in enumerate(value)]


def _names(cls) -> list[str]:
    return [f.name for f in fields(cls)]


def parse_recipe(data, source: str = "<recipe>") -> Recipe:
    c = _Checker(source)
    if data is None:
        data = {}
    top = c.mapping(data, "", _names(Recipe))
    if "model" not in top:
        c.fail("model", "required (an alias such as smollm2-135m, a local directory or a hub id)")
    recipe = Recipe(model=str(c.string(top["model"], "model")))
    if "dtype" in top:
        recipe.dtype = c.choice(top["dtype"], "dtype", DTYPES)

    cal = c.mapping(top.get("calibration") or {}, "calibration", _names(Calibration))
    if "text" in cal:
        recipe.calibration.text = c.string(cal["text"], "calibration.text")
    for key in ("samples", "seq_len"):
        if key in cal:
            setattr(recipe.calibration, key, c.positive(cal[key], f"calibration.{key}"))
    if "seed" in cal:
        recipe.calibration.seed = c.integer(cal["seed"], "calibration.seed")
    if cal.get("bos") is not None:
        recipe.calibration.bos = c.boolean(cal["bos"], "calibration.bos")

    known = [n for n in _names(Weights) if n != "settings"] + ["method"] + sorted(registry.REGISTRY)
    w = c.mapping(top.get("weights") or {}, "weights", known)
    weights = recipe.weights
    if "bits" in w:
        weights.bits = c.bits(w["bits"], "weights.bits")
    if "group_size" in w:
        weights.group_size = c.group_size(w["group_size"], "weights.group_size")
    if "symmetric" in w:
        weights.symmetric = c.boolean(w["symmetric"], "weights.symmetric")
    if "ignore" in w:
        weights.ignore = c.patterns(w["ignore"] or [], "weights.ignore")
    overrides = w.get("overrides") or []
    if not isinstance(overrides, list):
        c.fail("weights.overrides", "expected a list of {match: ..., bits: ...} entries")
    weights.overrides = [_override(c, o, f"weights.overrides[{i}]") for i, o in enumerate(overrides)]
    weights.target_bits, weights.candidates = _budget(c, w)
    weights.methods, weights.settings = _methods(c, w)

    recipe.kv_cache = _kv_cache(c, top.get("kv_cache"))
    recipe.serve_with = _serve_with(c, top.get("serve_with"), weights, "candidates" in w)
    if top.get("gguf") is not None:
        recipe.gguf = _gguf(c, top["gguf"], weights, w)
    recipe.output = c.string(top["output"], "output") if top.get("output") is not None else default_output(recipe)
    return recipe


def _methods(c: _Checker, w: dict) -> tuple[list[str], dict]:
    """``weights.methods`` (or the older ``weights.method: awq+gptq``) and each listed method's
    settings section, checked before any work: known names in an order that works, no
    settings for a method the list lacks."""
    if "method" in w and "methods" in w:
        c.fail("weights.method", "give either weights.methods (a list) or the older weights.method, not both")
    key = "method" if "method" in w else "methods"
    spec = w.get(key, ["rtn"])
    if key == "methods" and not isinstance(spec, list):
        c.fail("weights.methods", f"expected a list of method names such as [awq, gptq], got {spec!r}")
    if key == "method" and not isinstance(spec, str):
        c.fail("weights.method", f"expected a method name such as awq+gptq, got {spec!r}")
    try:
        names = registry.parse_names(spec)
        chain = registry.chain(names)
    except registry.MethodError as e:
        c.fail(f"weights.{key}", str(e))
    used = [m.name for m in chain]
    settings = {}
    for name, method in sorted(registry.REGISTRY.items()):
        if name not in w:
            continue
        if name not in used:
            c.fail(f"weights.{name}", f"settings for {name}, which weights.{key} ({', '.join(names)}) does not "
                                      f"use; add {name} to weights.methods or remove this section")
        settings[name] = _settings(c, w[name], f"weights.{name}", method.settings, method.choices)
    return names, registry.check_settings(chain, settings)


def _budget(c: _Checker, w: dict) -> tuple[float | None, list[Candidate]]:
    """``weights.target_bits`` (instead of ``bits``) and the ``candidates`` it chooses from."""
    if w.get("candidates") and w.get("target_bits") is None:
        c.fail("weights.candidates", "candidates are what a bits budget chooses from; set weights.target_bits "
                                     "too, or remove weights.candidates")
    if w.get("target_bits") is None:  # absent, or None as a manifest's recipe writes it
        return None, []
    target = w["target_bits"]
    if "bits" in w:
        c.fail("weights.target_bits", "give either weights.bits (one width for every Linear) or "
                                      "weights.target_bits (a bits-per-weight budget lowbit spreads over the "
                                      "Linears), not both; remove weights.bits")
    if isinstance(target, bool) or not isinstance(target, (int, float)) or target <= 0:
        c.fail("weights.target_bits", f"expected a positive number of bits per weight such as 3.5, got {target!r}")
    if target > MAX_TARGET_BITS:
        c.fail("weights.target_bits", f"{target:g} is above {MAX_TARGET_BITS} bits per weight, the widest "
                                      "candidate; use weights.bits: 8, or keep Linears in floating point with "
                                      "weights.ignore")
    spec = w.get("candidates") or []
    if not isinstance(spec, list):
        c.fail("weights.candidates", f"expected a list of {{bits: ..., group_size: ...}} entries, got {spec!r}")
    group = w.get("group_size", Weights.group_size)
    candidates = []
    for i, entry in enumerate(spec):
        path = f"weights.candidates[{i}]"
        entry = c.mapping(entry, path, ["bits", "group_size"])
        if "bits" not in entry:
            c.fail(f"{path}.bits", "required: 2, 3, 4 or 8")
        candidate = Candidate(c.bits(entry["bits"], f"{path}.bits"),
                              c.group_size(entry.get("group_size", group), f"{path}.group_size"))
        if candidate not in candidates:
            candidates.append(candidate)
    smallest = min(cand.bits for cand in candidates) if candidates else min(DEFAULT_BITS)
    if target < smallest:
        c.fail("weights.target_bits", f"{target:g} is below the smallest candidate ({smallest} bits, before "
                                      "scales); raise target_bits or add a cheaper candidate")
    return float(target), candidates


def _serve_with(c: _Checker, value, weights: Weights, explicit_candidates: bool) -> list[str]:
    """``serve_with``: the engines (quant.engines) whose kernels every weight choice must fit. Each choice
    they refuse is an error at its key path; the budget's default candidates shrink to the ones they take."""
    if not value:
        return []
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        c.fail("serve_with", f"expected an engine name or a list of them ({', '.join([*engines.ENGINES, *engines.ALIASES])}), "
                             f"got {value!r}")
    try:
        chosen = engines.resolve(names)
    except engines.EngineError as e:
        c.fail("serve_with", str(e))
    rounding = weights.chain[-1]
    default = QuantScheme(weights.bits, weights.group_size, weights.symmetric,
                          rounding.actorder(weights.settings[rounding.name]))
    overrides = {f"weights.overrides[{i}]": replace(default, **{k: v for k, v in asdict(o).items()
                                                                if k in ("bits", "group_size", "symmetric") and v is not None})
                 for i, o in enumerate(weights.overrides) if not o.skip}
    budgeted = weights.target_bits is not None
    if budgeted and not explicit_candidates:
        weights.candidates = engines.served_candidates(chosen, weights.budget_candidates, default)
    candidates = {f"weights.candidates[{i}]": replace(default, bits=k.bits, group_size=k.group_size)
                  for i, k in enumerate(weights.candidates)} if budgeted else None
    for path, why in engines.weights_refusals(chosen, default, overrides, candidates):
        if path == "weights":  # the key that chose it
            path += ".group_size" if "group size" in why else f".{rounding.name}.actorder" if "act-order" in why \
                else ".symmetric" if "experts" in why else ".bits"
        c.fail(path, f"serve_with {', '.join(names)}: {why}")
    least = min((k.bits for k in weights.candidates), default=None) if budgeted else None
    if budgeted and (least is None or weights.target_bits < least):
        c.fail("weights.target_bits", f"serve_with {', '.join(names)}: the candidates its engines serve ("
               + (", ".join(k.label for k in weights.candidates) or "none") + f") store at least {least} bits per "
               f"weight, above the target {weights.target_bits:g}; raise target_bits")
    return names


def _gguf(c: _Checker, value, weights: Weights, given: dict) -> str:
    """``gguf: Q4_K_M``: the llama.cpp type (or mix) of the GGUF file the recipe writes (quant.gguf_quantize)."""
    from quant.gguf_quantize import check_target

    try:
        return check_target(c.string(value, "gguf"), weights.methods, given)
    except ValueError as e:
        c.fail("gguf", str(e))


def _kv_cache(c: _Checker, value, path: str = "kv_cache") -> KVScheme:
    data = c.mapping(value or {}, path, _names(KVScheme))
    checked = {}
    for key in ("bits", "value_bits"):  # keys' width; values' when it differs (family kv-split)
        if key in data:
            checked[key] = c.choice(c.integer(data[key], f"{path}.{key}"), f"{path}.{key}", SUPPORTED_KV_BITS)
    if "family" in data:  # absent: the family that claims bits, type and value_bits (kvquant.schemes)
        checked["family"] = c.choice(data["family"], f"{path}.family", tuple(kv_families.REGISTRY))
    if "type" in data:
        checked["type"] = c.choice(data["type"], f"{path}.type", ("int", "float"))
    for key in ("group_size", "residual"):
        if key in data:
            checked[key] = c.positive(data[key], f"{path}.{key}")
    try:
        return KVScheme(**checked)
    except ValueError as e:  # settings that do not fit together (residual vs group_size, float vs bits)
        c.fail(path, str(e))


def _settings(c: _Checker, value, path: str, cls, choices: dict):
    """A method's settings section, checked field by field against the dataclass defaults."""
    data = c.mapping(value or {}, path, _names(cls))
    defaults = cls()
    checked = {}
    for key, v in data.items():
        default, where = getattr(defaults, key), f"{path}.{key}"
        if key in choices:
            checked[key] = c.choice(v, where, choices[key])
        elif isinstance(default, bool):
            checked[key] = c.boolean(v, where)
        elif isinstance(default, int):
            checked[key] = c.positive(v, where)
        elif isinstance(default, float):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                c.fail(where, f"expected a positive number, got {v!r}")
            checked[key] = float(v)
    try:
        return cls(**checked)
    except ValueError as e:  # a value the method's settings refuse (a range, a bound)
        c.fail(path, str(e))


def _override(c: _Checker, value, path: str) -> Override:
    o = c.mapping(value, path, _names(Override))
    if "match" not in o:
        c.fail(f"{path}.match", "required: the module name or 're:' pattern this override applies to")
    return Override(
        match=c.pattern(o["match"], f"{path}.match"),
        bits=None if o.get("bits") is None else c.bits(o["bits"], f"{path}.bits"),
        group_size=None if o.get("group_size") is None else c.group_size(o["group_size"], f"{path}.group_size"),
        symmetric=None if o.get("symmetric") is None else c.boolean(o["symmetric"], f"{path}.symmetric"),
        skip=c.boolean(o.get("skip", False), f"{path}.skip"),
    )


def bundled_recipes_dir() -> Path:
    """Where the shipped recipes are: inside the package when installed from a wheel
    (``lowbit/recipes/``), beside it in a source checkout or an editable install (``recipes/``)."""
    installed = Path(__file__).parent / "recipes"
    return installed if installed.is_dir() else Path(__file__).parent.parent / "recipes"


def bundled_recipe_names() -> list[str]:
    return sorted(p.stem for p in bundled_recipes_dir().glob("*.yaml"))


def find_recipe(spec) -> Path:
    """A recipe file: ``spec`` itself when it is a file, else the bundled recipe of that name."""
    path = Path(spec)
    if path.is_file():
        return path
    bundled = bundled_recipes_dir() / f"{path.name.removesuffix('.yaml')}.yaml"
    if path.parent == Path(".") and bundled.is_file():
        return bundled
    raise RecipeError(f"recipe {spec} not found: give a YAML file, or the name of a bundled recipe "
                      f"({', '.join(bundled_recipe_names())}, in {bundled_recipes_dir()})")


SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the same safe constructors, in C


def load_recipe(path, **cli_overrides) -> Recipe:
    """Read a recipe file (or a bundled recipe by name); ``cli_overrides`` are dotted key paths
    (``weights.bits``) that win over it."""
    path = find_recipe(path)
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=SAFE_LOADER)
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); a recipe is a YAML file") from None
    except RecursionError:
        raise RecipeError(f"{path}: invalid YAML: nested too deeply") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(f"{path}: invalid YAML{where}: {problem}") from None
    if data is not None and not isinstance(data, dict):
        raise RecipeError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    data = _apply_overrides(dict(data or {}), cli_overrides, str(path))
    return parse_recipe(data, str(path))


def _apply_overrides(data: dict, overrides: dict, source: str) -> dict:
    """Set each dotted key path (``weights.bits``; ``weights__bits`` for keyword use); None means unset."""
    for dotted, value in overrides.items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.replace("__", ".").split(".")
        for depth, key in enumerate(parents):
            if node.get(key) is None:  # absent, or an empty section (`weights:` alone is null in YAML)
                node[key] = {}
            elif not isinstance(node[key], dict):
                where = ".".join(parents[: depth + 1])
                raise RecipeError(f"{source}: {where}: expected a mapping, got {type(node[key]).__name__}")
            node = node[key]
        node[leaf] = value
    return data
