"""The checkpoint on disk: interchange with transformers + compressed-tensors, integrity, atomic writes."""

import json

import pytest
import torch

from quant import checkpoint
from quant import checkpoint_write
from quant.affine import QuantScheme
from quant.format import QuantizedWeight, linear_schemes
from quant.plan import Override, plan_layers
from quant.quantize import quantize_model
from tiny import tiny_llama


def quantized_tiny(tmp_path, scheme=QuantScheme(4, 32, False), ignore=("lm_head",), overrides=(), tie=True, **save):
    model, tokenizer = tiny_llama(tie=tie)
    plan = plan_layers(model, scheme, list(ignore), list(overrides))
    quantized, stats = quantize_model(model, plan, progress=False)
    out = checkpoint_write.save(model, quantized, tmp_path / "ckpt", tokenizer=tokenizer, manifest={"layers": stats}, **save)
    return model, quantized, out


def fake_quantized_copy(model, quantized):
    """The float model with each quantized weight replaced by its dequantized value."""
    for name, qw in quantized.items():
        # A new Parameter, so a quantized head does not also change a tied embedding.
        model.get_submodule(name).weight = torch.nn.Parameter(qw.dequantize(torch.float32))
    return model


@pytest.mark.parametrize(
    "scheme, overrides, ignore",
    [
        (QuantScheme(4, 32, False), [], ["lm_head"]),
        (QuantScheme(4, 64, True), [Override("down_proj", bits=8)], ["lm_head"]),  # 96 inputs: group 64 -> 48
        (QuantScheme(8, -1, False), [], []),  # quantized head of a tied model
    ],
)
def test_transformers_with_compressed_tensors_loads_our_checkpoint(tmp_path, scheme, overrides, ignore):
    check_transformers_load(tmp_path, scheme, overrides, ignore, {})


@pytest.mark.parametrize("scheme", [QuantScheme(4, 32, False), QuantScheme(8, -1, False)], ids=["w4g32", "w8pc"])
def test_transformers_dequantize_path_loads_one_scheme_asymmetric_checkpoints(tmp_path, scheme):
    """The path docs/checkpoint-format-and-interop.md gives for compressed-tensors 0.20, whose default path fails on asymmetric
    checkpoints. (It mis-reads checkpoints that mix bit widths, in 0.17.1 as in 0.20: the docs say so.)"""
    pytest.importorskip("compressed_tensors")
    from transformers import CompressedTensorsConfig

    check_transformers_load(tmp_path, scheme, [], ["lm_head"],
                            {"quantization_config": CompressedTensorsConfig(dequantize=True)})


def check_transformers_load(tmp_path, scheme, overrides, ignore, options):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    model, quantized, out = quantized_tiny(tmp_path, scheme, ignore, overrides)
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    expected = fake_quantized_copy(model, quantized)(ids).logits
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **options).eval()
    with torch.no_grad():
        got = loaded(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_stored_tensors_roundtrip_and_config_names_each_layer(tmp_path):
    model, quantized, out = quantized_tiny(tmp_path, overrides=[Override("re:.*\\.1\\..*down_proj", bits=8)])
    config = checkpoint.read_config(out)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    schemes = linear_schemes(config, names)
    assert set(schemes) == set(quantized)
    assert schemes["model.layers.1.mlp.down_proj"].bits == 8 and schemes["model.layers.0.mlp.down_proj"].bits == 4
    assert config["quantization_config"]["ignore"] == ["lm_head"]
    tensors = checkpoint.read_tensors(out)
    for name, qw in quantized.items():
        back = QuantizedWeight.from_tensors(tensors, name, schemes[name])
        assert torch.equal(back.q, qw.q) and torch.equal(back.scale, qw.scale) and torch.equal(back.zero, qw.zero)
        assert f"{name}.weight" not in tensors
    assert "lm_head.weight" not in tensors  # tied: stored once, as the embedding


def test_manifest_records_producer_and_hashes(tmp_path):
    _, _, out = quantized_tiny(tmp_path)
    manifest = checkpoint.verify(out)
    assert set(manifest["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert len(manifest["layers"]) == 14


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_file_is_caught_on_verify(tmp_path, damage):
    _, _, out = quantized_tiny(tmp_path)
    f = out / "model.safetensors"
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(bytes(data[: len(data) // 2]))
    else:
        f.unlink()
    with pytest.raises(checkpoint.CheckpointError, match="model.safetensors"):
        checkpoint.verify(out)


def test_existing_output_is_kept_without_overwrite(tmp_path):
    _, _, out = quantized_tiny(tmp_path)
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="--overwrite"):
        quantized_tiny(tmp_path, scheme=QuantScheme(8, 32, False))
    assert (out / "model.safetensors").read_bytes() == before
    quantized_tiny(tmp_path, scheme=QuantScheme(8, 32, False), overwrite=True)
    assert (out / "model.safetensors").read_bytes() != before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_interrupted_save_leaves_nothing_behind(tmp_path):
    model, tokenizer = tiny_llama()
    plan = plan_layers(model, QuantScheme(4, 32), ["lm_head"])
    quantized, _ = quantize_model(model, plan, progress=False)

    class Interrupting:
        def save_pretrained(self, path):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        checkpoint_write.save(model, quantized, tmp_path / "ckpt", tokenizer=Interrupting())
    assert list(tmp_path.iterdir()) == []


def test_reading_a_directory_without_weights_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(checkpoint.CheckpointError, match="safetensors"):
        checkpoint.read_tensors(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match="config.json"):
        checkpoint.read_config(tmp_path / "nowhere")


def test_plan_warns_on_patterns_that_match_nothing_and_errors_when_empty():
    model, _ = tiny_llama()
    with pytest.warns(UserWarning, match="nonexistent"):
        plan_layers(model, QuantScheme(4, 32), ["lm_head", "nonexistent"])
    from quant.plan import PlanError

    with pytest.raises(PlanError, match="nothing to quantize"):
        plan_layers(model, QuantScheme(4, 32), ["re:.*"])


def test_nan_weight_is_named(tmp_path):
    model, _ = tiny_llama()
    model.model.layers[1].mlp.up_proj.weight.data[0, 0] = float("nan")
    plan = plan_layers(model, QuantScheme(4, 32), ["lm_head"])
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj"):
        quantize_model(model, plan, progress=False)
