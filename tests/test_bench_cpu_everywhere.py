"""bench/cpu_everywhere.py: the CPU kind a result is filed under, and a smoke run end to end (a tiny random
model through the CLI's quantize and export, W4 against float, and llama-bench where it is built)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cpu_everywhere as ce

ROOT = Path(__file__).resolve().parent.parent


def facts(vendor, family, model, flags, name):
    return {"model_name": name, "vendor": vendor, "family": str(family), "model": str(model), "flags": flags}


@pytest.mark.parametrize("cpu, kind", [
    (facts("AuthenticAMD", 25, 17, ["avx2", "avx512f", "avx512_bf16"], "AMD EPYC"), "amd-epyc-zen4-avx512"),
    (facts("AuthenticAMD", 23, 49, ["avx2", "fma"], "AMD EPYC 7B12"), "amd-epyc-zen2-avx2"),
    (facts("AuthenticAMD", 25, 1, ["avx2"], "AMD EPYC 7763 64-Core Processor"), "amd-epyc-zen3-avx2"),
    (facts("GenuineIntel", 6, 143, ["avx2", "avx512f", "amx_tile"], "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"),
     "intel-xeon-amx"),
    (facts(None, None, None, ["asimd"], "aarch64"), "cpu-neon"),
])
def test_cpu_kind(cpu, kind):
    assert ce.cpu_kind(cpu) == kind


def test_this_cpu_has_a_kind():
    kind = ce.cpu_kind(ce.cpu_facts())
    assert kind and kind == kind.lower() and "/" not in kind and " " not in kind


def test_smoke_run(tmp_path):
    """The whole bench on the tiny model: every figure present, positive and consistent with its parts."""
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "-m", "bench.cpu_everywhere", "--smoke", "--checkpoints", str(tmp_path / "ck"),
                    "--out", str(out)], check=True, cwd=ROOT, timeout=600)
    result = json.loads(out.read_text())
    assert result["cpu_kind"] == ce.cpu_kind(result["cpu"]) and result["cpu"]["torch_capability"]
    assert result["bandwidth"]["copy_gb_per_s"] > 0
    shape = result["shapes"]["smoke"]
    prefill = shape["vs_float"]["prefill"]
    assert [row["tokens"] for row in prefill] == list(ce.MODES["smoke"]["prefill"])
    for row in prefill + shape["vs_float"]["decode"]:
        suffix = "_s" if "tokens" in row else "_itl_ms"
        for scheme in ce.SCHEMES:
            assert row[f"{scheme}{suffix}"] > 0 and row[f"float{suffix}"] > 0
            assert row[f"{scheme}_over_float"] == pytest.approx(row[f"{scheme}{suffix}"] / row[f"float{suffix}"])
    peer = shape["vs_llama_cpp"]
    assert peer["bandwidth"]["best_read_gb_per_s"] > 0
    bound = peer["tg_memory_bound"]
    assert bound["weight_bytes"] > 0 and bound["max_tokens_per_s"] > 0
    assert set(peer["median"]) == {"lowbit", *(f"llama.cpp-{b}" for b in peer["builds"])}
    for build in peer["builds"].values():  # each build's figures came from its own CPU backend
        assert Path(build["libggml_cpu"]).resolve().parent == (ROOT / build["library_path"][0]).resolve()
    for figures in peer["median"].values():
        assert figures["pp_tokens_per_s"] > 0 and figures["tg_tokens_per_s"] > 0 and figures["peak_rss_bytes"] > 0
    assert Path(shape["checkpoints"]["w4g32sym"]).with_suffix(".gguf").exists()
