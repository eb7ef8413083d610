"""bench/gpu_check.py, the one command a session with a lent GPU runs first, cannot rot: its smoke
run (every stage, CPU + Triton interpreter, tiny shapes) passes here, and what it imports works
with only the GPU machine's packages (no calibration-only ones such as greenlet or gguf)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# packages the lent GPU image lacks (or that only calibration, lm-eval or interchange tests need)
ABSENT_ON_GPU_MACHINE = ["greenlet", "gguf", "lm_eval", "compressed_tensors", "llmcompressor"]


def test_runtime_and_benches_import_without_calibration_packages():
    script = textwrap.dedent(f"""
        import importlib, importlib.abc, sys
        class Absent(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split('.')[0] in {ABSENT_ON_GPU_MACHINE!r}:
                    raise ModuleNotFoundError(f"No module named '{{name}}'")
        sys.meta_path.insert(0, Absent())
        sys.path.insert(0, 'bench')
        from bench import gpu_stages
        import gpu_check  # noqa: F401
        print(gpu_stages.missing_imports())
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "{}"


def test_smoke_runs_every_stage_and_records_each(tmp_path):
    results = tmp_path / "check.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it per stage
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--smoke", "--out", str(results)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    record = json.loads(results.read_text())
    assert record["smoke"] is True
    assert set(record["stages"]) == {"env", "weights", "attention", "engine", "tests", "kernel-speed",
                                     "attention-speed", "engine-speed"}
    for name, stage in record["stages"].items():
        assert stage["passed"], (name, stage.get("error"), stage.get("failed"))
    assert record["stages"]["weights"]["cases"] > 0 and record["stages"]["attention"]["cases"] > 0
    assert record["stages"]["tests"]["counts"]
    assert "SMOKE" in proc.stdout  # the table says its timings mean nothing


def test_a_failing_stage_is_recorded_and_the_next_runs(tmp_path):
    """Without a GPU the real stages fail: each failure is recorded with its reason, the next stage
    still runs, the file holds both, and the exit status says so."""
    results = tmp_path / "check.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--stages", "weights,kernel-speed", "--commit",
                           "abc1234", "--out", str(results)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 1
    record = json.loads(results.read_text())
    assert record["commit"] == "abc1234"
    assert list(record["stages"]) == ["weights", "kernel-speed"]
    assert "no CUDA device" in record["stages"]["weights"]["error"]
    assert "needs a CUDA device" in record["stages"]["kernel-speed"]["error"]
    assert "FAIL" in proc.stdout
