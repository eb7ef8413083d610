"""lowbit's runtime against transformers: same logits, same greedy tokens, quantized or not."""

import pytest
import torch

import runtime
from quant import checkpoint
from quant.affine import QuantScheme
from quant.plan import plan_layers
from quant.quantize import quantize_model
from tiny import save_model, tiny_llama, tiny_tokenizer


def tiny_model(kind: str, seed: int = 0):
    """A tiny random model of each supported family, with a tokenizer."""
    import transformers as tf

    if kind.startswith("llama"):
        extra = {}
        if kind == "llama3-rope":
            extra["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}
        return tiny_llama(seed=seed, tie=kind != "llama-untied", **extra)
    torch.manual_seed(seed)
    tok = tiny_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config, cls = {
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[kind]
    extra = {"head_dim": 16} if kind == "qwen3" else {}
    return cls(config(**common, **extra)).eval(), tok


KINDS = ["llama", "llama-untied", "llama3-rope", "qwen2", "qwen3", "mistral"]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_greedy_tokens_match_transformers(tmp_path, kind):
    model, tok = tiny_model(kind)
    rt = runtime.load(save_model(model, tok, tmp_path / kind))
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(rt.logits(ids), expected, atol=1e-4, rtol=1e-4)

    prompt = "Anne Elliot walked"
    gen = rt.generate(prompt, max_new_tokens=12, stop_at_eos=False)
    ours = [t.id for t in gen]
    hf = model.generate(tok(prompt, return_tensors="pt").input_ids, max_new_tokens=12, min_new_tokens=12,
                        do_sample=False, pad_token_id=tok.eos_token_id)
    assert ours == hf[0, -12:].tolist()


def test_quantized_checkpoint_matches_transformers_with_compressed_tensors(tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    model, tok = tiny_llama(seed=4)
    plan = plan_layers(model, QuantScheme(4, 32, symmetric=False), ["lm_head"])
    quantized, _ = quantize_model(model, plan, progress=False)
    out = checkpoint.save(model, quantized, tmp_path / "q", tokenizer=tok, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 33), generator=torch.Generator().manual_seed(5))
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs(ids).logits
    ours = runtime.load(out).logits(ids)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    # and quantization changed something: the comparison is not float against float
    with torch.no_grad():
        assert (model(ids).logits - expected).abs().max() > 1e-3


def test_streaming_gives_text_pieces_and_timings(tmp_path):
    model, tok = tiny_llama()
    rt = runtime.load(save_model(model, tok, tmp_path / "m"))
    gen = rt.generate("a single man", max_new_tokens=6, stop_at_eos=False)
    tokens = list(gen)
    assert len(tokens) == 6
    assert "".join(t.text for t in tokens) == gen.text
    assert gen.ttft_s > 0 and len(gen.itl_s) == 5 and gen.mean_itl_s > 0
    assert all(a.t < b.t for a, b in zip(tokens, tokens[1:]))


def test_seeded_sampling_is_reproducible(tmp_path):
    model, tok = tiny_llama()
    rt = runtime.load(save_model(model, tok, tmp_path / "m"))
    runs = [[t.id for t in rt.generate("Lyme", max_new_tokens=10, temperature=1.0, top_p=0.9, seed=s, stop_at_eos=False)]
            for s in (7, 7, 8)]
    assert runs[0] == runs[1] != runs[2]
    # a tiny nucleus keeps only the top token: sampling becomes greedy
    greedy = [t.id for t in rt.generate("Lyme", max_new_tokens=10, stop_at_eos=False)]
    nucleus = [t.id for t in rt.generate("Lyme", max_new_tokens=10, temperature=1.0, top_p=1e-6, seed=1, stop_at_eos=False)]
    assert nucleus == greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
     ({"top_p": 1.5}, "top_p")],
)
def test_bad_sampling_arguments(tmp_path, kwargs, message):
    model, tok = tiny_llama()
    rt = runtime.load(save_model(model, tok, tmp_path / "m"))
    with pytest.raises(ValueError, match=message):
        rt.generate("x", **kwargs)


def test_prompt_longer_than_context_is_refused(tmp_path):
    model, tok = tiny_llama()
    rt = runtime.load(save_model(model, tok, tmp_path / "m"))
    with pytest.raises(ValueError, match="context"):
        rt.generate(list(range(5)) * 200)


def test_unsupported_architecture_names_itself_and_the_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "g")
    with pytest.raises(runtime.UnsupportedModelError, match="gpt2.*llama"):
        runtime.load(tmp_path / "g")


def test_unsupported_rope_scaling_is_named():
    with pytest.raises(runtime.UnsupportedModelError, match="yarn"):
        runtime.check_supported({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                                 "num_hidden_layers": 1, "num_attention_heads": 2,
                                 "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


def test_missing_paths_and_tensors_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        runtime.load(tmp_path / "nowhere")
    model, tok = tiny_llama()
    d = save_model(model, tok, tmp_path / "m")
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(checkpoint.CheckpointError, match="up_proj"):
        runtime.load(d)
