"""Issue 15's static budgets for decode attention, read off its SASS (bench/sass.py cases from
bench/sass_attention.py): the decode kernel compiled for sm_90a with Triton's bundled ptxas, no
GPU needed, at the configurations ``decode_attention`` launches (fp16, fp8, int8, int4, int2;
head_dim 128; GQA 4:1 and 1:1). Instruction counts are deterministic for a Triton/ptxas
version; they are not timings.
"""

import pytest

SCHEMES = ("fp16", "fp8", "int8", "int4", "int2")


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


def test_every_budget_holds_and_nothing_spills(reports):
    """fp16, fp8 and int2 no worse than before the folded kernel (bench/sass_attention.py)."""
    for r in reports.values():
        assert r["budgets"], r["name"]
        assert all(b["met"] for b in r["budgets"].values()), (r["name"], r["budgets"],
                                                              r["main_loop"]["loop_instructions_per_unit"])
        assert r["spill_instructions"] == 0 and r["local_bytes"] == 0, r["name"]


def test_the_main_loop_prefetches_with_async_copies(reports):
    """num_stages > 1 pipelines the packed words and scales: cp.async (LDGSTS) in the loop."""
    for scheme in ("int4", "int8"):
        r = reports[f"decode-attention {scheme} gqa4:1 d128"]
        assert "LDGSTS" in r["main_loop"]["async_copies"], r["main_loop"]["opcodes"]
