"""Calibration on two ranks (gloo, CPU) against one process, on a tiny random model: what a user
running `torchrun ... -m lowbit quantize` relies on. Ranks are forked processes that join the
process group from the environment as torchrun's do; one test goes through `--ranks 2`, torchrun
itself."""

import json
import multiprocessing
import os
import signal
import socket
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from lowbit.cli import main
from quant import checkpoint
from tiny import TEXT, save_model, tiny_llama

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one thread per process (as each forked rank has) is faster on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model, tokenizer = tiny_llama(hidden=64, layers=3)
    where = save_model(model, tokenizer, tmp_path_factory.mktemp("models") / "tiny")
    (where.parent / "calibration.txt").write_text(TEXT * 8)  # the bundled novels take the tiny tokenizer long
    return where


def write_recipe(where: Path, model_dir, methods, **calibration) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    recipe = {
        "model": str(model_dir), "output": str(where / "ckpt"), "dtype": "float32",
        "calibration": {"text": str(Path(model_dir).parent / "calibration.txt"), "samples": 8, "seq_len": 32,
                        **calibration},
        "weights": {"methods": methods, "bits": 4, "group_size": 32, "symmetric": False, "ignore": ["lm_head"]},
    }
    (where / "r.yaml").write_text(yaml.safe_dump(recipe))
    return where / "r.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, size: int, port: int, args: list, fault, report: Path) -> None:
    """One rank, as torchrun would start it: the process group from the environment, then the CLI."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if fault is not None:
        args = fault(rank) or args  # a fault may change what this rank runs
    result = CliRunner().invoke(main, [str(a) for a in args])
    report.write_text(json.dumps({"code": result.exit_code, "output": result.output}))


def run_ranks(args: list, size: int = 2, fault=None, timeout: float = 120) -> list[dict]:
    """``lowbit ARGS`` on ``size`` forked ranks; each rank's exit code and output (a rank that
    died without a word: code None)."""
    reports = Path(args[1]).parent / "ranks"
    reports.mkdir(exist_ok=True)
    port = _free_port()
    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=_rank, args=(r, size, port, args, fault, reports / f"{r}.json"))
             for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            raise AssertionError("a rank hung")
    out = []
    for r in range(size):
        f = reports / f"{r}.json"
        out.append(json.loads(f.read_text()) if f.exists() else {"code": None, "output": ""})
        f.unlink(missing_ok=True)
    return out


def quantize_one(recipe: Path) -> dict:
    result = CliRunner().invoke(main, ["quantize", str(recipe)])
    assert result.exit_code == 0, result.output
    return checkpoint.read_tensors(recipe.parent / "ckpt")


def quantize_two(recipe: Path, *extra) -> dict:
    ranks = run_ranks(["quantize", recipe, *extra])
    assert [r["code"] for r in ranks] == [0, 0], ranks
    assert "saved" in ranks[0]["output"] and "saved" not in ranks[1]["output"]  # rank 0 alone writes and reports
    manifest = checkpoint.verify(recipe.parent / "ckpt")
    assert manifest["world_size"] == 2
    return checkpoint.read_tensors(recipe.parent / "ckpt")


def assert_nothing_written(where: Path):
    assert sorted(p.name for p in where.iterdir() if not p.name.startswith((".ckpt.work", "ranks"))) == ["r.yaml"]


def test_two_ranks_round_to_nearest_bit_identical(tmp_path, model_dir):
    """RTN (each rank rounds its share of the Linears): the same checkpoint, bit for bit."""
    one = quantize_one(write_recipe(tmp_path / "one", model_dir, ["rtn"]))
    two = quantize_two(write_recipe(tmp_path / "two", model_dir, ["rtn"]))
    assert one.keys() == two.keys() and any(k.endswith("weight_packed") for k in one)
    for name in one:
        assert torch.equal(one[name], two[name]), name


def _codes(tensors: dict) -> dict:
    from quant.packing import unpack

    return {k: unpack(v, 4, int(tensors[k.replace("_packed", "_shape")][1]), dim=1)
            for k, v in tensors.items() if k.endswith("weight_packed")}


# Measured on this model (3 layers, 21 Linears, 129,024 weights; 8 samples of 32 tokens; pytest -s
# prints MEASURED lines): two ranks sum xᵀx and AWQ's statistics in another order. GPTQ: the same
# codes, output_rel_error within 9e-7. AWQ+RTN: the same codes, AWQ's norms within 5e-7. AWQ+GPTQ:
# AWQ's scales within 4e-7 relative, which GPTQ's error feedback turns into 1,518 flipped codes
# (1.2%) at the same quality (output_rel_error within 1.1e-3 relative). Bounds: a few times that.
CODE_CHANGE_SHARE = 0.05  # integer codes that differ
OUTPUT_ERROR_RTOL = 0.01  # each Linear's output_rel_error (weight_rel_error without GPTQ) in the manifest
FLOAT_RTOL = 1e-5  # scales, AWQ's rescaled norms, every float tensor


@pytest.mark.parametrize("methods", [["gptq"], ["awq", "gptq"], ["awq"]])
def test_two_ranks_calibrated_within_summation_noise(tmp_path, model_dir, methods):
    """GPTQ, AWQ+GPTQ and AWQ+RTN on two ranks: statistics summed in another order, so a few codes
    may round the other way; the errors the manifest records, the scales and AWQ's norms agree."""
    one = quantize_one(write_recipe(tmp_path / "one", model_dir, methods))
    two = quantize_two(write_recipe(tmp_path / "two", model_dir, methods))
    assert one.keys() == two.keys()
    codes_one, codes_two = _codes(one), _codes(two)
    changed = sum(int((codes_one[n] != codes_two[n]).sum()) for n in codes_one)
    total = sum(c.numel() for c in codes_one.values())
    floats = [n for n in one if not n.endswith(("weight_packed", "weight_zero_point"))]
    worst = max(float(((two[n].float() - one[n].float()).abs() / one[n].float().abs().clamp_min(1e-6)).max())
                for n in floats)
    layers = [checkpoint.read_manifest(tmp_path / w / "ckpt")["layers"] for w in ("one", "two")]
    key = "output_rel_error" if "gptq" in methods else "weight_rel_error"
    drift = max(abs(layers[1][n][key] / layers[0][n][key] - 1) for n in layers[0])
    print(f"MEASURED {methods}: {changed} of {total} codes differ; worst relative difference of the float "
          f"tensors {worst:.1e}; of {key} {drift:.1e}")
    assert changed <= CODE_CHANGE_SHARE * total, f"{changed} of {total} codes differ"
    assert drift <= OUTPUT_ERROR_RTOL
    assert worst <= FLOAT_RTOL


