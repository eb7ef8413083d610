"""bench/budget_estimators.py: its pass (every estimate at once, labels drawn from the model, candidates rounded
from float weights) and its bookkeeping (candidate sets, a pass file extended with candidates it lacks)."""

import json

import pytest
import torch

from bench.budget_estimators import add_to_pass, estimates, parse_candidates, parse_sets, read_pass, weigh
from quant.affine import QuantScheme
from quant.budget import Candidate
from quant.plan import plan_layers
from tiny import TEXT, tiny_llama


def pass_with(labels, measures=("fisher",), value=1.0, tokens=10):
    sums = {m: {"a": {k: value for k in labels}, "b": {k: 2 * value for k in labels}} for m in measures}
    return {"sums": sums, "energy": {"a": 1.0, "b": 4.0}, "tokens": tokens, "seconds": 1.0, "cpu_seconds": 1.0,
            "candidates": list(labels)}


def test_sets_are_subsets_of_the_candidates_weighed():
    weighed = parse_candidates(["3:64", "4:128", "8:-1"])
    assert weighed == [Candidate(3, 64), Candidate(4, 128), Candidate(8, -1)]
    assert parse_sets(None, weighed) == {"all": weighed}
    assert parse_sets(["no8=3:64,4:128"], weighed) == {"no8": weighed[:2]}
    with pytest.raises(SystemExit, match=r"set 'x': \['w2 g64'\] not among --candidates"):
        parse_sets(["x=2:64"], weighed)
    with pytest.raises(SystemExit, match="candidates are BITS:GROUP"):
        parse_candidates(["3"])


def test_a_pass_file_takes_the_candidates_it_lacks_and_drops_measures_one_pass_lacks(tmp_path):
    path = tmp_path / "pass.json"
    path.write_text(json.dumps({**pass_with(["w3 g64"]), "samples": 2}))
    weighed = read_pass(path, samples=2)  # a file from before the other keys were written: their defaults
    add_to_pass(weighed, pass_with(["w3 g32"], measures=("fisher", "output"), value=5.0), "abc")
    assert weighed["candidates"] == ["w3 g64", "w3 g32"]
    assert weighed["sums"] == {"fisher": {"a": {"w3 g64": 1.0, "w3 g32": 5.0}, "b": {"w3 g64": 2.0, "w3 g32": 10.0}}}
    assert weighed["added"][0]["commit"] == "abc"
    assert set(estimates(weighed)) == {"fisher"}  # no output sums, so no output or relative estimate
    with pytest.raises(SystemExit, match="not the same samples"):
        add_to_pass(weighed, pass_with(["w4 g32"], tokens=11), "abc")
    with pytest.raises(SystemExit, match=r"another way: samples 2 \(here 8\); give another --pass-file"):
        read_pass(path, samples=8)
    for key, value in (("seed", 1), ("bos", True), ("labels", "model"), ("code_share", 0.25)):
        with pytest.raises(SystemExit, match=f"{key} .* \\(here {value}\\)"):
            read_pass(path, samples=2, **{key: value})
    assert read_pass(tmp_path / "none.json", samples=2) is None


def test_the_code_calibration_is_python_source_without_the_code_text_scored():
    from bench.budget_estimators import stdlib_source
    from evals.texts import load_text

    source = stdlib_source()
    assert "def " in source and load_text("code")[:2000] not in source


def _tiny_pass(samples: int):
    """A tiny Llama, ``samples`` calibration samples of 32 tokens, and its plan (W4 g32, lm_head kept)."""
    from quant.calibration import calibration_samples

    model, tok = tiny_llama(hidden=64, layers=2)
    plan = plan_layers(model, QuantScheme(4, 32), ["lm_head"])
    return model, calibration_samples(tok, TEXT * 20, samples, 32, 0), plan


def test_model_labels_weigh_against_the_float_models_own_draws():
    """``labels="model"``: the pass's loss against next tokens drawn (seeded) from the float model, so
    the same samples give the same sums; they differ from the text's labels; an unknown choice is named."""
    model, samples, plan = _tiny_pass(4)
    candidates = [Candidate(b, 32) for b in (3, 8)]
    runs = [weigh(model, plan, candidates, samples, labels)["sums"]["fisher"] for labels in ("model", "model", "data")]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert all(by["w3 g32"] > by["w8 g32"] > 0 for by in runs[0].values())
    with pytest.raises(ValueError, match="labels must be one of data, model"):
        weigh(model, plan, candidates, samples, "text")


def test_the_data_labels_pass_is_the_budgets_own():
    """With the text's labels the bench's ``fisher`` sums are the budget's (quant.sensitivity.weigh_rounding),
    and every estimate is summed for every Linear and candidate."""
    from quant.sensitivity import weigh_rounding

    model, samples, plan = _tiny_pass(2)
    candidates = [Candidate(b, 32) for b in (2, 4)]
    weighed = weigh(model, plan, candidates, samples)
    budgets, tokens = weigh_rounding(model, plan, candidates, samples, torch.bfloat16, progress=False)
    assert weighed["tokens"] == tokens == 2 * 31
    assert weighed["sums"]["fisher"] == budgets
    assert set(weighed["sums"]) == {"output", "fisher", "fisher_dot"}
    assert all(v > 0 for sums in weighed["sums"].values() for by in sums.values() for v in by.values())


def test_float_weights_round_from_the_float_weight_whatever_the_model_holds():
    """A model already holding a Linear rounded at w3 g32: weighed as it stands, re-rounding that grid
    costs next to nothing (its bf16 scales, recomputed from the grid, move a few codes); with
    ``float_weights`` the candidate is rounded from the float weight again."""
    from quant import rtn

    model, samples, plan = _tiny_pass(2)
    name = "model.layers.0.mlp.up_proj"
    linear = model.get_submodule(name)
    original = linear.weight.detach().clone()
    held = rtn.quantize_weight(original, QuantScheme(3, 32), torch.bfloat16).dequantize(torch.float32)
    with torch.no_grad():
        linear.weight.copy_(held)
    candidates = [Candidate(3, 32)]
    as_held = weigh(model, plan, candidates, samples)["sums"]["fisher"][name]["w3 g32"]
    from_float = weigh(model, plan, candidates, samples, float_weights={name: original})["sums"]["fisher"][name]
    assert as_held < 1e-2 * from_float["w3 g32"] and from_float["w3 g32"] > 0
    assert torch.equal(linear.weight, held)  # the model keeps what it held
