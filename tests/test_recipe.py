"""Recipes: defaults, shipped files, CLI overrides, and errors that name the key path."""

from pathlib import Path

import pytest
import yaml

from lowbit.recipe import Recipe, RecipeError
from lowbit.recipe_files import load_recipe
from lowbit.recipe_parse import parse_recipe
from quant.plan import matches

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
        ({"model": "m", "weights": {"method": "gtpq"}},
         "weights.method: unknown method 'gtpq' (did you mean 'gptq'?); known methods: awq, gptq, rtn"),
        ({"model": "m", "weights": {"methods": ["awq", "magic"]}},
         "weights.methods: unknown method 'magic'; known methods: awq, gptq, rtn"),
        ({"model": "m", "weights": {"methods": ["gptq", "rtn"]}}, "weights.methods: rtn cannot follow gptq: gptq rounds"),
        ({"model": "m", "weights": {"methods": ["gptq", "awq"]}}, "weights.methods: awq cannot follow gptq"),
        ({"model": "m", "weights": {"method": "awq+gptq+rtn"}}, "weights.method: rtn cannot follow gptq"),
        ({"model": "m", "weights": {"methods": ["awq", "awq"]}}, "weights.methods: method awq is listed twice"),
        ({"model": "m", "weights": {"methods": []}}, "weights.methods: expected a non-empty list of method names"),
        ({"model": "m", "weights": {"methods": "gptq"}}, "weights.methods: expected a list of method names"),
        ({"model": "m", "weights": {"method": "gptq", "methods": ["gptq"]}}, "weights.method: give either"),
        ({"model": "m", "weights": {"methods": ["awq"], "gptq": {"dampening": 0.01}}},
         "weights.gptq: settings for gptq, which weights.methods (awq) does not use"),
        ({"model": "m", "weights": {"gptq": {"dampening": 0.01}}},
         "weights.gptq: settings for gptq, which weights.methods (rtn) does not use"),
        ({"model": "m", "weights": {"ignore": ["re:("]}}, "weights.ignore[0]: invalid regular expression"),
        ({"model": "m", "weights": {"overrides": [{"match": "x"}, {"match": "y", "bitz": 8}]}},
         "weights.overrides[1].bitz: unknown key (did you mean 'bits'?)"),
        ({"model": "m", "weights": {"overrides": [{"bits": 8}]}}, "weights.overrides[0].match: required"),
        ({"model": "m", "calibration": {"samples": -1}}, "calibration.samples: must be at least 1"),
        ({"model": "m", "calibration": {"bos": "yes"}}, "calibration.bos: expected true/false"),
        ({"model": "m", "dtype": "fp8"}, "dtype: must be one of"),
        ({"model": "m", "weights": {"overrides": [{"match": "re:["}]}}, "weights.overrides[0].match: invalid regular"),
        ({"model": "m", "weights": {"overrides": [{"match": "x", "skip": "maybe"}]}},
         "weights.overrides[0].skip: expected true/false"),
        ({"model": "m", "weights": {"methods": ["gptq"], "gptq": {"actorder": "random"}}},
         "weights.gptq.actorder: must be one of"),
        ({"model": "m", "weights": {"methods": ["awq"], "awq": {"gird": 10}}},
         "weights.awq.gird: unknown key (did you mean 'grid'?)"),
    ],
)
def test_errors_name_the_key_path(data, message):
    with pytest.raises(RecipeError) as e:
        parse_recipe(data, "r.yaml")
    assert str(e.value).startswith("r.yaml: ") and message in str(e.value)


def test_top_level_must_be_a_mapping():
    with pytest.raises(RecipeError, match=r"^r.yaml: the top level must be a mapping"):
        parse_recipe(["model", "m"], "r.yaml")


def test_per_channel_default_output_and_method_settings_round_trip():
    r = parse_recipe({"model": "models/tiny/", "weights": {"method": "awq+gptq", "bits": 8, "group_size": -1,
                                                             "gptq": {"actorder": "group", "dampening": 1}}})
    assert r.output == "out/tiny-awq-gptq-w8pc"
    assert r.weights.settings["gptq"].dampening == 1.0 and r.weights.settings["gptq"].actorder == "group"
    assert parse_recipe(r.to_dict()) == r


