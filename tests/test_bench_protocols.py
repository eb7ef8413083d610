"""bench/: every calibrated row is scored on both protocols, and a method's settings reach the recipe."""

import math

import pytest

from bench.calibrated import recipe_dict, table
from bench.scoring import parse_texts, protocols, score_texts
from evals.perplexity import hf_logits_fn
from lowbit.recipe_parse import parse_recipe
from tiny import tiny_llama


def test_rows_are_scored_on_both_protocols_with_what_they_were_told():
    model, tok = tiny_llama()
    scores = score_texts(hf_logits_fn(model), tok, {"persuasion": 40, "code": 30})
    assert set(scores) == {"sliding", "bos"} and all(set(s) == {"persuasion", "code"} for s in scores.values())
    assert "no BOS" in scores["sliding"]["code"]["protocol"]
    assert scores["bos"]["persuasion"]["protocol"].startswith("disjoint windows of BOS + 511 tokens, first 40")
    assert all(math.isfinite(s[t]["ppl"]) for s in scores.values() for t in s)
    assert scores["bos"]["persuasion"]["ppl"] != scores["sliding"]["persuasion"]["ppl"]
    tok.bos_token = None
    with pytest.raises(ValueError, match="needs a BOS token"):
        score_texts(hf_logits_fn(model), tok, {"code": 30})


def test_texts_option_names_the_known_texts():
    assert parse_texts(["persuasion=8192", "code=4096"]) == {"persuasion": 8192, "code": 4096}
    assert protocols("bos", {"code": 1022})["code"].tokens == 1022
    with pytest.raises(SystemExit, match="persuasion, code"):
        parse_texts(["novel=10"])


def test_method_settings_land_where_the_recipe_reads_them():
    recipe = parse_recipe(recipe_dict("gptq:dampening=0.01,dtype=float32,calibration.bos=false", 3, "/tmp/x"))
    assert (recipe.weights.settings["gptq"].dampening, recipe.dtype, recipe.calibration.bos, recipe.weights.bits) == (
        0.01, "float32", False, 3)
    plain = parse_recipe(recipe_dict("awq+gptq", 4, "/tmp/x"))
    assert plain.weights.method == "awq+gptq" and plain.calibration.bos is None


def test_table_reports_the_gap_closed_per_protocol():
    def row(method, persuasion, code):
        texts = {"persuasion": {"ppl": persuasion}, "code": {"ppl": code}}
        return {"tool": "lowbit", "method": method, "quantize_s": 1.0, "peak_rss_bytes": 1e9,
                "scores": {"sliding": texts, "bos": texts}}

    text = table([row("float", 30.0, 5.0), row("rtn", 40.0, 7.0), row("gptq", 32.0, 6.0)], "bos")
    assert "| lowbit | gptq | 32.000 | 80% | 6.000 | 50% |" in text
