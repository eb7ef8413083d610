"""One config-driven decoder for the supported families (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM,
Gemma 2, Gemma 3, Phi-3).

Module and parameter names equal Hugging Face's, so a checkpoint's tensors load
by name. Every Linear is built through ``make_linear`` so quantized layers are
swapped in by name without the model code knowing about formats.

The families differ only in switches, all read from config.json once into
:class:`DecoderConfig`: which projections carry a bias, per-head q/k norms, the
RoPE of each layer type (``runtime.rope``), sliding attention windows, and
Gemma's (1 + weight) norms, four norms per layer, scaled embeddings, GeGLU, query
scale and logit soft-capping. Each family's rules for them live in
``quant/architectures.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.attention import as_batch
from runtime.attention_math import heads
from runtime.norms import RMSNorm, make_norm  # noqa: F401 (RMSNorm: callers read runtime.model.RMSNorm)
from runtime.rope import Rope, apply_rope, rope_settings, token_major  # noqa: F401 (apply_rope: the kernels' tests read it here)

# each family's facts (biases, q/k norms, sliding windows, layer layout) live in quant.architectures
from quant.architectures import SUPPORTED_MODEL_TYPES, UnsupportedModelError, architecture, attention_shape  # noqa: F401
from quant.architectures import decoder_config
from quant.architectures import MoEShape
from quant.architectures import unsupported as _unsupported

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


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
    rope: dict  # the RoPE of full-attention layers (runtime.rope.rope_settings)
    max_positions: int
    tie_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple  # per layer: None (full causal attention) or the window length
    local_rope: dict | None = None  # the sliding layers' RoPE where it differs (Gemma 3)
    hidden_act: str = "silu"
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight) (Gemma: 1)
    sandwich_norms: bool = False  # Gemma: norms before and after attention and the MLP
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    query_scale: float | None = None  # queries times this before attention's 1/sqrt(head_dim) (Gemma)
    attn_softcap: float | None = None  # attention scores through cap * tanh(s / cap) (Gemma 2)
    final_softcap: float | None = None  # logits through cap * tanh(l / cap) (Gemma 2)
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj stored joined
    moe: MoEShape | None = None  # mixture-of-experts families: the experts (runtime/moe.py)

    @classmethod
    def from_hf(cls, config: dict) -> "DecoderConfig":
        config = decoder_config(config)  # a multimodal checkpoint's text decoder; the family's defaults
        arch = architecture(config.get("model_type"))
        model_type = arch.model_type
        act = config.get("hidden_activation") or config.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise _unsupported(model_type, f"hidden_act {act!r}", f"MLPs with {', '.join(ACTIVATIONS)}")
        if config.get("partial_rotary_factor", 1.0) != 1.0:
            raise _unsupported(model_type, "partial_rotary_factor != 1", "RoPE over the whole head")
        if config.get("use_bidirectional_attention"):
            raise _unsupported(model_type, "use_bidirectional_attention", "causal decoders")
        layers, kv_heads, head_dim = attention_shape(config)
        rope, local = rope_settings(config), rope_settings(config, "sliding_attention")
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
            rope=rope,
            local_rope=local if local != rope else None,
            max_positions=config.get("max_position_embeddings", 4096),
            tie_embeddings=bool(config.get("tie_word_embeddings")),
            qkv_bias=arch.qkv_bias(config),
            o_bias=arch.o_bias(config),
            mlp_bias=arch.mlp_bias(config),
            qk_norm=arch.qk_norm,
            sliding_windows=arch.sliding_windows(config, layers),
            hidden_act=act,
            norm_offset=arch.norm_offset,
            sandwich_norms=arch.sandwich_norms,
            embed_scale=config["hidden_size"] ** 0.5 if arch.scaled_embeddings else None,
            query_scale=(head_dim / config["query_pre_attn_scalar"]) ** 0.5 if config.get("query_pre_attn_scalar")
            else None,
            attn_softcap=config.get("attn_logit_softcapping") if model_type == "gemma2" else None,
            final_softcap=config.get("final_logit_softcapping"),
            fused_projections=arch.fused_projections,
            moe=arch.experts.shape(config, layers) if arch.experts else None,
        )


def check_supported(config: dict) -> DecoderConfig:
    """Raise UnsupportedModelError unless the runtime can run this HF config."""
    return DecoderConfig.from_hf(config)


LinearFactory = Callable[[str, int, int, bool], nn.Module]


def plain_linear(name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias)


class Attention(nn.Module):
    kernels = False
    native = None  # runtime/native/decode_ops.cpp's RoPE of q and k in one call (runtime.load.use_native_ops)

    def __init__(self, cfg: DecoderConfig, prefix: str, make_linear: LinearFactory):
        super().__init__()
        self.cfg = cfg
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if cfg.fused_projections:  # Phi-3 stores q, k and v as one Linear: run it as stored
            self.qkv_proj = make_linear(f"{prefix}.qkv_proj", cfg.hidden_size, (h + 2 * kv) * d, cfg.qkv_bias)
        else:
            self.q_proj = make_linear(f"{prefix}.q_proj", cfg.hidden_size, h * d, cfg.qkv_bias)
            self.k_proj = make_linear(f"{prefix}.k_proj", cfg.hidden_size, kv * d, cfg.qkv_bias)
            self.v_proj = make_linear(f"{prefix}.v_proj", cfg.hidden_size, kv * d, cfg.qkv_bias)
        self.o_proj = make_linear(f"{prefix}.o_proj", h * d, cfg.hidden_size, cfg.o_bias)
        if cfg.qk_norm:  # Qwen3, Gemma 3: RMSNorm over each head, before RoPE
            self.q_norm = make_norm(cfg, d)
            self.k_norm = make_norm(cfg, d)

    def project(self, x, cos, sin, batch, layer: int):
        """q [B, Hq, T, D], k and v [B, Hk, T, D], RoPE applied: one GEMM when q/k/v were joined
        at load (``qkv_proj``), and one launch for RoPE on the kernels, which in a decode step
        also writes k and v into the cache when the batch asks (``Batch.kv_store``)."""
        B, T, _ = x.shape
        cfg = self.cfg
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_proj = self._modules.get("qkv_proj")  # not hasattr: nn.Module.__getattr__ is slow, and raises
        if qkv_proj is not None:
            qkv = qkv_proj(x)
            if self.kernels and not cfg.qk_norm:
                from runtime.kernels.small_ops import rope_qkv

                q, k, v = rope_qkv(qkv, cos, sin, h, kv, d, store=batch.kv_store(layer, T))
                return self.scale_queries(q), k, v
            if not cfg.qk_norm:
                return self.rope_joined(qkv, cos, sin)
            q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(B, T, h, d), k.view(B, T, kv, d), v.view(B, T, kv, d)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return self.scale_queries(apply_rope(q, cos, sin)), apply_rope(k, cos, sin), v

    def rope_joined(self, qkv, cos, sin):
        """q, k, v of a joined projection, q and k rotated as one tensor [B, T, Hq + Hk, D] (half
        the RoPE ops of rotating each: a decode step is dispatch-bound, bench/results/cpu/NOTES.md)."""
        B, T, _ = qkv.shape
        h, kv, d = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        if self.native is not None:  # the same products and sums, bit for bit, in one call
            qk = self.native.rope_qk(qkv, cos, sin, h, kv)
        else:
            qk = apply_rope(qkv[..., :(h + kv) * d].view(B, T, h + kv, d), token_major(cos), token_major(sin))
        q, k = heads(qk, (h, kv), d)
        return self.scale_queries(q), k, heads(qkv, (h + kv, kv), d)[1]

    def scale_queries(self, q):
        """Gemma scores with query_pre_attn_scalar^-1/2, not head_dim^-1/2: the queries carry the
        ratio, so every attention backend (SDPA, the kernels) keeps its own 1/sqrt(head_dim)."""
        return q if self.cfg.query_scale is None else q * self.cfg.query_scale

    def forward(self, x, cos, sin, batch, layer: int):
        """One call into the forward's attention backend (``runtime.attention``): it stores the
        new keys and values where the batch keeps them and attends."""
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin, batch, layer)
        if self.cfg.attn_softcap is None:
            out = batch.attend(layer, q, k, v, self.cfg.sliding_windows[layer])
        else:
            out = batch.attend(layer, q, k, v, self.cfg.sliding_windows[layer], softcap=self.cfg.attn_softcap)
        # one new token: [B, H, 1, D] is already in [B, 1, H * D]'s order (one op, not a transpose and a reshape)
        return self._modules["o_proj"](out.reshape(B, 1, -1) if T == 1 else out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """The gated SiLU MLP; also each expert of a mixture-of-experts block (``width``: its
    intermediate size; ``names``: its gate, up and down Linears, Mixtral's experts say w1, w3, w2)."""

    def __init__(self, cfg: DecoderConfig, prefix: str, make_linear: LinearFactory, width: int | None = None,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        b, width = cfg.mlp_bias, width or cfg.intermediate_size
        self.names = names
        if cfg.fused_projections:  # Phi-3 stores gate and up as one Linear: run it as stored
            self.gate_up_proj = make_linear(f"{prefix}.gate_up_proj", cfg.hidden_size, 2 * width, b)
            self.add_module(names[2], make_linear(f"{prefix}.{names[2]}", width, cfg.hidden_size, b))
        else:
            for name, (n_in, n_out) in zip(names, ((cfg.hidden_size, width), (cfg.hidden_size, width),
                                                   (width, cfg.hidden_size))):
                self.add_module(name, make_linear(f"{prefix}.{name}", n_in, n_out, b))
        self.act_name = cfg.hidden_act
        self.act = ACTIVATIONS[cfg.hidden_act]

    kernels = False
    native = None  # runtime/native/decode_ops.cpp's SiLU-and-multiply (runtime.load.use_native_ops)
    # set by runtime.load.prepare where gate_up and down both run the CPU kernels: their bf16 activations
    # stay bf16 in between (the kernels return the input's dtype), two conversions fewer per layer
    cpu_kernel_dtype: torch.dtype | None = None

    def forward(self, x):
        modules = self._modules  # not getattr: nn.Module.__getattr__ is slow, and a decode step calls 30 MLPs
        down, gate_up_proj = modules[self.names[2]], modules.get("gate_up_proj")
        if gate_up_proj is None:
            gate, up = modules[self.names[0]], modules[self.names[1]]
            return down(self.act(gate(x)) * up(x))
        if self.cpu_kernel_dtype is not None:
            return down(self.activate(gate_up_proj(x.to(self.cpu_kernel_dtype)))).to(x.dtype)
        gate_up = gate_up_proj(x)  # one GEMM: gate and up joined at load (or stored so)
        if self.kernels and self.act_name == "silu":
            from runtime.kernels.small_ops import silu_mul

            return down(silu_mul(gate_up))
        return down(self.activate(gate_up))

    def activate(self, gate_up):
        """act(gate) * up of the joined projection's output (one native call where it is built)."""
        if self.native is not None:
            return self.native.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up


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
            self.add_module(cfg.moe.block, SparseMoE(cfg, f"{prefix}.{cfg.moe.block}", make_linear, MLP))
        else:
            self.mlp = MLP(cfg, f"{prefix}.mlp", make_linear)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
        if cfg.sandwich_norms:  # Gemma: post_attention_layernorm normalizes the attention's output
            self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)
            self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)
        self.index = i
        self.window = cfg.sliding_windows[i]
        # which of the decoder's RoPEs this layer reads: the local one for sliding layers, where it differs
        self.rope_index = int(cfg.local_rope is not None and self.window is not None)

    def forward(self, x, residual, cos, sin, batch):
        """``(mlp output, residual stream before it)``: the stream's adds happen in the next norm
        (``RMSNorm.add_forward``), so on the kernels an add and a norm are one launch."""
        modules = self._modules  # not getattr: nn.Module.__getattr__ is slow (hasattr raised: ~4 us a layer)
        h, residual = modules["input_layernorm"].add_forward(x, residual)
        h = modules["self_attn"](h, cos, sin, batch, self.index)
        feed_forward = modules[self.feed_forward]
        if "pre_feedforward_layernorm" not in modules:
            h, residual = modules["post_attention_layernorm"].add_forward(h, residual)
            return feed_forward(h), residual
        h, residual = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(feed_forward(h)), residual


