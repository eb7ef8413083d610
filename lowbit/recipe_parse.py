"""A recipe mapping checked key by key into a ``Recipe`` (``parse_recipe``).

Validation names the offending key path (``weights.overrides[1].bits``) and suggests the
closest known key for a typo; each section (calibration, weights and its methods' settings, a
bits budget, ``serve_with``, ``gguf``, ``kv_cache``) is checked before any work.
"""

from __future__ import annotations

import re
from dataclasses import asdict, fields, replace

from kvquant import schemes as kv_families
from kvquant.scheme import SUPPORTED_KV_BITS, KVScheme
from lowbit.recipe import DTYPES, Calibration, Recipe, RecipeError, Weights, default_output
from quant import engines
from quant import methods as registry
from quant.affine import SUPPORTED_BITS
from quant.budget import DEFAULT_BITS, MAX_TARGET_BITS, Candidate
from quant.names import did_you_mean
from quant.plan import Override


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
                hint = did_you_mean(key, known, otherwise=f" (known keys: {', '.join(known)})")
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
    rounding, default = weights.chain[-1], weights.scheme
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
