"""Issue 15's static budgets for decode attention, read off its SASS (bench/sass.py cases from
bench/sass_attention.py): the decode kernel compiled for sm_90a with Triton's bundled ptxas, no
GPU needed, at the configurations ``decode_attention`` launches (fp16, fp8, int8, int4, int2;
head_dim 128; GQA 4:1 and 1:1). Instruction counts are deterministic for a Triton/ptxas
version; they are not timings.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCHEMES = ("fp16", "fp8", "int8", "int4", "int2")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this triton build has no NVIDIA backend (ptxas, cuobjdump)")
    out = tmp_path_factory.mktemp("sass") / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "sass.py"), "--arch", "sm_90a", "--only",
                          "decode-attention", "--json", str(out)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return {r["name"]: r for r in json.loads(out.read_text())["reports"]}


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
