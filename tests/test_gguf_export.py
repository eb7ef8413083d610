"""`lowbit export --gguf`: what the file holds, read back with the gguf package (no llama.cpp needed)."""

import json
import warnings

import gguf
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from lowbit.cli import main
from lowbit_testing.tiny_models import perturb, tiny_llama, tiny_model, tiny_tokenizer
from quant import checkpoint_write
from quant.affine import QuantScheme
from quant.format import QuantizedWeight
from quant.gguf import dequantize, unpack
from quant.gguf.export import export
from quant.gguf.write import rotary_permutation
from quant.plan import plan_layers
from quant.quantize import quantize_model

# the tiny tokenizer's pre-tokenizer is no family's: llama.cpp's default rules (the tests give token ids)
pytestmark = pytest.mark.filterwarnings("ignore:llama.cpp will split text")


def tiny_gguf_model(hidden=256, seed=0, **config):
    """A tiny Llama whose rows tile GGUF's 256-blocks, with a tokenizer that has BPE merges."""
    tok = tiny_tokenizer(vocab_size=400)
    model, _ = tiny_llama(seed=seed, hidden=hidden, vocab=len(tok), **config)
    return perturb(model, seed).to(torch.bfloat16), tok


_TINY = {}


def tiny_copy():
    """The tiny model of this module (built once: transformers' import and the tokenizer's training
    dominate), copied so a test may change it."""
    import copy

    if not _TINY:
        _TINY["model"] = tiny_gguf_model()
    model, tok = _TINY["model"]
    return copy.deepcopy(model), tok


def checkpoint(tmp_path, scheme: QuantScheme, name="ckpt"):
    model, tok = tiny_copy()
    plan = plan_layers(model, scheme, ["lm_head"])
    quantized, _ = quantize_model(model, plan, "rtn", progress=False)
    return checkpoint_write.save(model, quantized, tmp_path / name, tokenizer=tok), quantized


def read_gguf(path):
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return reader, {t.name: t for t in reader.tensors}, fields


def stored_fields(tensor):
    cols, rows = (int(n) for n in tensor.shape)
    return unpack(tensor.tensor_type.name, np.asarray(tensor.data).reshape(-1), (rows, cols))


@pytest.mark.parametrize("bits,symmetric,gguf_type", [(4, True, "Q4_0"), (4, False, "Q4_1"), (8, True, "Q8_0")])
def test_lowbit_grid_is_copied_not_rerounded(tmp_path, bits, symmetric, gguf_type):
    path, quantized = checkpoint(tmp_path, QuantScheme(bits, 32, symmetric))
    report = export(str(path), gguf_type, tmp_path / "m.gguf")
    assert len(report.exact) == len(quantized) and not report.refit
    _, tensors, _ = read_gguf(tmp_path / "m.gguf")
    for hf, gguf_name, heads in [("model.layers.1.self_attn.q_proj", "blk.1.attn_q.weight", 4),
                                 ("model.layers.0.self_attn.k_proj", "blk.0.attn_k.weight", 2),
                                 ("model.layers.0.mlp.down_proj", "blk.0.ffn_down.weight", None)]:
        qw: QuantizedWeight = quantized[hf]
        fields = stored_fields(tensors[gguf_name])
        assert fields.type.name == gguf_type
        rows = torch.arange(qw.q.shape[0]) if heads is None else rotary_permutation(qw.q.shape[0], heads)
        codes = qw.q[rows].int() + (0 if symmetric else 8)
        assert torch.equal(fields.codes.int(), codes)  # every integer as lowbit stored it
        # bf16 scales are float16 values: the dequantized weights are lowbit's, bit for bit (Q4_1: up to
        # the float16 offset, whose rounding the report bounds)
        theirs, ours = dequantize(fields), qw.dequantize(torch.float32)[rows]
        if symmetric:
            assert torch.equal(theirs, ours)
        else:
            step = qw.scale.float()[rows].repeat_interleave(32, 1)
            assert ((theirs - ours).abs() / step).max() <= report.rounded + 1e-6
    assert report.rounded < (0.01 if not symmetric else 1e-12)


def test_metadata_names_and_tied_head(tmp_path):
    path, _ = checkpoint(tmp_path, QuantScheme(4, 32, True))
    report = export(str(path), "Q4_0", tmp_path / "m.gguf")
    reader, tensors, fields = read_gguf(tmp_path / "m.gguf")
    assert fields["general.architecture"] == "llama" and fields["llama.block_count"] == 2
    assert fields["llama.embedding_length"] == 256 and fields["llama.attention.head_count_kv"] == 2
    assert fields["tokenizer.ggml.model"] == "gpt2" and len(fields["tokenizer.ggml.tokens"]) == fields["llama.vocab_size"]
    assert fields["tokenizer.ggml.merges"] and fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_0
    assert "output.weight" not in tensors  # tied: llama.cpp reuses token_embd
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.BF16  # as the checkpoint stores it
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert len(tensors) == 1 + 1 + 2 * 9 and report.types == {t.name: t.tensor_type.name for t in reader.tensors}


