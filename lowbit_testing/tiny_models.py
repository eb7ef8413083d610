"""Tiny random models and tokenizers built in code (no hub, no download): what the tests and the
benches run on (``tests/tiny.py`` re-exports it for the tests). Besides the builders, the tiny
family experiments that tests/test_architectures_gemma.py asserts and bench/families.py records:
random token ids, outlier input channels, a W4 checkpoint of a tiny model.

Only torch at import; transformers, tokenizers and the quantization pipeline load when called.
"""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. Anne Elliot walked along the shore at Lyme with her sister. "
) * 4


def tiny_tokenizer(vocab_size: int = 160, adds_bos: bool = False):
    """A byte-level BPE tokenizer trained on a few sentences: covers any text, no hub. Its BOS is
    ``<s>``; with ``adds_bos`` it begins everything it encodes with it (as Llama's and Gemma's do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def tiny_llama(seed: int = 0, hidden: int = 96, layers: int = 2, tie: bool = True, vocab: int | None = None, **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    settings = dict(
        vocab_size=vocab or len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden + 32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    cfg = LlamaConfig(**{**settings, **config})
    return LlamaForCausalLM(cfg).eval(), tokenizer


def save_model(model, tokenizer, path: Path) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def perturb(model, seed: int = 0, norm_center: float = 1.0):
    """Random biases and norm weights: HF initializes them to 0 and 1, which would let a
    runtime that drops a bias or a norm pass unnoticed. ``norm_center`` 0: Gemma's norms, which
    scale by 1 + weight."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in name:
                p.copy_(norm_center + torch.randn(p.shape, generator=g) * 0.2)
    return model


def tiny_model(kind: str, seed: int = 0, **overrides):
    """A tiny random model of each supported family, with a tokenizer (``overrides``: config keys,
    for the families other than Llama)."""
    import transformers as tf

    if kind.startswith("llama"):
        extra = {}
        if kind == "llama3-rope":
            extra["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}
            extra["original_max_position_embeddings"] = 64  # Phi-3 keeps it at the top level too (and it wins)
        if kind == "llama-bias":
            extra = {"attention_bias": True, "mlp_bias": True}
        model, tok = tiny_llama(seed=seed, tie=kind != "llama-untied", **extra)
        return perturb(model, seed), tok
    if kind.startswith(("gemma", "phi3")):
        return tiny_gemma_or_phi3(kind, seed, **overrides)
    torch.manual_seed(seed)
    tok = tiny_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config, cls = {
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen2-sliding": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "mistral-sliding": (tf.MistralConfig, tf.MistralForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
    }[kind]
    extra = {
        "qwen3": {"head_dim": 16},
        # windows shorter than the test sequences, so the window really cuts attention
        "mistral-sliding": {"sliding_window": 8},
        "qwen2-sliding": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        # experts: 8, two per token; Qwen with a dense layer (mlp_only_layers), renormalized top-k
        # (Qwen3) or not plus a shared expert (Qwen2); expert widths multiples of 32 (group size)
        "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
        "qwen3_moe": {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                      "norm_topk_prob": True, "mlp_only_layers": [1]},
        "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                      "shared_expert_intermediate_size": 96, "norm_topk_prob": False},
    }.get(kind, {})
    return perturb(cls(config(**{**common, **extra, **overrides})).eval(), seed), tok


# Settings that bind at the tiny scale: soft-caps small enough to bend the logits, a window shorter than
# the test sequences, a query scalar other than head_dim, local and global RoPE that differ.
GEMMA_SETTINGS = {
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0, num_hidden_layers=2),
    "gemma3": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, num_hidden_layers=3,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
}


def tiny_gemma_or_phi3(kind: str, seed: int = 0, **overrides):
    """Gemma 2 / Gemma 3 text (tied, GeGLU, four norms), Phi-3 (fused q/k/v and gate/up;
    ``phi3-longrope``: LongRoPE with a 64-token original context); ``overrides``: config keys."""
    import transformers as tf

    torch.manual_seed(seed)
    tok = tiny_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    if kind.startswith("gemma"):
        config_cls, model_cls = {"gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
                                 "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM)}[kind]
        config = config_cls(**{**common, **GEMMA_SETTINGS[kind], **overrides})
        config._attn_implementation = "eager"  # the reference for soft-capping (transformers' own choice for Gemma 2)
        model = model_cls(config)
    else:
        extra = {}
        if kind == "phi3-longrope":
            extra["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0,
                                        "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                        "long_factor": [1.0 + 0.5 * i for i in range(8)],
                                        "original_max_position_embeddings": 64}
            extra["original_max_position_embeddings"] = 64  # Phi-3 keeps it at the top level too (and it wins)
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**{**common, "num_hidden_layers": 2, **extra, **overrides}))
    return perturb(model.eval(), seed, norm_center=0.0 if kind.startswith("gemma") else 1.0), tok


# --------------------------------------------------------------- the tiny family experiments


def ids_for(model, n=1, length=40, seed=3):
    """``n`` x ``length`` random token ids of ``model``'s vocabulary (seeded)."""
    return torch.randint(0, model.config.vocab_size, (n, length), generator=torch.Generator().manual_seed(seed))


def with_outlier_channels(model, channels=(3, 17, 40, 51), factor=8.0):
    """A few input channels of every scaled Linear made 8 times larger, as trained LLMs have them (the
    case AWQ is for; a random model has none): the norms feeding those Linears scale them."""
    from quant import architectures

    arch = architectures.architecture_of(model)
    with torch.no_grad():
        for layer in architectures.decoder_layers(model)[1]:
            for pair in arch.scale_pairs:
                norm = layer.get_submodule(pair.prev)
                if not isinstance(norm, torch.nn.Linear):
                    w = norm.weight[list(channels)]
                    norm.weight[list(channels)] = (arch.norm_offset + w) * factor - arch.norm_offset
    return model


def quantized_checkpoint(kind, tmp_path, methods="rtn", seed=4, outliers=False):
    """A W4 (group 32, asymmetric) checkpoint of a tiny model: (path, model holding the quantized weights,
    the quantization statistics)."""
    from quant import checkpoint_write
    from quant.affine import QuantScheme
    from quant.awq import AWQConfig
    from quant.plan import plan_layers
    from quant.quantize import quantize_model

    model, tok = tiny_model(kind, seed=seed)
    if outliers:
        with_outlier_channels(model)
    plan = plan_layers(model, QuantScheme(4, 32, symmetric=False), ["lm_head"])
    samples = ids_for(model, n=16, length=32, seed=0) if methods != "rtn" else None
    quantized, stats = quantize_model(model, plan, methods, samples=samples, progress=False,
                                      awq=AWQConfig(search_samples=8))
    out = checkpoint_write.save(model, quantized, tmp_path / f"{kind}-{methods}", tokenizer=tok, dtype=torch.float32)
    return out, model, stats
