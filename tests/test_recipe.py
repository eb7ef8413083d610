"""Recipes: defaults, shipped files, CLI overrides, and errors that name the key path."""

from pathlib import Path

import pytest
import yaml

from lowbit.recipe import Recipe, RecipeError, load_recipe, parse_recipe

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))


def test_defaults_fill_everything_but_the_model():
    r = parse_recipe({"model": "smollm2-135m"})
    assert (r.weights.method, r.weights.bits, r.weights.group_size, r.weights.symmetric) == ("rtn", 4, 64, False)
    assert r.weights.ignore == ["lm_head"] and r.output == "out/smollm2-135m-rtn-w4g64"
    assert r.calibration.samples == 128 and r.calibration.seq_len == 512


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_parse(path):
    assert isinstance(load_recipe(path), Recipe)


def test_default_recipe_is_the_built_in_default():
    assert load_recipe(Path(__file__).parent.parent / "recipes" / "default.yaml") == parse_recipe({"model": "smollm2-135m"})


def test_command_line_wins_and_round_trip(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump({"model": "a", "output": "o", "weights": {"bits": 4,
                                 "overrides": [{"match": "re:.*down_proj", "bits": 8}]}}))
    r = load_recipe(f, model="b", output=None, **{"weights.bits": 8})
    assert r.model == "b" and r.output == "o" and r.weights.bits == 8
    assert parse_recipe(r.to_dict()) == r


@pytest.mark.parametrize(
    "data, message",
    [
        ({}, "model: required"),
        ({"model": "m", "weigths": {}}, "weigths: unknown key (did you mean 'weights'?)"),
        ({"model": "m", "weights": {"bits": 5}}, "weights.bits: must be one of 2, 3, 4, 8 (got 5)"),
        ({"model": "m", "weights": {"bits": True}}, "weights.bits: expected an integer"),
        ({"model": "m", "weights": {"symmetric": "maybe"}}, "weights.symmetric: expected true/false"),
        ({"model": "m", "weights": {"group_size": 0}}, "weights.group_size"),
        ({"model": "m", "weights": {"method": "gtpq"}}, "weights.method: must be one of"),
        ({"model": "m", "weights": {"ignore": ["re:("]}}, "weights.ignore[0]: invalid regular expression"),
        ({"model": "m", "weights": {"overrides": [{"match": "x"}, {"match": "y", "bitz": 8}]}},
         "weights.overrides[1].bitz: unknown key (did you mean 'bits'?)"),
        ({"model": "m", "weights": {"overrides": [{"bits": 8}]}}, "weights.overrides[0].match: required"),
        ({"model": "m", "calibration": {"samples": -1}}, "calibration.samples: must be at least 1"),
        ({"model": "m", "dtype": "fp8"}, "dtype: must be one of"),
    ],
)
def test_errors_name_the_key_path(data, message):
    with pytest.raises(RecipeError) as e:
        parse_recipe(data, "r.yaml")
    assert str(e.value).startswith("r.yaml: ") and message in str(e.value)


def test_file_errors(tmp_path):
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(tmp_path / "none.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(RecipeError, match="invalid YAML.*line"):
        load_recipe(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="mapping"):
        load_recipe(tmp_path / "list.yaml")
    (tmp_path / "unsafe.yaml").write_text("model: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(RecipeError, match="invalid YAML"):
        load_recipe(tmp_path / "unsafe.yaml")
