"""bench/budget_estimators.py's bookkeeping: candidate sets and a pass file extended with candidates it lacks."""

import json

import pytest

from bench.budget_estimators import add_to_pass, estimates, parse_candidates, parse_sets, read_pass
from quant.budget import Candidate


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
