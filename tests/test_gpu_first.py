"""bench/gpu_first.py (the first call of a GPU run) and bench/gpu_cache.py (its carried Triton cache),
on CPU: the rows an engine's steps take, restricted tuning counted, the cache key's recipe, the
cache's unpacking, and the whole run in the Triton interpreter (``--smoke``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_step_rows_are_the_forwards_an_engine_runs():
    from bench.gpu_first import step_rows

    assert step_rows(1, 512, 512) == (1, 512)  # one prefill of 512 rows, then decode steps of 1
    # 32 prompts of 512 in 4096-token prefills: 8 a step; 8, 16, 24 decode beside the next ones, then 32
    assert step_rows(32, 512, 4096) == (8, 16, 24, 32, 4096)
    assert step_rows(3, 100, 512) == (3, 300)
    with pytest.raises(ValueError, match="prefill_chunk"):
        step_rows(2, 600, 512)


def test_tuning_buckets_restricted_and_checked():
    from runtime.execution import tuning_buckets

    assert len(tuning_buckets(4096)) == 24  # every bucket: 1..16, then powers of two to 4096
    assert tuning_buckets(512, (1, 512)) == (1, 512)
    assert tuning_buckets(4096, (8, 16, 24, 32, 4096)) == (8, 16, 32, 4096)  # 24 rows tune as 32
    for bad in [(0,), (513,), (True,), (2.0,)]:
        with pytest.raises(ValueError, match="tune_rows"):
            tuning_buckets(512, bad)


def test_restricted_tuning_counted():
    """Batch 1 with 512-token prompts: 2 buckets a Linear shape (4 shapes: 8 tunings), against every
    bucket to 512 before; fewer candidates timed and fewer kernels compiled. (A process of its own:
    the counting records the compiled kernels' launches, not the interpreter's.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_first", "--count"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout)
    first, every = counts["engine"], counts["engine, every bucket"]
    assert first["tunings"] == 8 and every["tunings"] == 4 * 21
    assert first["candidates_timed"] < every["candidates_timed"] / 5
    assert first["matmul_compiles"] < every["matmul_compiles"]
    # batch 32: its rows (8, 16, 24 -> 32, 32, 4096) and its CUDA graphs' buckets 1, 2, 4: 7 buckets
    assert counts["batch32"]["tunings"] == 4 * 7 and counts["batch32, every bucket"]["tunings"] == 96
    steps = [c["matmul_compiles"] for name, c in counts.items() if "every" not in name and "run" not in name]
    assert max(steps) <= counts["run, each compile once"]["matmul_compiles"] <= sum(steps)


def test_triton_key_recipe_matches_triton():
    """``tree_triton_key`` (what the carried cache is keyed with, over the GPU machine's wheel) is
    Triton's own ``triton_key`` over the installed Triton."""
    import triton
    from triton.runtime.cache import triton_key

    from bench.gpu_cache import tree_triton_key

    assert tree_triton_key(Path(triton.__file__).parent, triton.__version__) == triton_key()


def test_unpack_rewrites_child_paths(tmp_path):
    """Triton stores a cache group's files by absolute path: unpacked elsewhere, they must point there."""
    from bench import gpu_cache

    built = tmp_path / "built"
    for key, name in [("AAA", "_gemv_kernel"), ("BBB", "_gemv_kernel"), ("CCC", "_combine_kernel")]:
        entry = built / key
        entry.mkdir(parents=True)
        files = {f"{name}.{ext}": str(entry / f"{name}.{ext}") for ext in ("json", "cubin")}
        for path in files.values():
            Path(path).write_text("x")
        (entry / f"__grp__{name}.json").write_text(json.dumps({"child_paths": files}))
    tar = tmp_path / "cache.tar.xz"
    assert gpu_cache.pack(built, tar, {"commit": "abc"}) == tar.stat().st_size
    there = tmp_path / "there"
    result = gpu_cache.unpack(tar, there)
    assert (result["entries_before"], result["entries_after"]) == (0, 3)
    assert result["manifest"] == {"commit": "abc"}
    assert gpu_cache.entries(there) == {"_combine_kernel": 1, "_gemv_kernel": 2}
    for grp in there.glob("*/__grp__*.json"):
        paths = json.loads(grp.read_text())["child_paths"].values()
        assert all(Path(p).parent == grp.parent and Path(p).exists() for p in paths)
    later = tmp_path / "triton-later.tar.xz"  # entries made from a time on only (a GPU run's own)
    gpu_cache.pack(there, later, since=max(d.stat().st_mtime for d in there.iterdir()) + 1)
    assert gpu_cache.unpack(later, tmp_path / "empty")["entries_after"] == 0
    assert gpu_cache.carried(tmp_path) == [later]


def test_smoke_run(tmp_path):
    """The whole run on CPU in the interpreter (tiny shapes): every step in its child process, the
    record written with W4 against fp16, profiles, attention splits and the cache counts."""
    out = tmp_path / "first.json"
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "LOWBIT_GPU_CACHE": str(tmp_path / "none"),
           "LOWBIT_DISABLE": "native"}  # the script is checked, not the native kernels (their build: minutes)
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_first", "--smoke", "--commit", "test", "--out", str(out),
                           "--steps", "env,engine,attention"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    steps = record["steps"]
    assert {k for k, s in steps.items() if "skipped" not in s} == {"env", "engine", "attention"}
    assert all(steps[k]["passed"] for k in ("env", "engine", "attention"))
    assert steps["env"]["carried_cache"]["usable"] is False
    engine = steps["engine"]
    assert [r["config"] for r in engine["rows"]] == ["fp16", "w4g128"]
    for row in engine["rows"]:
        assert len(row["repeats"]) == 2 and row["itl_s"]["p99"] >= row["itl_s"]["p50"] > 0
        assert set(row["profile"]) == {"prefill", "decode", "decode_eager"} and row["profile"]["decode"]["top"]
    assert engine["w4_vs_fp16"]["itl_speedup"] > 0 and "engine" in record["headlines"]
    assert engine["triton_cache"]["after"] >= engine["triton_cache"]["before"]
    splits = [r for r in steps["attention"]["rows"] if r["path"].startswith("fused-")]
    assert {r["split_factor"] for r in splits} == {1, 2} and all(r["max_abs_err"] < 1e-2 for r in splits)
