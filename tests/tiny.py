"""Tiny random models and tokenizers built in code, for fast offline tests."""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. Anne Elliot walked along the shore at Lyme with her sister. "
) * 4


def tiny_tokenizer(vocab_size: int = 160):
    """A byte-level BPE tokenizer trained on a few sentences: covers any text, no hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
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
