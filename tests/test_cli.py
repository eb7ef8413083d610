"""The command line as a user drives it, on a tiny random model: happy paths and bad input."""

import json

import pytest
import torch
import yaml
from click.testing import CliRunner

from lowbit.cli import main
from cli_runner import run
from tiny import save_model, tiny_llama, tiny_tokenizer


def write_recipe(path, model_dir, **weights):
    recipe = {
        "model": str(model_dir),
        "output": str(path.parent / "ckpt"),
        "dtype": "float32",
        "weights": {"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False, "ignore": ["lm_head"], **weights},
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, model_dir):
    recipe = write_recipe(tmp_path_factory.mktemp("q") / "r.yaml", model_dir)
    result = run("quantize", recipe)
    assert result.exit_code == 0, result.output
    return recipe.parent / "ckpt"


def test_quantize_writes_a_checkpoint_and_shows_it(ckpt):
    assert (ckpt / "config.json").exists() and (ckpt / "lowbit_manifest.json").exists()
    out = run("inspect", ckpt).output
    assert "model.layers.1.mlp.down_proj" in out and "w4 g32 asym" in out
    assert "bits/weight" in out and "lm_head" in out


def test_eval_reports_json_with_the_keys_users_read(ckpt, tmp_path):
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    result = run("eval", ckpt, "--tokens", 300, "--window", 64, "--stride", 32, "--json", out_json, "--report", out_md)
    assert result.exit_code == 0, result.output
    r = json.loads(out_json.read_text())
    for key in ("ppl", "baseline_ppl", "tokens", "bytes_on_disk", "bits_per_weight", "delta_ppl_pct", "protocol"):
        assert r[key] is not None, key
    assert r["tokens"] == 300
    assert 4.0 < r["bits_per_weight"] < 6.0  # 4-bit values plus one scale and zero per 32
    assert "window 64" in out_md.read_text()


def test_generate_streams_and_times(ckpt):
    result = CliRunner().invoke(main, ["generate", str(ckpt), "--prompt", "Anne Elliot", "--max-new-tokens", "5"])
    assert result.exit_code == 0, result.output
    assert "TTFT" in result.output and "ITL" in result.output


def test_command_line_overrides_the_recipe(tmp_path, model_dir):
    recipe = write_recipe(tmp_path / "r.yaml", model_dir)
    result = run("quantize", recipe, "--output", tmp_path / "elsewhere")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "elsewhere" / "config.json").exists() and not (tmp_path / "ckpt").exists()


def test_existing_output_needs_overwrite(ckpt):
    recipe = ckpt.parent / "r.yaml"
    before = (ckpt / "model.safetensors").stat().st_mtime_ns
    result = run("quantize", recipe)
    assert result.exit_code != 0 and "--overwrite" in result.output
    assert (ckpt / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"weights": {"bitz": 4}}, "weights.bitz"),
        ({"weights": {"bits": 5}}, "weights.bits"),
        ({"model": "/no/such/model"}, "/no/such/model"),
    ],
)
def test_bad_recipes_fail_with_the_key_and_write_nothing(tmp_path, model_dir, edit, message):
    recipe = {"model": str(model_dir), "output": str(tmp_path / "ckpt")}
    recipe.update(edit)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    result = run("quantize", tmp_path / "r.yaml")
    assert result.exit_code != 0
    assert message in result.output
    assert not (tmp_path / "ckpt").exists()


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"model": str(tmp_path / "gpt2"), "output": str(tmp_path / "o")}))
    result = run("quantize", tmp_path / "r.yaml")
    assert result.exit_code != 0 and "gpt2" in result.output and "llama" in result.output
    assert not (tmp_path / "o").exists()


