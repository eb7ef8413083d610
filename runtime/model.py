"""One config-driven decoder for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM).

Module and parameter names equal Hugging Face's, so a checkpoint's tensors load
by name. Every Linear is built through ``make_linear`` so quantized layers are
swapped in by name without the model code knowing about formats.

The families differ only in a few switches, all read from config.json once into
:class:`DecoderConfig`: which projections carry a bias, Qwen3's per-head q/k
norms, the RoPE frequencies, and (Mistral, some Qwen) a sliding attention window.
Each family's rules for them live in ``quant/architectures.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.attention import as_batch

# each family's facts (biases, q/k norms, sliding windows, layer layout) live in quant.architectures
from quant.architectures import SUPPORTED_MODEL_TYPES, UnsupportedModelError, architecture, attention_shape  # noqa: F401
from quant.architectures import MoEShape
from quant.architectures import unsupported as _unsupported

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
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
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple  # per layer: None (full causal attention) or the window length
    moe: MoEShape | None = None  # mixture-of-experts families: the experts (runtime/moe.py)

    @classmethod
    def from_hf(cls, config: dict) -> "DecoderConfig":
        model_type = config.get("model_type")
        arch = architecture(model_type)
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise _unsupported(model_type, f"hidden_act {act!r}", "silu MLPs")
        if config.get("partial_rotary_factor", 1.0) != 1.0:
            raise _unsupported(model_type, "partial_rotary_factor != 1", "RoPE over the whole head")
        layers, kv_heads, head_dim = attention_shape(config)
        theta, rope = rope_settings(config)
        return cls(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=layers,
            num_heads=config["num_attention_heads"],
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope=rope,
            max_positions=config.get("max_position_embeddings", 4096),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch.qkv_bias(config),
            o_bias=arch.o_bias(config),
            mlp_bias=arch.mlp_bias(config),
            qk_norm=arch.qk_norm,
            sliding_windows=arch.sliding_windows(config, layers),
            moe=arch.experts.shape(config, layers) if arch.experts else None,
        )


def rope_settings(config: dict) -> tuple[float, dict]:
    """``(theta, parameters)``: transformers 5 keeps RoPE in ``rope_parameters``, older
    configs in top-level ``rope_theta`` plus an optional ``rope_scaling`` dict."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _unsupported(config.get("model_type"), f"rope_type {rope_type!r}",
                           f"rope types {', '.join(SUPPORTED_ROPE_TYPES)}")
    rope["rope_type"] = rope_type
    if rope_type == "llama3":
        need = [k for k in ("factor", "original_max_position_embeddings") if k not in rope]
        if need:
            raise UnsupportedModelError(f"rope_type 'llama3' needs {', '.join(need)} in the rope parameters")
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0))), rope


def check_supported(config: dict) -> DecoderConfig:
    """Raise UnsupportedModelError unless the runtime can run this HF config."""
    return DecoderConfig.from_hf(config)


def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    # float64 then float32, as transformers does, so positions far into the context agree.
    # Made on the CPU explicitly: the model is built under torch.device("meta"), and this
    # buffer is computed, not loaded.
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
    kernels = False  # the fused Triton kernel (Decoder.use_kernels), else PyTorch

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalize in float32 (as HF does), scale in the compute dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None):
        """``(norm(x + residual), x + residual)``: the residual stream's add and the next norm,
        one launch on the kernels (``residual`` None: no add)."""
        if self.kernels:
            from runtime.kernels.small_ops import add_rmsnorm

            return add_rmsnorm(x, residual, self.weight, self.eps)
        s = x if residual is None else x + residual
        return self(s), s


LinearFactory = Callable[[str, int, int, bool], nn.Module]


def plain_linear(name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias)