class Body(nn.Module):
    """``model.*`` in HF naming: embeddings, blocks, final norm."""

    def __init__(self, cfg: DecoderConfig, make_linear: LinearFactory):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, make_linear) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg, cfg.hidden_size)


class Decoder(nn.Module):
    # the attention backend (runtime/attention_backends/), chosen once per cache scheme by
    # runtime.attention.model_attention from what is asked for and passed over here
    kv_scheme = None  # the model's own KV cache scheme (runtime.load.prepare); None: the default scheme
    attention_asked = "auto"  # "auto" (the priority list decides) or a backend's name
    attention_off: tuple = ()  # (name, why) of backends passed over for this model (a failed self-check)
    activation_dtype: torch.dtype | None = None  # set by runtime.load.prepare; None: the embedding's dtype

    def __init__(self, cfg: DecoderConfig, make_linear: LinearFactory = plain_linear):
        super().__init__()
        self.cfg = cfg
        self.model = Body(cfg, make_linear)
        self.lm_head = make_linear("lm_head", cfg.hidden_size, cfg.vocab_size, False)
        # the full-attention layers' RoPE, then the sliding layers' where it differs (Block.rope_index)
        self.ropes = nn.ModuleList(Rope(r, cfg.head_dim, cfg.max_positions)
                                   for r in (cfg.rope, cfg.local_rope) if r is not None)

    @property
    def attention(self):
        """The attention backend's choice over the model's own cache (``runtime.backend.Choice``:
        the backend and every one passed over, with why), as ``lowbit doctor`` prints it."""
        from kvquant import KVScheme
        from runtime.attention import model_attention

        embedding = self.model.embed_tokens.weight
        return model_attention(self, self.kv_scheme or KVScheme(), self.activation_dtype or embedding.dtype,
                               embedding.device)

    @property
    def attention_kernels(self) -> bool:
        """Whether the model's attention runs the Triton kernels (the chosen backend is ``triton``)."""
        return self.attention.backend.in_place

    @attention_kernels.setter
    def attention_kernels(self, on: bool) -> None:
        # True: the Triton kernels asked for by name (on CPU the interpreter: tests); False: passed over
        if on:
            self.attention_asked = "triton"
            self.attention_off = tuple((n, r) for n, r in self.attention_off if n != "triton")
        else:
            from runtime.attention import pass_over

            pass_over(self, "triton", "switched off (attention_kernels = False)")

    def rope(self, start: int | torch.Tensor, length: int, dtype) -> list:
        """cos, sin [T, D] of each RoPE for positions ``start .. start+T``; [B, 1, T, D] when
        ``start`` is a tensor [B] of per-sequence starts (the same products, so the same values)."""
        device = self.ropes[0].inv_freq.device
        steps = torch.arange(length, device=device, dtype=torch.float32)
        if isinstance(start, torch.Tensor):
            pos = start.to(device, torch.float32)[:, None] + steps  # [B, T]
            return self._cos_sin(pos[:, None], dtype)  # [B, 1, T, D]
        return self._cos_sin(start + steps, dtype)

    def _cos_sin(self, positions: torch.Tensor, dtype) -> list:
        """cos, sin [..., D] of each RoPE at float32 ``positions`` [...]."""
        return [r.cos_sin(positions, dtype) for r in self.ropes]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if self.activation_dtype is not None:  # an embedding stored narrower (runtime.load.narrow_float_weights)
            x = x.to(self.activation_dtype)
        if self.cfg.embed_scale is not None:  # Gemma: the scale rounded to the model dtype, as transformers does
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        return x

    def head(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The final norm (after the last residual add) and the logits, soft-capped where configured."""
        logits = self.lm_head(self.model.norm.add_forward(x, residual)[0])
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, input_ids: torch.Tensor, cache=None, start: int | torch.Tensor = 0,
                last_only: bool = False) -> torch.Tensor:
        """Logits for ``input_ids`` [B, T] placed at positions ``start .. start+T`` ([B, 1, V]
        of the last position only with ``last_only``: generation needs no more, and at 4,096
        tokens a vocabulary of 128k makes the full logits a 1 GB tensor).

        ``cache``: a ``LockstepCache`` (its rows advance together: the new keys/values are stored and
        attention reads every position before them), a batch of ``runtime.attention`` (the
        engine: ``start`` may then be a tensor [B] of per-sequence positions), or None (a plain
        forward: ``start`` must be 0). Attention runs on the decoder's backend for the cache's scheme
        (``runtime.attention.model_attention``).
        """
        T = input_ids.shape[1]
        batch = as_batch(cache, start, T, self)
        x = self.embed(input_ids)
        x, residual = self._blocks(x, self.rope(start, T, x.dtype), batch)
        if last_only:
            x, residual = x[:, -1:], residual[:, -1:]
        return self.head(x, residual)

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, batch,
                       logits_at: torch.Tensor) -> torch.Tensor:
        """Several sequences' tokens in one forward, packed end to end: ``input_ids`` [N] at
        ``positions`` [N]; ``batch`` (``runtime.attention.PackedBatch``) knows which tokens are
        whose, stores their keys and values and attends per sequence. Logits [n, V] of the tokens
        ``logits_at`` [n] only (each sequence's last: the rest would be thrown away)."""
        x = self.embed(input_ids)[None]  # [1, N, hidden]: every GEMM sees M = N
        ropes = self._cos_sin(positions.to(self.ropes[0].inv_freq.device, torch.float32), x.dtype)  # [N, D] each
        x, residual = self._blocks(x, ropes, batch)
        return self.head(x[0, logits_at], residual[0, logits_at])

    def _blocks(self, x, ropes: list, batch):
        residual = None
        for block in self.model.layers:
            x, residual = block(x, residual, *ropes[block.rope_index], batch)
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
            if hasattr(owner, joined_name):  # stored joined (Phi-3)
                continue
            joined = concat_linears([getattr(owner, n) for n in names])
            if joined is not None:
                setattr(owner, joined_name, joined)
                for n in names:
                    delattr(owner, n)