def test_altered_checkpoint_is_refused_by_eval_and_generate(ckpt, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (bad / "model.safetensors").write_bytes(bytes(data))
    for args in (["eval", bad, "--tokens", 64], ["generate", bad, "--prompt", "x"]):
        result = run(*args)
        assert result.exit_code != 0 and "sha256" in result.output and "model.safetensors" in result.output


def test_eval_of_an_unquantized_model_needs_no_manifest(model_dir, tmp_path):
    out_json = tmp_path / "r.json"
    result = run("eval", model_dir, "--tokens", 100, "--window", 64, "--stride", 32, "--json", out_json)
    assert result.exit_code == 0, result.output
    r = json.loads(out_json.read_text())
    assert r["baseline_ppl"] is None and r["bits_per_weight"] == 32.0 and r["quantized_params"] == 0
    assert (r["protocol"]["bos_mode"], r["protocol"]["bos"]) == ("auto", False)  # its tokenizer adds no BOS


@pytest.fixture(scope="module")
def bos_model_dir(tmp_path_factory):
    """The tiny model with a tokenizer that begins everything it encodes with its BOS (as Gemma's does)."""
    model, _ = tiny_llama(hidden=64)
    return save_model(model, tiny_tokenizer(adds_bos=True), tmp_path_factory.mktemp("models") / "bos")


@pytest.mark.parametrize("bos, begins", [("auto", True), ("on", True), ("off", False)])
def test_eval_bos_option_decides_whether_each_window_begins_with_the_bos(bos_model_dir, tmp_path, monkeypatch, bos,
                                                                         begins):
    from runtime.load import Model

    firsts, logits = [], Model.logits
    monkeypatch.setattr(Model, "logits", lambda self, ids: firsts.append(int(ids[0, 0])) or logits(self, ids))
    out_json = tmp_path / "r.json"
    result = run("eval", bos_model_dir, "--tokens", 100, "--window", 64, "--stride", 32, "--bos", bos,
                 "--json", out_json)
    assert result.exit_code == 0, result.output
    r = json.loads(out_json.read_text())
    bos_id = tiny_tokenizer().bos_token_id  # "<s>" never occurs in the text: only a prepended BOS is one
    assert len(firsts) == 3 and all((first == bos_id) == begins for first in firsts), firsts
    assert (r["protocol"]["bos_mode"], r["protocol"]["bos"], r["protocol"]["bos_token_id"]) == (
        bos, begins, bos_id if begins else None)
    assert ("BOS prepended" in r["protocol"]["description"]) == begins
    assert f"--bos {bos}" in result.output


def test_inspect_lists_layers_in_model_order(ckpt):
    rows = [line.split()[0] for line in run("inspect", ckpt, "--layers").output.splitlines()
            if line.startswith("model.layers.")]
    assert len(rows) == 14
    assert rows.index("model.layers.0.mlp.down_proj") < rows.index("model.layers.1.self_attn.q_proj")


def test_unreachable_hub_id_says_what_to_do_offline(tmp_path, monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    result = run("eval", "someorg/somemodel")
    assert result.exit_code != 0 and "someorg/somemodel" in result.output and "offline" in result.output


def test_ctrl_c_during_quantize_leaves_nothing(tmp_path, model_dir, monkeypatch):
    import quant.checkpoint_write

    real_write = quant.checkpoint_write.write_safetensors

    def interrupted(tensors, directory):
        real_write(tensors, directory)  # half the work is on disk when the user presses Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(quant.checkpoint_write, "write_safetensors", interrupted)
    recipe = write_recipe(tmp_path / "r.yaml", model_dir)
    result = CliRunner().invoke(main, ["quantize", str(recipe)])
    assert result.exit_code == 130 and "interrupted" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


def test_calibrated_quantize_reads_layers_lazily_into_the_same_checkpoint(tmp_path, model_dir, monkeypatch):
    """`lowbit quantize` with AWQ+GPTQ reads the decoder layers one at a time; the checkpoint is
    the one the model loaded whole gives, tensor for tensor (AWQ's rescaled norms included)."""
    from quant import checkpoint, models

    def quantize(where):
        where.mkdir()
        recipe = write_recipe(where / "r.yaml", model_dir, method="awq+gptq")
        data = yaml.safe_load(recipe.read_text())
        recipe.write_text(yaml.safe_dump({**data, "calibration": {"samples": 8, "seq_len": 32}}))
        result = run("quantize", recipe)
        assert result.exit_code == 0, result.output
        return checkpoint.read_tensors(where / "ckpt")

    real, loaded = models.load_lazily, []
    monkeypatch.setattr(models, "load_lazily", lambda path: loaded.append(real(path)) or loaded[-1])
    lazily = quantize(tmp_path / "lazy")
    assert loaded and loaded[0] is not None  # the layers were left on disk
    monkeypatch.setattr(models, "load_lazily", lambda path: None)  # as for a format read whole
    whole = quantize(tmp_path / "whole")
    assert lazily.keys() == whole.keys() and any(k.endswith("weight_packed") for k in lazily)
    for name in whole:
        assert torch.equal(lazily[name], whole[name]), name


def test_demo_quantizes_once_then_reuses_the_checkpoint(tmp_path, model_dir):
    recipe = write_recipe(tmp_path / "r.yaml", model_dir)
    first = run("demo", "--recipe", recipe, "--tokens", 200)
    assert first.exit_code == 0, first.output
    assert "(baseline)" in first.output and "first 200 tokens" in first.output
    second = run("demo", "--recipe", recipe, "--tokens", 200)
    assert second.exit_code == 0 and "reusing the checkpoint" in second.output
    ppl = [line for line in first.output.splitlines() if line.startswith("| ")]
    assert ppl == [line for line in second.output.splitlines() if line.startswith("| ")]
