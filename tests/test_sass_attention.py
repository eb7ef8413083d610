"""Issue 15's static budgets for decode attention, read off its SASS (bench/sass.py cases from
bench/sass_attention.py): the decode kernel compiled for sm_90a with Triton's bundled ptxas, no
GPU needed, at the configurations ``decode_attention`` launches (fp16, fp8, int8, int4, int2;
head_dim 128; GQA 4:1 and 1:1). Instruction counts are deterministic for a Triton/ptxas
version; they are not timings.
"""

import pytest

SCHEMES = ("fp16", "fp8", "int8", "int4", "int2")
# (scheme, budget) pairs missed on sm_90a, per Triton release (none on the newest). Under 3.6.0 (the
# lent GPU machine's) fp8 and int2 keep the unfolded dequantize-then-dot path, which 3.6 compiles
# to 2-3% more main-loop instructions than 3.9 (fp8 7.77/7.67 per element against 7.52, int2
# 14.75/14.81 against 14.44; bench/results/kernels/sass-*-triton3.6.0.json), with two more barriers per
# iteration. No spills under either: that is not waived.
KNOWN_MISSED = {
    "3.9": set(),
    "3.6": {("fp8", "max_loop_instructions_per_unit"), ("int2", "max_loop_instructions_per_unit")},
}


@pytest.fixture(scope="module")
def reports(sass_reports):
    return {r["name"]: r for r in sass_reports if r["name"].startswith("decode-attention")}


def test_every_scheme_and_gqa_ratio_is_reported(reports):
    assert set(reports) == {f"decode-attention {s} gqa{g}:1 d128" for s in SCHEMES for g in (4, 1)}
    for r in reports.values():
        loop = r["main_loop"]
        assert loop is not None and loop["instructions"] > 0, r["name"]
        assert sum(loop["opcodes"].values()) == loop["instructions"]


def test_int4_and_int8_stay_within_five_instructions_per_cached_element(reports):
    for scheme in ("int4", "int8"):
        for g in (4, 1):
            r = reports[f"decode-attention {scheme} gqa{g}:1 d128"]
            assert r["main_loop"]["loop_instructions_per_unit"] <= 5.0, (r["name"], r["main_loop"]["opcodes"])


def test_every_budget_holds_and_nothing_spills(sass_run, reports):
    """fp16, fp8 and int2 no worse than before the folded kernel (bench/sass_attention.py), except
    what KNOWN_MISSED names for this Triton release; no spills in any case under any release."""
    known = KNOWN_MISSED.get(".".join(sass_run[0].split(".")[:2]), set())
    missed = set()
    for r in reports.values():
        assert r["budgets"], r["name"]
        missed |= {(r["name"].split()[1], name) for name, b in r["budgets"].items() if not b["met"]}
        assert r["spill_instructions"] == 0 and r["local_bytes"] == 0, r["name"]
    assert missed == known, (f"missed {sorted(missed - known)} newly; met now {sorted(known - missed)} "
                             "(take those off KNOWN_MISSED)")


def test_the_main_loop_prefetches_with_async_copies(reports):
    """num_stages > 1 pipelines the packed words and scales: cp.async (LDGSTS) in the loop."""
    for scheme in ("int4", "int8"):
        r = reports[f"decode-attention {scheme} gqa4:1 d128"]
        assert "LDGSTS" in r["main_loop"]["async_copies"], r["main_loop"]["opcodes"]
