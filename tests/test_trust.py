"""What a user trusts lowbit with: checkpoints that cannot be swapped behind the manifest's back, outputs
checked before the work, nothing deleted that lowbit did not write, no pickle, files shared like any tool's."""

import os
import shutil

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import save_file

from lowbit.cli import main
from quant import checkpoint


def write_recipe(where, model_dir, output=None, **weights):
    recipe = {"model": str(model_dir), "output": str(output or where / "ckpt"), "dtype": "float32",
              "weights": {"method": "rtn", "bits": 4, "group_size": 32, **weights}}
    (where / "r.yaml").write_text(yaml.safe_dump(recipe))
    return where / "r.yaml"


def run(*args):
    """The command as a user runs it: an error is a message and an exit code, never a traceback."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, model_dir):
    where = tmp_path_factory.mktemp("q")
    result = run("quantize", write_recipe(where, model_dir))
    assert result.exit_code == 0, result.output
    return where / "ckpt"


@pytest.fixture
def copy(ckpt, tmp_path):
    return shutil.copytree(ckpt, tmp_path / "copy")


def no_quantization(monkeypatch):
    """Make the slow work fail the test if a check that should come first lets it start."""
    import lowbit.pipeline

    def must_not_run(*args, **kwargs):
        raise AssertionError("quantization started although the output cannot be written")

    monkeypatch.setattr(lowbit.pipeline, "quantize_model", must_not_run)


# ------------------------------------------------------------ 2: the manifest covers every loaded file

def test_an_unlisted_tensor_file_is_refused(copy):
    import runtime

    tensors = checkpoint.read_tensors(copy)
    save_file({"model.norm.weight": torch.zeros_like(tensors["model.norm.weight"])}, copy / "zz-extra.safetensors")
    with pytest.raises(checkpoint.CheckpointError, match="zz-extra.safetensors"):
        runtime.load(copy)
    for command in (["eval", copy, "--tokens", 64, "--no-baseline"], ["inspect", copy]):
        result = run(*command)
        assert result.exit_code == 1 and "zz-extra.safetensors" in result.output and "does not list" in result.output


def test_a_removed_manifest_is_said_loudly(copy):
    import runtime

    (copy / checkpoint.MANIFEST).unlink()
    with pytest.warns(checkpoint.UnverifiedCheckpointWarning, match="not verified"):
        runtime.load(copy)
    with pytest.warns(checkpoint.UnverifiedCheckpointWarning):
        result = run("inspect", copy)
    assert result.exit_code == 0 and "NOT VERIFIED" in result.output


def test_a_verified_checkpoint_loads_without_a_warning(ckpt, recwarn):
    assert checkpoint.verify(ckpt)["files"]
    assert not [w for w in recwarn if issubclass(w.category, checkpoint.UnverifiedCheckpointWarning)]


# ------------------------------------------------------------ 3: the output is checked before the work

def test_an_unwritable_output_fails_before_the_work(tmp_path, model_dir, monkeypatch):
    no_quantization(monkeypatch)
    (tmp_path / "a-file").write_text("not a directory")
    result = run("quantize", write_recipe(tmp_path, model_dir, output=tmp_path / "a-file" / "ckpt"))
    assert result.exit_code == 1 and "not a writable directory" in result.output


def test_a_full_disk_fails_before_the_work(tmp_path, model_dir, monkeypatch):
    no_quantization(monkeypatch)
    full = shutil._ntuple_diskusage(total=10**9, used=10**9 - 1000, free=1000)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: full)
    result = run("quantize", write_recipe(tmp_path, model_dir))
    assert result.exit_code == 1 and "not enough disk space" in result.output
    assert not (tmp_path / "ckpt").exists()


def test_the_size_estimate_is_close_to_the_checkpoint(ckpt, model_dir):
    from lowbit.pipeline import checkpoint_size_estimate
    from lowbit.recipe_files import load_recipe

    estimate = checkpoint_size_estimate(model_dir, load_recipe(ckpt.parent / "r.yaml"))
    actual = (ckpt / "model.safetensors").stat().st_size
    assert 0.8 * actual < estimate < 1.5 * actual


# ------------------------------------------------------------ 4: what an interrupted save left

def test_leftovers_of_an_interrupted_save_are_removed_and_said(tmp_path, model_dir):
    dead = tmp_path / ".ckpt.partial-999999999-abc"  # no process has this pid
    live = tmp_path / f".ckpt.partial-{os.getppid()}-def"  # a save still running
    for d in (dead, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    result = run("quantize", write_recipe(tmp_path, model_dir))
    assert result.exit_code == 0, result.output
    assert not dead.exists() and str(dead) in result.output and "interrupted" in result.output
    assert live.exists()


# ------------------------------------------------------------ 5: never pickle

def test_pickle_weights_are_refused_before_loading(tmp_path, model_dir, monkeypatch):
    pickled = tmp_path / "pickled"
    shutil.copytree(model_dir, pickled)
    torch.save(checkpoint.read_tensors(pickled), pickled / "pytorch_model.bin")
    for f in pickled.glob("*.safetensors"):
        f.unlink()

    def no_torch_load(*args, **kwargs):
        raise AssertionError("torch.load reached")

    monkeypatch.setattr(torch, "load", no_torch_load)
    for method in ("rtn", "gptq"):
        result = run("quantize", write_recipe(tmp_path, pickled, method=method))
        assert result.exit_code == 1 and "pytorch_model.bin" in result.output and "pickle" in result.output


# ------------------------------------------------------------ 6: inspect verifies as load does

@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_inspect_of_a_truncated_file_is_an_error_not_a_traceback(copy, manifest):
    if not manifest:
        (copy / checkpoint.MANIFEST).unlink()
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    result = run("inspect", copy)
    assert result.exit_code == 1 and "model.safetensors" in result.output


def test_inspect_of_an_altered_checkpoint_is_an_error(copy):
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    result = run("inspect", copy)
    assert result.exit_code == 1 and "sha256" in result.output


@pytest.mark.parametrize("edit", [
    lambda qc: qc["config_groups"]["group_0"]["weights"].pop("num_bits"),
    lambda qc: qc.update(config_groups="all"),
    lambda qc: qc.update(format="gguf"),
], ids=["no-bits", "groups-not-a-mapping", "foreign-format"])
def test_inspect_of_an_edited_config_without_manifest_is_one_line(copy, edit):
    import json

    (copy / checkpoint.MANIFEST).unlink()
    config = json.loads((copy / "config.json").read_text())
    edit(config["quantization_config"])
    (copy / "config.json").write_text(json.dumps(config))
    result = run("inspect", copy)
    assert result.exit_code == 1 and "config" in result.output and len(result.output.splitlines()) <= 3


# ------------------------------------------------------------ 7: --overwrite replaces only checkpoints

def test_overwrite_refuses_a_directory_that_is_not_a_checkpoint(tmp_path, model_dir):
    precious = tmp_path / "ckpt"
    precious.mkdir(mode=0o755)
    (precious / "thesis.tex").write_text("years of work")
    result = run("quantize", write_recipe(tmp_path, model_dir), "--overwrite")
    assert result.exit_code == 1 and "not a lowbit checkpoint" in result.output
    assert (precious / "thesis.tex").read_text() == "years of work" and precious.stat().st_mode & 0o777 == 0o755


def test_overwrite_replaces_a_checkpoint(tmp_path, model_dir):
    recipe = write_recipe(tmp_path, model_dir)
    assert run("quantize", recipe).exit_code == 0
    result = run("quantize", recipe, "--overwrite")
    assert result.exit_code == 0, result.output
    assert checkpoint.verify(tmp_path / "ckpt") is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "r.yaml"]


# ------------------------------------------------------------ 8: a group size that fits no layer

def test_a_group_that_divides_no_layer_is_an_error_naming_sizes_that_work(tmp_path, model_dir, monkeypatch):
    no_quantization(monkeypatch)
    result = run("quantize", write_recipe(tmp_path, model_dir, group_size=7))
    # the tiny model's Linears take 64 or 160 inputs: the groups dividing both
    assert result.exit_code == 1 and "group_size 7 fits" in result.output and "8, 16, 32, -1" in result.output
    assert not (tmp_path / "ckpt").exists()


# ------------------------------------------------------------ files are shared like any tool's

@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_checkpoint_modes_follow_the_umask(tmp_path, model_dir, umask):
    old = os.umask(umask)
    try:
        assert run("quantize", write_recipe(tmp_path, model_dir)).exit_code == 0
    finally:
        os.umask(old)
    out = tmp_path / "ckpt"
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == {f.name: 0o666 & ~umask for f in out.iterdir()}
