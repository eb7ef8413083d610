"""One config-driven decoder for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM).

Module and parameter names equal Hugging Face's, so a checkpoint's tensors load
by name. Every Linear is built through ``make_linear`` so quantized layers are
swapped in by name without the model code knowing about formats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture (or one of its features) has no implementation here."""


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope: dict
    max_positions: int
    tie_embeddings: bool
    attention_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, config: dict) -> "DecoderConfig":
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; lowbit runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {config['hidden_act']!r} is not supported (only silu)")
        if config.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported")
        # transformers 5 keeps rope settings in rope_parameters; older configs in rope_theta/rope_scaling.
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {rope_type!r} is not supported; lowbit implements {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        rope["rope_type"] = rope_type
        heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
            rope=rope,
            max_positions=config.get("max_position_embeddings", 4096),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
        )


def check_supported(config: dict) -> DecoderConfig:
    """Raise UnsupportedModelError unless the runtime can run this HF config."""
    return DecoderConfig.from_hf(config)


def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device="cpu") / cfg.head_dim))
    if cfg.rope["rope_type"] == "llama3":
        # Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept,
        # a smooth blend between.
        r = cfg.rope
        factor, low, high = r["factor"], r.get("low_freq_factor", 1.0), r.get("high_freq_factor", 4.0)
        old_ctx = r["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old_ctx / low, inv / factor, torch.where(wavelen < old_ctx / high, inv, blended))
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves, as HF's Llama does: x is [B, H, T, D], cos/sin are [T, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


LinearFactory = Callable[[str, int, int, bool], nn.Module]


def plain_linear(name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, prefix: str, make_linear: LinearFactory):
        super().__init__()
        self.cfg = cfg
        h, kv, d, bias = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias
        self.q_proj = make_linear(f"{prefix}.q_proj", cfg.hidden_size, h * d, bias)
        self.k_proj = make_linear(f"{prefix}.k_proj", cfg.hidden_size, kv * d, bias)
        self.v_proj = make_linear(f"{prefix}.v_proj", cfg.hidden_size, kv * d, bias)
        self.o_proj = make_linear(f"{prefix}.o_proj", h * d, cfg.hidden_size, False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache=None, layer: int = 0, start: int = 0):
        B, T, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(B, T, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, start, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(T, k.shape[2], x.device), enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def causal_mask(queries: int, keys: int, device) -> torch.Tensor | None:
    """Boolean mask for ``queries`` new tokens that follow ``keys - queries`` cached ones."""
    if queries == 1:
        return None  # a single new token sees everything cached
    offset = keys - queries
    q = torch.arange(queries, device=device).unsqueeze(1)
    k = torch.arange(keys, device=device).unsqueeze(0)
    return k <= q + offset


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, prefix: str, make_linear: LinearFactory):
        super().__init__()
        self.gate_proj = make_linear(f"{prefix}.gate_proj", cfg.hidden_size, cfg.intermediate_size, False)
        self.up_proj = make_linear(f"{prefix}.up_proj", cfg.hidden_size, cfg.intermediate_size, False)
        self.down_proj = make_linear(f"{prefix}.down_proj", cfg.intermediate_size, cfg.hidden_size, False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig, i: int, make_linear: LinearFactory):
        super().__init__()
        prefix = f"model.layers.{i}"
        self.self_attn = Attention(cfg, f"{prefix}.self_attn", make_linear)
        self.mlp = MLP(cfg, f"{prefix}.mlp", make_linear)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.index = i

    def forward(self, x, cos, sin, cache=None, start: int = 0):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, self.index, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    """``model.*`` in HF naming: embeddings, blocks, final norm."""

    def __init__(self, cfg: DecoderConfig, make_linear: LinearFactory):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, make_linear) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig, make_linear: LinearFactory = plain_linear):
        super().__init__()
        self.cfg = cfg
        self.model = Body(cfg, make_linear)
        self.lm_head = make_linear("lm_head", cfg.hidden_size, cfg.vocab_size, False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def rope(self, start: int, length: int, dtype):
        pos = torch.arange(start, start + length, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, cache=None, start: int = 0) -> torch.Tensor:
        """Logits for ``input_ids`` [B, T] placed at positions ``start .. start+T``."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(start, input_ids.shape[1], x.dtype)
        for block in self.model.layers:
            x = block(x, cos, sin, cache, start)
        return self.lm_head(self.model.norm(x))