class Attention(nn.Module):
    kernels = False

    def __init__(self, cfg: DecoderConfig, prefix: str, make_linear: LinearFactory):
        super().__init__()
        self.cfg = cfg
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = make_linear(f"{prefix}.q_proj", cfg.hidden_size, h * d, cfg.qkv_bias)
        self.k_proj = make_linear(f"{prefix}.k_proj", cfg.hidden_size, kv * d, cfg.qkv_bias)
        self.v_proj = make_linear(f"{prefix}.v_proj", cfg.hidden_size, kv * d, cfg.qkv_bias)
        self.o_proj = make_linear(f"{prefix}.o_proj", h * d, cfg.hidden_size, cfg.o_bias)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head, before RoPE
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def project(self, x, cos, sin, batch, layer: int):
        """q [B, Hq, T, D], k and v [B, Hk, T, D], RoPE applied: one GEMM when q/k/v were joined
        at load (``qkv_proj``), and one launch for RoPE on the kernels, which in a decode step
        also writes k and v into the cache when the batch asks (``Batch.kv_store``)."""
        B, T, _ = x.shape
        cfg = self.cfg
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if hasattr(self, "qkv_proj"):
            qkv = self.qkv_proj(x)
            if self.kernels and not cfg.qk_norm:
                from runtime.kernels.small_ops import rope_qkv

                return rope_qkv(qkv, cos, sin, h, kv, d, store=batch.kv_store(layer, T))
            q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(B, T, h, d), k.view(B, T, kv, d), v.view(B, T, kv, d)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, batch, layer: int):
        """One call into the forward's attention backend (``runtime.attention``): it stores the
        new keys and values where the batch keeps them and attends."""
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin, batch, layer)
        out = batch.attend(layer, q, k, v, self.cfg.sliding_windows[layer])
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """The gated SiLU MLP; also each expert of a mixture-of-experts block (``width``: its
    intermediate size; ``names``: its gate, up and down Linears, Mixtral's experts say w1, w3, w2)."""

    def __init__(self, cfg: DecoderConfig, prefix: str, make_linear: LinearFactory, width: int | None = None,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        b, width = cfg.mlp_bias, width or cfg.intermediate_size
        self.names = names
        for name, (n_in, n_out) in zip(names, ((cfg.hidden_size, width), (cfg.hidden_size, width),
                                               (width, cfg.hidden_size))):
            self.add_module(name, make_linear(f"{prefix}.{name}", n_in, n_out, b))

    kernels = False

    def forward(self, x):
        down = getattr(self, self.names[2])
        if not hasattr(self, "gate_up_proj"):
            gate, up = getattr(self, self.names[0]), getattr(self, self.names[1])
            return down(F.silu(gate(x)) * up(x))
        gate_up = self.gate_up_proj(x)  # one GEMM: gate and up joined at load
        if self.kernels:
            from runtime.kernels.small_ops import silu_mul

            return down(silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig, i: int, make_linear: LinearFactory):
        super().__init__()
        prefix = f"model.layers.{i}"
        self.self_attn = Attention(cfg, f"{prefix}.self_attn", make_linear)
        # the feed-forward block: a dense MLP, or (runtime/moe.py) the experts under the name
        # checkpoints give them (Mixtral: block_sparse_moe)
        self.feed_forward = "mlp"
        if cfg.moe is not None and cfg.moe.sparse[i]:
            from runtime.moe import SparseMoE

            self.feed_forward = cfg.moe.block
            self.add_module(cfg.moe.block, SparseMoE(cfg, f"{prefix}.{cfg.moe.block}", make_linear))
        else:
            self.mlp = MLP(cfg, f"{prefix}.mlp", make_linear)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.index = i
        self.window = cfg.sliding_windows[i]

    def forward(self, x, residual, cos, sin, batch):
        """``(mlp output, residual stream before it)``: the stream's adds happen in the next norm
        (``RMSNorm.add_forward``), so on the kernels an add and a norm are one launch."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, batch, self.index)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return getattr(self, self.feed_forward)(h), residual


class Body(nn.Module):
    """``model.*`` in HF naming: embeddings, blocks, final norm."""

    def __init__(self, cfg: DecoderConfig, make_linear: LinearFactory):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, make_linear) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Decoder(nn.Module):
    attention_kernels = False  # the Triton attention kernels over the KV cache (runtime.load.prepare), else PyTorch

    def __init__(self, cfg: DecoderConfig, make_linear: LinearFactory = plain_linear):
        super().__init__()
        self.cfg = cfg
        self.model = Body(cfg, make_linear)
        self.lm_head = make_linear("lm_head", cfg.hidden_size, cfg.vocab_size, False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def rope(self, start: int | torch.Tensor, length: int, dtype):
        """cos, sin [T, D] for positions ``start .. start+T``; [B, 1, T, D] when ``start`` is a
        tensor [B] of per-sequence starts (the same products, so the same values)."""
        steps = torch.arange(length, device=self.inv_freq.device, dtype=torch.float32)
        if isinstance(start, torch.Tensor):
            pos = start.to(self.inv_freq.device, torch.float32)[:, None] + steps  # [B, T]
            return self._cos_sin(pos[:, None], dtype)  # [B, 1, T, D]
        return self._cos_sin(start + steps, dtype)

    def _cos_sin(self, positions: torch.Tensor, dtype):
        """cos, sin [..., D] at float32 ``positions`` [...]."""
        freqs = positions[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, cache=None, start: int | torch.Tensor = 0,
                last_only: bool = False) -> torch.Tensor:
        """Logits for ``input_ids`` [B, T] placed at positions ``start .. start+T`` ([B, 1, V]
        of the last position only with ``last_only``: generation needs no more, and at 4,096
        tokens a vocabulary of 128k makes the full logits a 1 GB tensor).

        ``cache``: a ``KVCache`` (its rows advance together: the new keys/values are stored and
        attention reads every position before them), a batch of ``runtime.attention`` (the
        engine: ``start`` may then be a tensor [B] of per-sequence positions), or None (a plain
        forward: ``start`` must be 0). Attention runs on ``attention_kernels``' backend.
        """
        T = input_ids.shape[1]
        batch = as_batch(cache, start, T, self.attention_kernels)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(start, T, x.dtype)
        x, residual = self._blocks(x, cos, sin, batch)
        if last_only:
            x, residual = x[:, -1:], residual[:, -1:]
        return self.lm_head(self.model.norm.add_forward(x, residual)[0])

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, batch,
                       logits_at: torch.Tensor) -> torch.Tensor:
        """Several sequences' tokens in one forward, packed end to end: ``input_ids`` [N] at
        ``positions`` [N]; ``batch`` (``runtime.attention.PackedBatch``) knows which tokens are
        whose, stores their keys and values and attends per sequence. Logits [n, V] of the tokens
        ``logits_at`` [n] only (each sequence's last: the rest would be thrown away)."""
        x = self.model.embed_tokens(input_ids)[None]  # [1, N, hidden]: every GEMM sees M = N
        cos, sin = self._cos_sin(positions.to(self.inv_freq.device, torch.float32), x.dtype)  # [N, D]
        x, residual = self._blocks(x, cos, sin, batch)
        x, residual = x[0, logits_at], residual[0, logits_at]
        return self.lm_head(self.model.norm.add_forward(x, residual)[0])

    def _blocks(self, x, cos, sin, batch):
        residual = None
        for block in self.model.layers:
            x, residual = block(x, residual, cos, sin, batch)
        return x, residual

    def use_kernels(self, on: bool = True) -> None:
        """Run RMSNorm (with the residual add), RoPE and SiLU-and-multiply as the fused Triton
        kernels (``runtime.kernels.small_ops``; CUDA, or the interpreter) or as PyTorch."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP)):
                m.kernels = on

    def join_projections(self) -> None:
        """q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` per layer (at load,
        after the weights are in: checkpoints keep HF's names). Layers that cannot be joined
        (``runtime.linear.concat_linears``) stay apart."""
        from runtime.linear import concat_linears

        attention = [(m, ("q_proj", "k_proj", "v_proj"), "qkv_proj") for m in self.modules() if isinstance(m, Attention)]
        mlps = [(m, m.names[:2], "gate_up_proj") for m in self.modules() if isinstance(m, MLP)]  # experts too
        for owner, names, joined_name in attention + mlps:
            joined = concat_linears([getattr(owner, n) for n in names])
            if joined is not None:
                setattr(owner, joined_name, joined)
                for n in names:
                    delattr(owner, n)
