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
# packages the lent GPU image lacks (or that only calibration, lm-eval, interchange or serve tests need;
# /work/.library/device/KINDS.md lists the image's packages)
ABSENT_ON_GPU_MACHINE = ["greenlet", "gguf", "lm_eval", "compressed_tensors", "llmcompressor", "starlette", "uvicorn",
                         "openai"]
# What a device call carries: the tracked tree (plus untracked files and carried wheels) within 64 MiB
# (the device tool's README); tracked files keep half of it, so wheels and a session's files fit too.
DEVICE_TREE_LIMIT = 64 << 20


def test_runtime_and_benches_import_without_calibration_packages():
    script = textwrap.dedent(f"""
        import importlib, importlib.abc, sys
        class Absent(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split('.')[0] in {ABSENT_ON_GPU_MACHINE!r}:
                    raise ModuleNotFoundError(f"No module named '{{name}}'")
        sys.meta_path.insert(0, Absent())
        from bench import gpu_check, gpu_stages  # noqa: F401
        print(gpu_stages.missing_imports())
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "{}"


def test_the_tracked_tree_leaves_room_in_what_a_device_call_carries():
    import pytest

    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    files = [ROOT / name for name in listed.stdout.decode().split("\0") if name]
    size = sum(f.stat().st_size for f in files if f.is_file())
    assert size <= DEVICE_TREE_LIMIT // 2, f"tracked files take {size / 2**20:.1f} MiB of the device's 64 MiB"


def test_smoke_runs_every_stage_and_records_each(tmp_path):
    results = tmp_path / "check.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it per stage
    # the plain-script form the lent GPU machine's instructions give (every other bench: python -m bench.X)
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
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--stages", "weights,kernel-speed", "--commit",
                           "abc1234", "--out", str(results)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 1
    record = json.loads(results.read_text())
    assert record["commit"] == "abc1234"
    assert list(record["stages"]) == ["weights", "kernel-speed"]
    assert "no CUDA device" in record["stages"]["weights"]["error"]
    assert "needs a CUDA device" in record["stages"]["kernel-speed"]["error"]
    assert "FAIL" in proc.stdout


def test_smoke_is_refused_where_the_interpreter_is_broken(monkeypatch, capsys):
    """The lent GPU machine (triton 3.6.0, numpy 2.5.2) cannot run the interpreter: --smoke says so
    instead of failing every kernel; the real stages never inherit TRITON_INTERPRET."""
    import pytest

    from bench import gpu_check, gpu_stages

    assert "numpy 2.5.2" in gpu_stages.interpreter_problem("3.6.0", "2.5.2")
    assert gpu_stages.interpreter_problem("3.6.0", "2.3.5") is None
    assert gpu_stages.interpreter_problem("3.9.0", "2.5.2") is None
    monkeypatch.setattr(gpu_stages, "interpreter_problem", lambda: "the Triton 3.6.0 interpreter fails")
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--smoke", "--out", "unused.json"])
    assert exit_.value.code == 2 and "interpreter fails" in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "TRITON_INTERPRET" not in gpu_check.child_env(smoke=False, commit="abc1234")


def test_the_tests_stage_lists_what_it_skipped_for_absent_packages(tmp_path):
    """Without greenlet (as on the GPU machine) the GPTQ/AWQ checkpoint tests skip, and the stage's
    result names them as skipped for an absent package, not failed."""
    from bench import gpu_stages

    shadow = tmp_path / "greenlet"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'greenlet'\", name='greenlet')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    result = gpu_stages.run_pytest(["tests/test_kernels_linear.py"], env=env,
                                   args=("-k", "checkpoints_run_through_the_kernels_unchanged and (gptq or awq)"))
    assert result["passed"] and result["counts"].get("skipped") == 2, result
    assert sum(s["tests"] for s in result["skipped_for_absent_packages"]) == 2
    assert all("greenlet" in s["reason"] for s in result["skipped_for_absent_packages"])


def test_the_torch_int4_peer_matches_the_dense_weight_and_takes_cudas_layout():
    """bench/kernels.py's peer, PyTorch's int4 kernel, from the same checkpoint tensors as ours: on
    CPU (the CPU variants) it gives the dense weight's product; the CUDA operands have the layout
    and types ``_convert_weight_to_int4pack`` / ``_weight_int4pack_mm`` check (their meta kernels,
    under fake tensors), so the first lent GPU does not stop on an argument."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench.kernels import TORCH_INT4_INNER_K_TILES, TorchInt4, cuda_nibbles, quantized_weight, rel_error
    from quant.packing import unpack

    K, N = 256, 64
    _, dense, scheme, checkpoint = quantized_weight(K, N, 4, 128, torch.device("cpu"))
    peer = TorchInt4.build(*checkpoint, K, N, scheme, "cpu")
    x = torch.randn(3, K, dtype=torch.bfloat16)
    assert rel_error(peer(x), F.linear(x, dense.to(torch.bfloat16))) < 2e-2
    nibbles, u = cuda_nibbles(checkpoint[0], K), unpack(checkpoint[0], 4, K, dim=1) + 8
    assert nibbles.dtype == torch.uint8 and torch.equal(nibbles >> 4, u[:, ::2].to(torch.uint8))
    assert torch.equal(nibbles & 15, u[:, 1::2].to(torch.uint8))
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_gpu = TorchInt4.on_device(nibbles, peer.cpu_layer.scale_zeros, peer.group, "cpu")
        out = on_gpu(torch.empty(3, K, dtype=torch.float16))
    assert tuple(on_gpu.weight.shape) == (N // 8, K // (TORCH_INT4_INNER_K_TILES * 16), 32, TORCH_INT4_INNER_K_TILES // 2)
    assert tuple(out.shape) == (3, N) and out.dtype == torch.bfloat16


def test_the_two_calls_run_every_stage_once_within_their_budgets():
    """--call 1 and --call 2 are the whole check: every stage once, steps in order, a step's
    stages at once only where they time nothing, each call's budgets inside ~5.5 minutes."""
    import argparse

    from bench import gpu_check

    ap = argparse.ArgumentParser()
    steps = {n: gpu_check.plan(argparse.Namespace(call=n, stages=None), ap) for n in gpu_check.CALLS}
    names = [name for call in steps.values() for step in call for name in step]
    assert sorted(names) == sorted(gpu_check.BY_NAME)
    for call in steps.values():
        for step in call:
            assert len(step) == 1 or not any(name.endswith("-speed") for name in step), step
        assert sum(max(gpu_check.BY_NAME[n].budget_s for n in step) for step in call) <= 330
    assert gpu_check.plan(argparse.Namespace(call=None, stages="env,weights+tests"), ap) == [["env"], ["weights", "tests"]]


def test_a_stage_cut_at_its_budget_keeps_what_it_reported(tmp_path, monkeypatch):
    """The child saved a partial result and then ran past its budget: the parent kills it and
    keeps the partial result, failed, with why."""
    import argparse

    from bench import gpu_check

    script = ("import json, sys, time; from pathlib import Path; "
              "Path(sys.argv[1]).write_text(json.dumps({'passed': True, 'cases': 1, 'results': [{'passed': True}], "
              "'failed': [], 'partial': True})); print('reported', flush=True); time.sleep(60)")
    monkeypatch.setattr(gpu_check, "child_command",
                        lambda name, out, shard, smoke: [sys.executable, "-c", script, str(out)])
    monkeypatch.setattr(gpu_check, "SAVE_EVERY_S", 0.5)
    args = argparse.Namespace(smoke=False, commit="abc1234")
    progress = []
    result = gpu_check.run_stage(gpu_check.Stage("weights", 3, None, shards=2), args, 3, progress.append)
    assert progress and progress[-1]["cases"] == 2  # saved while it ran too (a cut device call keeps it)
    assert result["passed"] is False and result["cases"] == 2 and len(result["results"]) == 2
    assert "ran out of its 3 s budget; what it had measured is kept" in result["error"]
    assert result["wall_s"] < 30 and "reported" in "\n".join(result["output_tail"])


def test_a_stage_that_raises_after_reporting_keeps_its_results(tmp_path, monkeypatch):
    from bench import gpu_check

    def stage(smoke, shard, report):
        report({"passed": True, "record": {"rows": [1]}})
        raise RuntimeError("the second row broke")

    monkeypatch.setitem(gpu_check.BY_NAME, "fake", gpu_check.Stage("fake", 10, stage))
    out = tmp_path / "result.json"
    gpu_check.child("fake", out, smoke=True, shard=(0, 1))
    result = json.loads(out.read_text())
    assert result["record"] == {"rows": [1]} and result["passed"] is False
    assert "the second row broke" in result["error"]


def test_shards_merge_into_one_stage_result():
    from bench.gpu_stages import merge_shards

    a = {"passed": True, "cases": 2, "results": [{"passed": True}] * 2, "failed": [], "worst_rel_error": 1e-4}
    b = {"passed": False, "cases": 1, "results": [{"passed": False}], "failed": [{"passed": False}],
         "worst_rel_error": 3e-3}
    merged = merge_shards([a, b])
    assert merged["passed"] is False and merged["cases"] == 3 and len(merged["results"]) == 3
    assert merged["worst_rel_error"] == 3e-3 and len(merged["failed"]) == 1
    tests = merge_shards([{"passed": True, "counts": {"passed": 3}, "failures": []},
                          {"passed": True, "counts": {"passed": 1, "skipped": 2}, "failures": []}])
    assert tests["counts"] == {"passed": 4, "skipped": 2} and tests["passed"] is True


def test_the_weight_check_runs_two_fixed_configurations_per_row_count():
    """No autotuning in the weight check: the default of each M regime and one with other tiles, and
    from 2 to 8 rows the few-row GEMV (a tuner candidate there, never a default)."""
    import torch

    from bench.correctness import launch_configs, quantized_linear, weight_cases

    case = weight_cases(smoke=True)[0]
    kw, _ = quantized_linear(case, torch.device("cpu"), 0)
    for M in (1, 3, 17, 300):
        (label, default), (other_label, other), *rest = launch_configs(M, kw, case["dtype"])
        assert (label, other_label) == ("default", "other-tiles")
        assert (default.block_m, default.block_n) != (other.block_m, other.block_n)
        if M == 3:
            [(rows_label, rows)] = rest
            assert rows_label == "gemv-rows" and not rows.use_dot and rows.block_m == 4
        else:
            assert rest == []


def test_precompile_replays_exactly_the_compiles_it_counted():
    """bench/gpu_compiles: the tasks recorded for a stage, rebuilt in a worker on meta tensors, launch
    with Triton's warmup (compile only) and give the same compile keys as the stage's own launches.
    (A process of its own: the counting needs the compiled kernels, not the interpreter's.)"""
    script = textwrap.dedent("""
        import json, torch
        from unittest import mock
        from triton.runtime.jit import JITFunction
        from bench import gpu_compiles
        counted = gpu_compiles.COUNTERS["kernel-speed"]()
        seen, warmups = set(), []
        def run(fn, *args, grid, warmup, **kwargs):
            warmups.append(warmup)
            seen.add(gpu_compiles.compile_key(fn, args, kwargs))
        with mock.patch.object(JITFunction, "run", run), \\
                mock.patch.object(torch.cuda, "get_device_capability", lambda *args: (9, 0)):
            done, errors = gpu_compiles.compile_tasks(counted["tasks"])
        print(json.dumps(dict(tunings=counted["tunings"], compiles=counted["matmul_compiles"],
                              tasks=len(counted["tasks"]), done=done, errors=errors, seen=len(seen),
                              all_warmup=all(warmups))))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    from bench.gpu_compiles import KERNEL_SPEED_ROWS

    assert got["tunings"] == 5 * len(KERNEL_SPEED_ROWS) and got["compiles"] > 0 and got["errors"] == []
    assert got["done"] == got["tasks"] and got["seen"] == got["compiles"] and got["all_warmup"]


def test_a_failed_precompile_costs_the_stage_nothing_but_its_time():
    """Where it cannot run (no GPU here): the speed stages' head start reports why and returns."""
    from bench import gpu_stages

    result = gpu_stages.precompile("kernel-speed")
    assert "error" in result or result["error_count"] > 0


def test_precompiled_kernels_are_found_by_real_launches_under_each_triton_release(triton_release):
    """What the speed stages' precompile relies on, without a GPU: warmup launches on meta tensors
    compile for sm_90a through Triton's own binder and compiler, and the same launches on real tensors
    in a new process find every one of them in Triton's cache (no compile of their own)."""
    run = triton_release.run(["-m", "bench.gpu_compiles", "--stages", "kernel-speed", "--offline", "3"])
    assert run.returncode == 0, run.stderr[-3000:]
    (result,) = json.loads(run.stdout)
    assert result["compile"]["done"] == result["compile"]["tasks"] == 3 and not result["compile"]["errors"]
    assert result["compile"]["cache_entries"] >= 3 and result["replay_hit_cache"], result


def test_the_headlines_name_the_tuned_launch_per_few_row_count():
    """kernel-speed's rows from 2 to 16: which launch the tuner chose (few-row GEMV or tl.dot by stages)."""
    from bench.gpu_headlines import _winner_headlines

    def row(M, **config):
        base = dict(block_m=16, block_n=64, use_dot=True, num_stages=2)
        return {"M": M, "impl": "lowbit", "config": {**base, **config}}

    record = {"results": [row(1, block_m=1, use_dot=False), row(4, block_m=4, block_n=128, use_dot=False),
                          row(4), row(4, block_m=4, block_n=128, use_dot=False), row(16, num_stages=3),
                          {"M": 16, "impl": "torch-fp16"}]}
    assert _winner_headlines(record) == [
        {"target": "M=4 tuned launches", "met": None, "measured": "gemv-rows 4x128 x2, tl.dot 16x64 2 stages x1"},
        {"target": "M=16 tuned launches", "met": None, "measured": "tl.dot 16x64 3 stages x1"}]