@pytest.mark.parametrize("old, new", [("rtn", ["rtn"]), ("gptq", ["gptq"]), ("awq", ["awq"]),
                                      ("awq+gptq", ["awq", "gptq"])])
def test_the_older_method_string_reads_as_the_method_list(old, new):
    """Recipes written before weights.methods keep working, and mean the same run."""
    before = parse_recipe({"model": "m", "weights": {"method": old}})
    after = parse_recipe({"model": "m", "weights": {"methods": new}})
    assert before == after and after.weights.methods == new and after.weights.method == old
    assert before.output == f"out/m-{old.replace('+', '-')}-w4g64"  # default output names unchanged
    assert [m.name for m in after.weights.chain] == (new if new[-1] != "awq" else new + ["rtn"])


def test_method_list_settings_are_filled_and_written_under_each_method():
    r = parse_recipe({"model": "m", "weights": {"methods": ["awq", "gptq"], "awq": {"grid": 10}}})
    assert r.weights.settings["awq"].grid == 10 and r.weights.settings["gptq"].actorder == "weight"
    data = r.to_dict()["weights"]
    assert data["methods"] == ["awq", "gptq"] and data["awq"]["grid"] == 10 and "settings" not in data
    assert parse_recipe(r.to_dict()) == r


def test_command_line_fills_an_empty_section_and_rejects_a_scalar_one(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("model: m\nweights:\n")  # `weights:` alone is null in YAML
    assert load_recipe(f, **{"weights.bits": 8}).weights.bits == 8
    f.write_text("model: m\nweights: 4\n")
    with pytest.raises(RecipeError, match=r"r.yaml: weights: expected a mapping"):
        load_recipe(f, **{"weights.bits": 8})


@pytest.mark.parametrize(
    "name, pattern, expected",
    [
        ("model.layers.0.mlp.down_proj", "down_proj", True),  # dotted suffix
        ("model.layers.0.mlp.down_proj", "mlp.down_proj", True),
        ("model.layers.0.mlp.xdown_proj", "down_proj", False),  # not at a dot boundary
        ("lm_head", "lm_head", True),  # exact name
        ("model.layers.0.mlp.down_proj", "model.layers.0", False),  # a prefix is not a match
        ("model.layers.0.mlp.down_proj", "re:.*down_proj", True),
        ("model.layers.0.mlp.down_proj", "re:down_proj", False),  # regexes match the full name
        ("model.layers.10.mlp.up_proj", r"re:.*layers\.(0|1)\..*", False),
        ("model.layers.1.mlp.up_proj", r"re:.*layers\.(0|1)\..*", True),
    ],
)
def test_matches(name, pattern, expected):
    assert matches(name, pattern) is expected


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


def test_readme_shows_the_defaults():
    import re

    readme = (Path(__file__).parent.parent / "recipes" / "README.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", readme, re.S)]
    data = blocks[0]
    del data["output"]  # a placeholder there, derived in the code
    assert parse_recipe(data) == parse_recipe({"model": "smollm2-135m"})
    settings = {"methods": ["awq", "gptq"], **blocks[1]["weights"]}  # each method's settings
    assert parse_recipe({"model": "m", "weights": settings}) == parse_recipe({"model": "m", "weights": settings | {
        "gptq": {}, "awq": {}}})


def test_a_bundled_recipe_is_found_by_name_and_a_wrong_name_lists_them():
    from lowbit.recipe_files import bundled_recipes_dir, find_recipe

    assert find_recipe("w4g64-awq-gptq") == bundled_recipes_dir() / "w4g64-awq-gptq.yaml"
    assert load_recipe("w8-rtn.yaml").weights.bits == 8
    with pytest.raises(RecipeError, match="w4g64-awq-gptq") as e:
        find_recipe("w4g64-awq-gtpq")
    assert str(bundled_recipes_dir()) in str(e.value)
