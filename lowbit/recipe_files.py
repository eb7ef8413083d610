"""Recipe files: the bundled recipes, finding one by path or name, and reading its YAML
(``load_recipe``, the entry point the commands use).

Only YAML's safe loader is used (libyaml's when installed: a recipe of 500,000 ``ignore``
patterns parses in seconds rather than a minute).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from lowbit.recipe import Recipe, RecipeError
from lowbit.recipe_parse import parse_recipe


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
