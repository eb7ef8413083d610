"""Hostile and absurd input (issue 34), as an attacker or a careless user gives it: the loader reads only
the model directory's own files and refuses sizes, headers and scales that do not hold together, each
with one line and a non-zero exit, never a traceback or minutes of work."""

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from quant import checkpoint
from test_trust import run, write_recipe
from tiny import save_model, tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model, tokenizer = tiny_llama(hidden=64)
    return save_model(model, tokenizer, tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, model_dir):
    where = tmp_path_factory.mktemp("q")
    result = run("quantize", write_recipe(where, model_dir))
    assert result.exit_code == 0, result.output
    return where / "ckpt"


@pytest.fixture
def copy(ckpt, tmp_path):
    return shutil.copytree(ckpt, tmp_path / "copy")


@pytest.fixture
def source(model_dir, tmp_path):
    return shutil.copytree(model_dir, tmp_path / "source")


def one_line_error(result, *needles):
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    for needle in needles:
        assert needle in result.output, result.output


def index_naming(directory, outside: str) -> None:
    """A sharded model's index whose last tensor lies in ``outside``."""
    names = list(load_file(directory / "model.safetensors"))
    weight_map = {n: "model.safetensors" for n in names}
    weight_map[names[-1]] = outside
    (directory / checkpoint.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# ------------------------------------------------------------ the loader stays inside its directory

@pytest.mark.parametrize("outside", ["../../../../etc/passwd", "/etc/passwd"], ids=["dot-dot", "absolute"])
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_quantize_refuses_an_index_naming_a_file_outside_the_model(tmp_path, source, outside, method):
    index_naming(source, outside)
    result = run("quantize", write_recipe(tmp_path, source, method=method))
    one_line_error(result, repr(outside), "not a file inside")
    assert not (tmp_path / "ckpt").exists()


def test_quantize_refuses_a_weights_file_linked_from_elsewhere(tmp_path, source):
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.move(source / "model.safetensors", elsewhere)
    (source / "model.safetensors").symlink_to(elsewhere)
    one_line_error(run("quantize", write_recipe(tmp_path, source)), "is a link to", "outside")


def test_a_hub_snapshot_linking_into_its_blobs_is_read(tmp_path, model_dir):
    """The Hugging Face cache keeps each file once, in blobs/, and links the snapshot's names to it."""
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    blobs = tmp_path / "models--org--tiny" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in model_dir.iterdir():
        shutil.copy(f, blobs / f.name)
        (snapshot / f.name).symlink_to(os.path.relpath(blobs / f.name, snapshot))
    checkpoint.check_contained(snapshot)  # no error
    assert run("quantize", write_recipe(tmp_path, snapshot)).exit_code == 0


@pytest.mark.parametrize("name", ["../outside.json", "/etc/hostname"])
def test_a_manifest_naming_a_file_outside_is_refused(copy, name):
    manifest = json.loads((copy / checkpoint.MANIFEST).read_text())
    manifest["files"][name] = {"sha256": "0" * 64, "bytes": 1}
    (copy / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    for command in (["inspect", copy], ["generate", copy, "--prompt", "a", "--max-new-tokens", 2]):
        one_line_error(run(*command), repr(name), "not a file inside")


# ------------------------------------------------------------ headers bounded by the file

@pytest.mark.parametrize("length", [2 ** 40, 2 ** 62, 2 ** 64 - 1])
def test_a_header_length_beyond_the_file_is_an_error_not_a_memory_error(copy, length):
    weights = copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(struct.pack("<Q", length) + data[8:])
    checkpoint.write_manifest(copy, {"producer": "lowbit"})  # the manifest rewritten to match: still refused
    for command in (["inspect", copy], ["plan", copy, "--memory", "24GB"],
                    ["generate", copy, "--prompt", "a", "--max-new-tokens", 2]):
        one_line_error(run(*command), "model.safetensors", "header")


# ------------------------------------------------------------ NaN scales refused, the tensor named

def with_nan_scale(copy, value=float("nan")) -> str:
    tensors = load_file(copy / "model.safetensors")
    name = sorted(k for k in tensors if k.endswith(".weight_scale"))[3]
    tensors[name][0, 0] = value
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    checkpoint.write_manifest(copy, json.loads((copy / checkpoint.MANIFEST).read_text()))  # "rewritten"
    return name


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_scale_is_refused_at_load_naming_the_tensor(copy, value):
    name = with_nan_scale(copy, value)
    for command in (["inspect", copy], ["generate", copy, "--prompt", "a", "--max-new-tokens", 2],
                    ["eval", copy, "--tokens", 64, "--no-baseline"]):
        one_line_error(run(*command), name, "NaN or infinite")


# ------------------------------------------------------------ config.json checked against the tensors

@pytest.mark.parametrize("key, value, says", [
    ("num_hidden_layers", 100000, "the weights hold 2 decoder layers"),
    ("num_hidden_layers", 1, "the weights hold 2 decoder layers"),
    ("hidden_size", -1, "positive integer"),
    ("hidden_size", 128, "stored embedding"),
    ("vocab_size", 0, "positive integer"),
    ("vocab_size", 10, "stored embedding"),
    ("num_attention_heads", 0, "positive integer"),
    ("num_attention_heads", 8, "q_proj"),
    ("num_key_value_heads", 3, "divide"),
    ("num_hidden_layers", "2", "positive integer"),
    ("num_hidden_layers", True, "positive integer"),
])
def test_a_config_that_does_not_fit_the_weights_is_one_error_naming_the_key(copy, key, value, says):
    config = json.loads((copy / "config.json").read_text())
    config[key] = value
    (copy / "config.json").write_text(json.dumps(config))
    checkpoint.write_manifest(copy, json.loads((copy / checkpoint.MANIFEST).read_text()))
    for command in (["inspect", copy], ["generate", copy, "--prompt", "a", "--max-new-tokens", 2]):
        one_line_error(run(*command), f"{key} is {value!r}", says)


def test_quantize_checks_the_source_config_before_building(tmp_path, source):
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = 100000
    (source / "config.json").write_text(json.dumps(config))
    one_line_error(run("quantize", write_recipe(tmp_path, source, method="gptq")), "num_hidden_layers is 100000")


def test_the_intact_checkpoint_still_loads(ckpt):
    import runtime

    model = runtime.load(ckpt)
    assert torch.isfinite(model.logits(torch.tensor([[1, 2, 3]]))).all()