def test_other_grids_are_refitted_and_said_so(tmp_path):
    path, quantized = checkpoint(tmp_path, QuantScheme(4, 128, True))
    report = export(str(path), "Q4_K", tmp_path / "k.gguf")
    assert not report.exact and set(report.refit) == set(quantized)
    text = "\n".join(report.lines())
    assert "re-fitted by RTN (w4 g128 sym is no GGUF grid" in text
    # down_proj's 544 inputs are no multiple of 256: llama.cpp's way, a 32-block type instead
    assert "544 columns are no multiple of 256, so Q5_0 as llama.cpp does" in text
    _, tensors, _ = read_gguf(tmp_path / "k.gguf")
    assert tensors["blk.0.ffn_down.weight"].tensor_type.name == "Q5_0"
    assert tensors["blk.0.ffn_up.weight"].tensor_type.name == "Q4_K"


def test_exact_takes_each_linear_to_its_own_type(tmp_path):
    model, tok = tiny_copy()
    plan = plan_layers(model, QuantScheme(4, 32, False), ["lm_head"])
    plan = {n: QuantScheme(8, 32, True) if n.endswith("down_proj") else s for n, s in plan.items()}
    quantized, _ = quantize_model(model, plan, "rtn", progress=False)
    path = checkpoint_write.save(model, quantized, tmp_path / "mix", tokenizer=tok)
    report = export(str(path), "exact", tmp_path / "mix.gguf")
    assert not report.refit
    assert {t for n, t in report.types.items() if "ffn_down" in n} == {"Q8_0"}
    assert {t for n, t in report.types.items() if "attn_q." in n} == {"Q4_1"}


def test_float_model_to_k_quant_and_f16(tmp_path):
    model, tok = tiny_copy()
    from lowbit_testing.tiny_models import save_model

    path = save_model(model.float(), tok, tmp_path / "float")
    report = export(str(path), "Q6_K", tmp_path / "q6.gguf")
    assert len(report.refit) == 14 and all("float Linear" in why for why in report.refit.values())
    _, tensors, _ = read_gguf(tmp_path / "q6.gguf")
    assert tensors["token_embd.weight"].tensor_type.name == "F16"  # a float model's embeddings: float16
    f16 = export(str(path), "F16", tmp_path / "f16.gguf")
    assert {t for n, t in f16.types.items() if n.endswith("norm.weight")} == {"F32"}
    assert {t for n, t in f16.types.items() if not n.endswith("norm.weight")} == {"F16"}


def test_bad_input_is_named_and_leaves_nothing(tmp_path):
    path, _ = checkpoint(tmp_path, QuantScheme(4, 128, True))
    run = CliRunner().invoke
    result = run(main, ["export", str(path), "--gguf", "Q7_K", "-o", str(tmp_path / "x.gguf")])
    assert result.exit_code != 0 and "unknown GGUF type 'Q7_K'" in result.output and "exact" in result.output
    result = run(main, ["export", str(path), "--gguf", "exact", "-o", str(tmp_path / "x.gguf")])
    assert result.exit_code != 0 and "sym is no GGUF grid" in result.output
    assert "--gguf exact takes only" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no file, no .partial
    (tmp_path / "notes.txt").write_text("mine")
    result = run(main, ["export", str(path), "--gguf", "Q8_0", "-o", str(tmp_path / "notes.txt"), "--overwrite"])
    assert result.exit_code != 0 and "is not a GGUF file" in result.output
    assert (tmp_path / "notes.txt").read_text() == "mine"
    out = tmp_path / "m.gguf"
    assert run(main, ["export", str(path), "--gguf", "Q8_0", "-o", str(out)]).exit_code == 0
    result = run(main, ["export", str(path), "--gguf", "Q8_0", "-o", str(out)])
    assert result.exit_code != 0 and "exists; pass --overwrite" in result.output
    assert run(main, ["export", str(path), "--gguf", "Q4_0", "-o", str(out), "--overwrite"]).exit_code == 0


def test_unsupported_family_is_named(tmp_path):
    from lowbit_testing.tiny_models import save_model

    model, tok = tiny_model("gemma2")
    path = save_model(model, tok, tmp_path / "gemma")
    with pytest.raises(ValueError, match="GGUF export covers the families llama, mistral, qwen2, qwen3, phi3; "
                                         "this model is 'gemma2'"):
        export(str(path), "F16", tmp_path / "g.gguf")
    assert not (tmp_path / "g.gguf").exists() and not (tmp_path / "g.gguf.partial").exists()


def test_a_sliding_window_llama_cpp_ignores_is_said_and_partial_rotary_refused(tmp_path):
    """llama.cpp's llama, qwen2 and phi3 graphs attend over the whole context: a window is warned about;
    RoPE over part of a head (Phi-4-mini) is not written (lowbit's runtime does not run it either)."""
    from lowbit_testing.tiny_models import save_model

    tok = tiny_tokenizer(vocab_size=400)  # one with merges, as llama.cpp needs
    path = save_model(tiny_model("mistral-sliding", vocab_size=len(tok))[0], tok, tmp_path / "mistral")
    with pytest.warns(UserWarning, match=r"llama.cpp's llama graph ignores the sliding window \(8 tokens\)"):
        export(str(path), "F16", tmp_path / "m.gguf")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*sliding window")
        export(str(path), "F16", tmp_path / "m.gguf", overwrite=True)
    phi = save_model(*tiny_model("phi3", partial_rotary_factor=0.5), tmp_path / "phi3")
    with pytest.raises(ValueError, match="RoPE over the whole head; this model rotates a part of it "
                                         r"\(partial_rotary_factor 0.5\)"):
        export(str(phi), "F16", tmp_path / "p.gguf")
    assert not (tmp_path / "p.gguf").exists()