def test_mismatched_recipes_are_refused(tmp_path, model_dir):
    recipe = write_recipe(tmp_path, model_dir, ["gptq"])
    other = write_recipe(tmp_path / "other", model_dir, ["gptq"], seed=1)

    def rank1_reads_another(rank):  # a stale copy of the recipe on one machine
        return ["quantize", other] if rank == 1 else None

    ranks = run_ranks(["quantize", recipe], fault=rank1_reads_another)
    assert all(r["code"] not in (0, None) for r in ranks), ranks
    assert "the recipe differs between ranks: rank(s) 1" in ranks[0]["output"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "r.yaml", "ranks"]
    assert sorted(p.name for p in other.parent.iterdir()) == ["r.yaml"]


def test_a_method_that_does_not_sum_across_ranks_is_refused_before_any_work(tmp_path, model_dir):
    recipe = write_recipe(tmp_path, model_dir, ["signround"])
    ranks = run_ranks(["quantize", recipe])
    assert all(r["code"] not in (0, None) for r in ranks), ranks
    assert "signround runs in one process only" in ranks[0]["output"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml", "ranks"]


def test_a_failing_rank_stops_every_rank_with_the_rank_named(tmp_path, model_dir):
    recipe = write_recipe(tmp_path, model_dir, ["gptq"])

    def rank1_fails_in_layer1(rank):
        import quant.gptq

        real = quant.gptq.gptq_quantize

        def failing(weight, H, scheme, config, scale_dtype, name):
            if rank == 1 and ".layers.1." in name:
                raise ValueError("the disk is on fire")
            return real(weight, H, scheme, config, scale_dtype, name)

        quant.gptq.gptq_quantize = failing
        import quant.methods.gptq
        quant.methods.gptq.gptq_quantize = failing

    ranks = run_ranks(["quantize", recipe], fault=rank1_fails_in_layer1)
    assert [r["code"] for r in ranks] == [1, 1], ranks
    assert "rank 1 of 2 failed: ValueError: the disk is on fire" in ranks[1]["output"]
    assert "stopped on rank 0: rank 1 of 2 failed: ValueError: the disk is on fire" in ranks[0]["output"]
    assert_nothing_written(tmp_path)


def test_a_killed_rank_leaves_nothing_and_resume_finishes(tmp_path, model_dir):
    """Rank 1 dies (SIGKILL: no word) after layer 1; the other stops naming what it knows; no
    checkpoint; --resume on two ranks finishes with the checkpoint an uninterrupted run makes."""
    recipe = write_recipe(tmp_path, model_dir, ["awq", "gptq"])

    def rank1_dies_after_layer1(rank):
        import quant.sequential

        real = quant.sequential.save_progress

        def save_then_die(work_dir, i, *args, **kwargs):
            real(work_dir, i, *args, **kwargs)
            if rank == 1 and i == 1:
                os.kill(os.getpid(), signal.SIGKILL)

        quant.sequential.save_progress = save_then_die

    ranks = run_ranks(["quantize", recipe], fault=rank1_dies_after_layer1)
    assert ranks[1]["code"] is None and ranks[0]["code"] == 1, ranks
    assert "another rank vanished" in ranks[0]["output"]
    assert_nothing_written(tmp_path)
    resumed = run_ranks(["quantize", recipe, "--resume"])
    assert [r["code"] for r in resumed] == [0, 0], resumed
    assert "resuming from" in resumed[0]["output"]
    got = checkpoint.read_tensors(tmp_path / "ckpt")
    assert not (tmp_path / ".ckpt.work").exists()
    fresh = quantize_two(write_recipe(tmp_path / "fresh", model_dir, ["awq", "gptq"]))
    assert got.keys() == fresh.keys()
    for name in got:
        assert torch.equal(got[name], fresh[name]), name


def test_resume_with_another_number_of_ranks_is_refused(tmp_path, model_dir):
    recipe = write_recipe(tmp_path, model_dir, ["gptq"])

    def stop_after_layer0(rank):
        import quant.sequential

        real = quant.sequential.save_progress

        def save_then_stop(work_dir, i, *args, **kwargs):
            real(work_dir, i, *args, **kwargs)
            raise KeyboardInterrupt

        quant.sequential.save_progress = save_then_stop

    run_ranks(["quantize", recipe], fault=stop_after_layer0)
    result = CliRunner().invoke(main, ["quantize", str(recipe), "--resume"])
    assert result.exit_code == 1 and "made by 2 rank(s), this run has 1" in result.output
    assert_nothing_written(tmp_path)


def test_ranks_option_runs_torchrun(tmp_path, model_dir, monkeypatch, capfd):
    """`lowbit quantize --ranks 2`: torchrun starts two ranks of `python -m lowbit quantize`."""
    recipe = write_recipe(tmp_path, model_dir, ["gptq"])
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    result = CliRunner().invoke(main, ["quantize", str(recipe), "--ranks", "2", "--device", "cpu"])
    out = capfd.readouterr()
    assert result.exit_code == 0, out.out + out.err
    assert "calibrated on 2 ranks" in out.out
    assert checkpoint.verify(tmp_path / "ckpt")["world_size"] == 2
