"""What lowbit knows about each decoder family, in one place.

One :class:`Architecture` per supported ``model_type`` (config.json) says where
the decoder layers are, how a layer's modules are named, which norm or Linear
feeds which Linears (AWQ's scale pairs), which projections carry a bias, and
which layers attend through a sliding window. The runtime's decoder, AWQ, the
calibration pipeline, the KV cache for transformers and the memory planner all
read it here; supporting a new family starts with one entry in ``ARCHITECTURES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture (or one of its features) has no implementation here."""


def unsupported(model_type, feature: str, supported: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{model_type} checkpoint: {feature} is not supported; lowbit runs {supported}")


@dataclass(frozen=True)
class ScalePair:
    """An op whose output only the ``linears`` read, so a per-channel scale folds out of it
    exactly (AWQ): ``prev`` is a norm or a Linear; ``inspect`` is the module whose output
    the scale search compares. Names are local to a decoder layer."""

    prev: str
    linears: tuple[str, ...]
    inspect: str


# The Llama layout, shared by most families (names as in transformers).
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LLAMA_SCALE_PAIRS = (
    ScalePair("input_layernorm", ATTENTION[:3], "self_attn"),
    # v feeds o only where each head has its own v (checked on the layer: not with grouped-query attention)
    ScalePair("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
    ScalePair("post_attention_layernorm", MLP[:2], "mlp"),
    ScalePair("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)
# Gemma 2/3: the MLP reads pre_feedforward_layernorm (post_attention_layernorm normalizes the attention's
# output before the residual add, so nothing quantized reads it)
GEMMA_SCALE_PAIRS = (LLAMA_SCALE_PAIRS[0], LLAMA_SCALE_PAIRS[1],
                     ScalePair("pre_feedforward_layernorm", MLP[:2], "mlp"), LLAMA_SCALE_PAIRS[3])
# Phi-3 stores q/k/v and gate/up fused; AWQ scales each fused Linear's input as a whole
PHI3_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
PHI3_SCALE_PAIRS = (ScalePair("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
                    ScalePair("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"))


def no_window(config: dict, layers: int) -> tuple:
    return (None,) * layers


def every_layer_slides(config: dict, layers: int) -> tuple:
    """Mistral: every layer attends within ``sliding_window`` when it is set."""
    return (config.get("sliding_window"),) * layers


def layers_by_type(config: dict, layers: int) -> tuple:
    """Qwen2/3: ``layer_types`` names each layer; older configs slide the layers from
    ``max_window_layers`` on when ``use_sliding_window`` is set (as transformers reads them)."""
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if types is None:
        slide = bool(config.get("use_sliding_window")) and window is not None
        first = config.get("max_window_layers", layers)
        types = ["sliding_attention" if slide and i >= first else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise unsupported(config.get("model_type"), f"layer_types {unknown}", "full_attention and sliding_attention layers")
    return tuple(window if t == "sliding_attention" else None for t in types)


def gemma_layer_types(config: dict, layers: int) -> tuple:
    """Gemma 2/3: ``layer_types`` when the config names them; older configs slide every layer but
    each ``sliding_window_pattern``-th (Gemma 2: every other layer, starting with the first)."""
    if config.get("layer_types") is None:
        pattern = config.get("sliding_window_pattern", 2 if config.get("model_type") == "gemma2" else 6)
        config = {**config, "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                            for i in range(layers)]}
    return layers_by_type(config, layers)


def attention_bias_flag(config: dict) -> bool:
    return bool(config.get("attention_bias") or False)


def every_layer(config: dict, layers: int) -> tuple:
    return (True,) * layers


def qwen_sparse_layers(config: dict, layers: int) -> tuple:
    """Qwen2/3-MoE: a layer is sparse unless listed in ``mlp_only_layers``, every
    ``decoder_sparse_step``-th layer (as transformers builds them)."""
    dense, step = set(config.get("mlp_only_layers") or ()), int(config.get("decoder_sparse_step", 1) or 1)
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))


@dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts model's experts, read from its config (``Experts.shape``)."""

    block: str  # the sparse block's module name in a decoder layer (as in Hub checkpoints and vLLM)
    projections: tuple[str, str, str]  # each expert's gate, up and down Linear
    num_experts: int
    top_k: int
    normalize: bool  # the top-k routing weights renormalized to sum to 1
    width: int  # each expert's intermediate size
    shared_width: int  # Qwen2-MoE's shared expert (0: none)
    sparse: tuple[bool, ...]  # per layer: a sparse block (else a dense MLP of intermediate_size)

    def expert_linears(self, layer: int) -> list[str]:
        """The local names of layer ``layer``'s expert Linears, in forward order ([] for a dense layer)."""
        if not self.sparse[layer]:
            return []
        return [f"{self.block}.experts.{e}.{p}" for e in range(self.num_experts) for p in self.projections]


@dataclass(frozen=True)
class Experts:
    """How a family lays out and routes its experts. transformers 5 holds them fused (3-D
    ``experts.gate_up_proj`` / ``experts.down_proj``); Hub checkpoints and vLLM name one Linear per
    expert and projection, and so does lowbit (``quant.moe`` unfuses the transformers model)."""

    block: str
    projections: tuple[str, str, str]
    normalize: Callable[[dict], bool]
    width_key: str  # the config key of an expert's intermediate size
    shared: bool = False
    sparse_layers: Callable[[dict, int], tuple] = every_layer

    def shape(self, config: dict, layers: int) -> MoEShape:
        experts = config.get("num_local_experts") or config.get("num_experts")
        missing = [k for k, v in (("num_local_experts or num_experts", experts),
                                  ("num_experts_per_tok", config.get("num_experts_per_tok")),
                                  (self.width_key, config.get(self.width_key))) if not v]
        if missing:
            raise MissingConfigKey(f"a {config.get('model_type')} config needs {', '.join(missing)} to size its experts")
        return MoEShape(self.block, self.projections, int(experts), int(config["num_experts_per_tok"]),
                        self.normalize(config), int(config[self.width_key]),
                        int(config.get("shared_expert_intermediate_size") or 0) if self.shared else 0,
                        tuple(self.sparse_layers(config, layers)))


MIXTRAL_EXPERTS = Experts("block_sparse_moe", ("w1", "w3", "w2"), normalize=lambda config: True,
                          width_key="intermediate_size")
QWEN_EXPERTS = Experts("mlp", ("gate_proj", "up_proj", "down_proj"),
                       normalize=lambda config: bool(config.get("norm_topk_prob")),
                       width_key="moe_intermediate_size", sparse_layers=qwen_sparse_layers)


@dataclass(frozen=True)
class Architecture:
    model_type: str
    # each: config dict -> bool; as in transformers' modeling files
    qkv_bias: Callable[[dict], bool]
    o_bias: Callable[[dict], bool]
    mlp_bias: Callable[[dict], bool] = lambda config: False
    qk_norm: bool = False  # per-head RMSNorm on queries and keys (Qwen3)
    sliding_windows: Callable[[dict, int], tuple] = no_window  # (config, layers) -> per layer None or window
    layers: str = "model.layers"  # module path of the decoder layers
    linears: tuple[str, ...] = ATTENTION + MLP  # the Linears of a decoder layer, in forward order
    scale_pairs: tuple[ScalePair, ...] = LLAMA_SCALE_PAIRS
    # query and key projections feed a softmax through a dot product: per-channel output error says
    # little about attention error there, so AWQ does not clip them (as in the AWQ reference)
    no_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): Gemma stores weight - 1
    sandwich_norms: bool = False  # Gemma 2/3: a norm before and after attention and the MLP, four per layer
    scaled_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size), in the model's dtype
    fused_projections: bool = False  # Phi-3: checkpoints store qkv_proj and gate_up_proj joined
    # a multimodal checkpoint whose text decoder lowbit runs: (config key of the text config, the text
    # config's model_type, (checkpoint tensor prefix, the text model's prefix) pairs); the other tensors
    # (vision) are not read
    text_part: tuple[str, str, tuple[tuple[str, str], ...]] | None = None
    # transformers' defaults for keys a family's config.json may leave out (Gemma 3's do: vocab_size, RoPE bases)
    config_defaults: tuple[tuple[str, object], ...] = ()
    experts: Experts | None = None  # mixture-of-experts families
    # Linears that stay in float whatever the recipe says (plan patterns): gates that pick or weigh
    # experts, whose rounding errors would move whole tokens between experts
    float_linears: tuple[str, ...] = ()

    def check_layer(self, layer: nn.Module, where: str = "") -> None:
        """Raise naming every module this family's layout expects and ``layer`` lacks."""
        names = dict(layer.named_modules())
        expected = set(self.linears) | {p.prev for p in self.scale_pairs} | {p.inspect for p in self.scale_pairs}
        missing = sorted(expected - set(names))
        if missing:
            raise UnsupportedModelError(
                f"{where or type(layer).__name__}: a {self.model_type} decoder layer needs the modules "
                f"{', '.join(missing)}, which {type(layer).__name__} lacks")


# transformers' config-class defaults (tests/test_architectures_gemma.py checks them against transformers)
GEMMA_DEFAULTS = (("hidden_activation", "gelu_pytorch_tanh"), ("rms_norm_eps", 1e-6), ("head_dim", 256),
                  ("query_pre_attn_scalar", 256), ("sliding_window", 4096), ("tie_word_embeddings", True))
GEMMA2_DEFAULTS = GEMMA_DEFAULTS + (("vocab_size", 256_000), ("max_position_embeddings", 8192),
                                    ("rope_theta", 10_000.0), ("final_logit_softcapping", 30.0),
                                    ("attn_logit_softcapping", 50.0))
GEMMA3_DEFAULTS = GEMMA_DEFAULTS + (("vocab_size", 262_208), ("max_position_embeddings", 131_072),
                                    ("rope_theta", 1_000_000.0), ("rope_local_base_freq", 10_000.0),
                                    ("sliding_window_pattern", 6))

ARCHITECTURES = {a.model_type: a for a in (
    Architecture("llama", qkv_bias=attention_bias_flag, o_bias=attention_bias_flag,
                 mlp_bias=lambda config: bool(config.get("mlp_bias"))),
    Architecture("mistral", qkv_bias=lambda config: False, o_bias=lambda config: False,
                 sliding_windows=every_layer_slides),
    # Qwen2 always has q/k/v biases and never an o_proj bias
    Architecture("qwen2", qkv_bias=lambda config: True, o_bias=lambda config: False, sliding_windows=layers_by_type),
    Architecture("qwen3", qkv_bias=attention_bias_flag, o_bias=attention_bias_flag, qk_norm=True,
                 sliding_windows=layers_by_type),
    Architecture("gemma2", qkv_bias=attention_bias_flag, o_bias=attention_bias_flag, sliding_windows=gemma_layer_types,
                 scale_pairs=GEMMA_SCALE_PAIRS, norm_offset=1.0, sandwich_norms=True, scaled_embeddings=True,
                 config_defaults=GEMMA2_DEFAULTS),
    Architecture("gemma3_text", qkv_bias=attention_bias_flag, o_bias=attention_bias_flag, qk_norm=True,
                 sliding_windows=gemma_layer_types, scale_pairs=GEMMA_SCALE_PAIRS, norm_offset=1.0,
                 sandwich_norms=True, scaled_embeddings=True, config_defaults=GEMMA3_DEFAULTS),
    # Gemma3ForConditionalGeneration: the text decoder under model.language_model (transformers 5) or
    # language_model.model (earlier saves); the vision tower is not run
    Architecture("gemma3", qkv_bias=attention_bias_flag, o_bias=attention_bias_flag, qk_norm=True,
                 sliding_windows=gemma_layer_types, layers="model.language_model.layers",
                 scale_pairs=GEMMA_SCALE_PAIRS, norm_offset=1.0, sandwich_norms=True, scaled_embeddings=True,
                 text_part=("text_config", "gemma3_text", (("model.language_model.", "model."),
                                                           ("language_model.model.", "model."),
                                                           ("language_model.lm_head.", "lm_head.")))),
    Architecture("phi3", qkv_bias=lambda config: False, o_bias=lambda config: False, sliding_windows=every_layer_slides,
                 linears=PHI3_LINEARS, scale_pairs=PHI3_SCALE_PAIRS, no_clip=("self_attn.qkv_proj",),
                 fused_projections=True),
)}
# Mixture-of-experts families. Their MLPs are left out of AWQ's scale pairs: the norm before the
# experts also feeds the router (which would have to be scaled too, in float) and each expert's
# up -> down pair sees only the tokens routed to it (docs/models.md).
ATTENTION_SCALE_PAIRS = LLAMA_SCALE_PAIRS[:2]
ARCHITECTURES.update({a.model_type: a for a in (
    Architecture("mixtral", qkv_bias=lambda config: False, o_bias=lambda config: False,
                 sliding_windows=every_layer_slides, linears=ATTENTION, scale_pairs=ATTENTION_SCALE_PAIRS,
                 experts=MIXTRAL_EXPERTS),
    Architecture("qwen3_moe", qkv_bias=attention_bias_flag, o_bias=attention_bias_flag, qk_norm=True,
                 sliding_windows=layers_by_type, linears=ATTENTION, scale_pairs=ATTENTION_SCALE_PAIRS,
                 experts=QWEN_EXPERTS),
    Architecture("qwen2_moe", qkv_bias=lambda config: bool(config.get("qkv_bias", True)), o_bias=lambda config: False,
                 sliding_windows=layers_by_type, linears=ATTENTION, scale_pairs=ATTENTION_SCALE_PAIRS,
                 experts=Experts("mlp", QWEN_EXPERTS.projections, QWEN_EXPERTS.normalize, "moe_intermediate_size",
                                 shared=True, sparse_layers=qwen_sparse_layers),
                 float_linears=("shared_expert_gate",)),
)})
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)


def architecture(model_type) -> Architecture:
    """The entry for ``model_type``, or one error naming it and the families lowbit supports."""
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; lowbit runs {', '.join(SUPPORTED_MODEL_TYPES)} "
            f"(quant/architectures.py holds each family's layout)")
    return ARCHITECTURES[model_type]


def decoder_config(config: dict) -> dict:
    """The config of the decoder lowbit runs, as transformers reads it: a multimodal config's text part
    (its family's ``text_part``), with the family's defaults for the keys it leaves out."""
    arch = architecture(config.get("model_type"))
    if arch.text_part:
        key, text_type, _ = arch.text_part
        text = config.get(key)
        if not isinstance(text, dict):
            raise UnsupportedModelError(f"a {arch.model_type} config keeps its text decoder's config in {key!r}, "
                                        "which this one lacks")
        text = {"model_type": text_type, **text}
        if "tie_word_embeddings" in config:  # the composite model ties (or not) its head
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        return decoder_config(text)
    return {**dict(arch.config_defaults), **config}


def architecture_of(model: nn.Module) -> Architecture:
    """The entry for a transformers model, from its ``config.model_type``."""
    return architecture(getattr(getattr(model, "config", None), "model_type", None))


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(module path, stack of decoder layers)`` of a transformers model of a supported family."""
    arch = architecture_of(model)
    try:
        layers = model.get_submodule(arch.layers)
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedModelError(f"{type(model).__name__}: a {arch.model_type} model keeps its decoder layers "
                                    f"in {arch.layers}, which it lacks")
    return arch.layers, layers


class MissingConfigKey(ValueError):
    """A config lacks a key the attention shape needs."""


def attention_shape(config) -> tuple[int, int, int]:
    """``(layers, KV heads, head_dim)`` of a Hugging Face config (a dict or a config object): the
    one reading of these keys that the runtime, the KV cache for transformers and the planner share."""
    def get(key: str, required: bool = True):
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if value is None and required:
            raise MissingConfigKey(f"the config has no {key!r}: cannot size its attention (is it a decoder LM?)")
        return value

    layers, heads = int(get("num_hidden_layers")), int(get("num_attention_heads"))
    kv_heads = int(get("num_key_value_heads", required=False) or heads)
    head_dim = int(get("head_dim", required=False) or int(get("hidden_size")) // heads)
    return layers, kv_heads, head_dim


def feed_forward_params(config: dict) -> tuple[int, int]:
    """``(Linear weights, float gate weights)`` of every decoder layer's feed-forward block, from a
    config: a gated MLP of ``intermediate_size`` per layer, or a family's experts (each expert's
    three Linears, Qwen2-MoE's shared expert; the routers and shared-expert gates stay float)."""
    layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    dense = 3 * hidden * int(config.get("intermediate_size") or 0)
    arch = ARCHITECTURES.get(config.get("model_type"))
    if arch is None or arch.experts is None:
        return layers * dense, 0
    moe = arch.experts.shape(config, layers)
    sparse = 3 * hidden * (moe.num_experts * moe.width + moe.shared_width)
    gates = hidden * (moe.num_experts + (1 if moe.shared_width else 0))
    n = sum(moe.sparse)
    return n * sparse + (layers - n) * dense, n * gates
