"""Rotary position embeddings as the supported families configure them.

A config names one RoPE (``rope_parameters`` in transformers 5, or top-level
``rope_theta`` plus ``rope_scaling`` in older configs), or, for Gemma 3, one per
layer type (``rope_parameters`` keyed by ``full_attention`` / ``sliding_attention``,
or ``rope_local_base_freq`` for the sliding layers in older configs). Each
distinct RoPE becomes one :class:`Rope` of the decoder, and each layer reads the
cos/sin of its own.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from quant.architectures import UnsupportedModelError
from quant.architectures import unsupported as _unsupported

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")


def rope_settings(config: dict, layer_type: str = "full_attention") -> dict:
    """The RoPE parameters of ``layer_type``'s layers: ``rope_type``, ``rope_theta`` and the type's
    own keys, checked (an unsupported type is one error naming it and the supported ones)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if set(rope) & set(LAYER_TYPES):  # per layer type (Gemma 3, transformers 5)
        rope = rope.get(layer_type) or {}
    elif layer_type == "sliding_attention" and config.get("rope_local_base_freq") is not None:
        # Gemma 3 before transformers 5: the local layers' own base, never scaled (rope_scaling is the global's)
        rope = {"rope_type": "default", "rope_theta": config["rope_local_base_freq"]}
    rope = dict(rope)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _unsupported(config.get("model_type"), f"rope_type {rope_type!r}",
                           f"rope types {', '.join(SUPPORTED_ROPE_TYPES)}")
    rope["rope_type"] = rope_type
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope["rope_theta"] = float(rope["rope_theta"])
    if rope_type == "longrope" and config.get("original_max_position_embeddings") is not None:
        # Phi-3 keeps the pretraining context at the top level, and transformers lets it win
        rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    need = {"llama3": ("factor", "original_max_position_embeddings"), "linear": ("factor",),
            "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}.get(rope_type, ())
    missing = [k for k in need if rope.get(k) is None]
    if missing:
        raise UnsupportedModelError(f"rope_type {rope_type!r} needs {', '.join(missing)} in the rope parameters")
    return rope


def inverse_frequencies(rope: dict, head_dim: int, factors=None) -> torch.Tensor:
    """float32 inverse frequencies [head_dim / 2]; ``factors``: LongRoPE's per-frequency divisors.
    float64 then float32 (as transformers does), made on the CPU explicitly: the decoder is built
    under ``torch.device("meta")``, and these buffers are computed, not loaded."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
    if factors is not None:  # transformers computes LongRoPE's in float32
        base = rope["rope_theta"] ** exponent.float()
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * base)
    inv = 1.0 / (rope["rope_theta"] ** exponent)
    if rope["rope_type"] == "linear":  # positions divided by `factor` (Gemma 3's global layers)
        inv = inv / rope["factor"]
    if rope["rope_type"] == "llama3":
        # Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept,
        # a smooth blend between.
        factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
        old_ctx = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old_ctx / low, inv / factor, torch.where(wavelen < old_ctx / high, inv, blended))
    return inv.float()


class Rope(nn.Module):
    """cos and sin of one RoPE at given positions.

    LongRoPE (Phi-3): frequencies divided by ``short_factor`` at positions below
    ``original_max_position_embeddings`` and by ``long_factor`` from there on, cos and sin times
    the attention factor. transformers switches a whole forward to the long factors once any
    position passes the original context; per position, keys already in the cache keep their
    rotation, so the two agree wherever a sequence stays within the original context."""

    def __init__(self, rope: dict, head_dim: int, max_positions: int):
        super().__init__()
        self.switch, self.scale = None, 1.0
        if rope["rope_type"] == "longrope":
            original = rope["original_max_position_embeddings"]
            factor = rope.get("factor") or max_positions / original
            self.scale = rope.get("attention_factor") or (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
            self.switch = original
            self.register_buffer("inv_freq", inverse_frequencies(rope, head_dim, rope["short_factor"]), persistent=False)
            self.register_buffer("inv_freq_long", inverse_frequencies(rope, head_dim, rope["long_factor"]),
                                 persistent=False)
        else:
            self.register_buffer("inv_freq", inverse_frequencies(rope, head_dim), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype):
        """cos, sin [..., D] at float32 ``positions`` [...]."""
        at = positions[..., None]
        freqs = at * self.inv_freq
        if self.switch is not None:
            freqs = torch.where(at >= self.switch, at * self.inv_freq_long, freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves, as HF's Llama does: x is [B, H, T, D], cos/sin are [T, D] (or any layout that
    broadcasts: x [B, T, H, D] with :func:`token_major` cos/sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def token_major(t: torch.Tensor) -> torch.Tensor:
    """cos or sin of ``Decoder.rope`` ([T, D], or [B, 1, T, D] per sequence) laid out for x [B, T, H, D]."""
    return t.unsqueeze(-2) if t.dim() == 2 else t.transpose(1, 2)
