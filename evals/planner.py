"""Memory planner: how many sequences of a given context fit beside the weights, per KV scheme.

Reads only ``config.json`` (and the safetensors headers when the directory has
weights): no tensor is loaded, so it plans a 70B model on a laptop. What it counts:

* weights: the bytes of every tensor as stored (packed integers, scales, zero
  points included) from the safetensors headers; without weights, estimated from
  the config for a Llama-family layout, at the ``quantization_config``'s bits when
  it has one, else at the config's dtype;
* KV cache: per sequence, as the runtime's paged cache stores it
  (:mod:`kvquant.memory`): full blocks at the scheme's bytes per token, scales
  included, plus one unquantized residual block; keys and values kept in 16 bits.
  Sliding-window layers (Mistral, Qwen2 sliding configs, Gemma's local layers) keep a
  ring of ``ceil(window / block)`` blocks: each row reports bytes per sequence with and
  without rings at the planned context, and per layer type.

Activations and the framework's own memory are not counted: hold them back with
``reserve``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvquant import KVScheme, bytes_per_token, parse_kv
from kvquant import schemes as kv_families
from kvquant.memory import max_tokens, ring_blocks, sequence_bytes
from quant import architectures
from runtime.units import parse_bytes

DEFAULT_SCHEMES = tuple(kv_families.listed_names())  # every family's listed names: fp16, int8, int4, ...
KV_DTYPE = torch.float16  # the unquantized cache and the residual block: 16-bit on every device that serves
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


class PlanError(ValueError):
    pass


def parse_memory(text: str) -> int:
    """``24GB`` (10^9), ``24GiB`` (2^30), ``512MB``, ``1.5TB`` or a plain byte count (``runtime.units``)."""
    try:
        return parse_bytes(str(text))
    except ValueError as e:  # unreadable, or too large to be a size (1e400GB)
        too_large = "too large" in str(e)
        raise PlanError(f"cannot read memory size {text!r}: " + ("it is too large to be a size; " if too_large else "")
                        + "use e.g. 24GB, 24GiB, 512MB or a byte count") from None


def _config_path(spec: str) -> Path:
    """A config.json path from a model directory, a config.json file, or an alias/hub id."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if not (path / "config.json").exists():
            raise PlanError(f"{path} has no config.json; give a Hugging Face model directory or its config.json")
        return path / "config.json"
    from quant import models

    return models.resolve(spec) / "config.json"


def text_config(config: dict) -> dict:
    """The language model's part of a config (multimodal configs nest it under ``text_config``)."""
    if config.get("model_type") in architectures.ARCHITECTURES:  # as the runtime reads it, with the family's defaults
        return {**architectures.decoder_config(config), "quantization_config": config.get("quantization_config")}
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        return {**config["text_config"], "quantization_config": config.get("quantization_config")}
    return config


def attention_shape(config: dict) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) from an HF config, read as the runtime reads it."""
    try:
        return architectures.attention_shape(config)
    except architectures.MissingConfigKey as e:
        raise PlanError(str(e)) from None


def sliding_windows(config: dict, layers: int) -> tuple:
    """Per layer None or its sliding window: the family's rule (``quant.architectures``); a family
    lowbit does not run yet is read from its ``layer_types`` when the config names them."""
    try:
        return architectures.architecture(config.get("model_type")).sliding_windows(config, layers)
    except architectures.UnsupportedModelError:
        if config.get("layer_types") is not None:
            return architectures.layers_by_type(config, layers)
        return (None,) * layers


def safetensors_weight_bytes(directory: Path) -> int | None:
    """Bytes of every stored tensor, from the headers' offsets; None when there are no weights."""
    from evals.size import read_header

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    from quant.checkpoint import check_contained

    check_contained(directory)  # headers read only from the directory's own files
    total = 0
    for file in files:
        for info in read_header(file).values():
            total += info["data_offsets"][1] - info["data_offsets"][0]
    return total


def _linear_bits(config: dict) -> tuple[float, str] | None:
    """Average stored bits per Linear weight of a compressed-tensors config (scales and zeros included)."""
    qc = config.get("quantization_config") or {}
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        return None
    w = groups[0].get("weights") or {}
    bits = int(w.get("num_bits", 16))
    group = w.get("group_size") or 0
    # per group: a 16-bit scale, and a zero point at the weight's bits when asymmetric
    extra = (16 + (0 if w.get("symmetric", True) else bits)) / group if group and group > 0 else 0.0
    return bits + extra, f"{bits}-bit" + (f" g{group}" if group and group > 0 else " per channel")


def config_weight_bytes(config: dict) -> tuple[int, str]:
    """Weights estimated from a Llama-family config: embeddings, attention, gated MLP (or experts), norms, head."""
    layers, kv_heads, head_dim = attention_shape(config)
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    heads = int(config["num_attention_heads"])
    mlp_params, gate_params = architectures.feed_forward_params(config)  # a mixture of experts counts every expert
    linear_params = layers * (hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2) + mlp_params
    other_params = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2) + (2 * layers + 1) * hidden + gate_params
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    float_bytes = DTYPE_BYTES.get(str(dtype), 2)
    quantized = _linear_bits(config)
    if quantized:
        bits, label = quantized
        return int(linear_params * bits / 8 + other_params * float_bytes), f"estimated from the config ({label} Linears, rest {dtype})"
    return (linear_params + other_params) * float_bytes, f"estimated from the config ({dtype})"


def plan(spec: str, memory: int, context: int, schemes=DEFAULT_SCHEMES, reserve: int = 0) -> dict:
    """Per KV scheme: bytes per token, sequences of ``context`` tokens that fit, longest single sequence."""
    if context < 1:
        raise PlanError(f"context must be at least 1 token, got {context}")
    config_file = _config_path(spec)
    config = text_config(json.loads(config_file.read_text()))
    layers, kv_heads, head_dim = attention_shape(config)
    windows = sliding_windows(config, layers)
    weight_bytes = safetensors_weight_bytes(config_file.parent)
    source = "safetensors headers"
    if weight_bytes is None:
        weight_bytes, source = config_weight_bytes(config)
    free = memory - reserve - weight_bytes
    limit = config.get("max_position_embeddings")
    rows = [_cap_context(_scheme_row(name, layers, kv_heads, head_dim, context, free, windows), limit)
            for name in schemes]
    return {
        "model": spec,
        "memory_bytes": memory,
        "reserve_bytes": reserve,
        "context": context,
        "weights": {"bytes": weight_bytes, "source": source},
        "free_for_kv_bytes": max(free, 0),
        "attention": {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                      "max_position_embeddings": config.get("max_position_embeddings"),
                      "layer_types": _layer_types(windows)},
        "kv_dtype": str(KV_DTYPE).replace("torch.", ""),
        "schemes": rows,
        "counted": "weights as stored + KV cache as the runtime allocates it (blocks for the whole context, a "
                   "sliding layer's capped at its ring of ceil(window / block) blocks, scales, one unquantized "
                   "residual block per sequence); "
                   "activations and framework memory not counted (hold them back with --reserve)",
    }


def _layer_types(windows: tuple) -> list[dict]:
    """``[{"window": None or W, "layers": n}]``, full attention first."""
    counts: dict = {}
    for w in windows:
        counts[w] = counts.get(w, 0) + 1
    return [{"window": w, "layers": counts[w]} for w in sorted(counts, key=lambda w: (w is not None, w or 0))]


def _scheme_row(name: str, layers: int, kv_heads: int, head_dim: int, context: int, free: int,
                windows: tuple | None = None) -> dict:
    scheme: KVScheme = parse_kv(name)
    row = {"scheme": scheme.name, "family": scheme.family, "bits": scheme.bits, "value_bits": scheme.value_bits,
           "type": scheme.type}
    try:
        scheme.check_head_dim(head_dim)
    except ValueError as e:
        return {**row, "error": str(e)}
    windows = windows or (None,) * layers
    per_seq = sequence_bytes(scheme, layers, kv_heads, head_dim, context, KV_DTYPE, windows)
    flat = sequence_bytes(scheme, layers, kv_heads, head_dim, context, KV_DTYPE)
    rate = bytes_per_token(scheme, 1, kv_heads, head_dim, KV_DTYPE)  # one layer's
    per_type = []
    for t in _layer_types(windows):  # each type's pool blocks at this context (residual blocks aside)
        n, w = t["layers"], t["window"]
        blocks = -(-context // scheme.block_size)
        kept = blocks if w is None else min(blocks, ring_blocks(w, scheme.block_size))
        per_type.append({**t, "blocks_per_layer": kept, "blocks_per_layer_without_rings": blocks,
                         "bytes_per_sequence": int(n * kept * scheme.block_size * rate),
                         "bytes_per_sequence_without_rings": int(n * blocks * scheme.block_size * rate)})
    return {
        **row,
        "kv_bytes_per_token": bytes_per_token(scheme, layers, kv_heads, head_dim, KV_DTYPE),
        "kv_bytes_per_token_at_context": per_seq / context,
        "residual_tokens": scheme.residual if scheme.quantized else 0,
        "bytes_per_sequence": per_seq,
        "bytes_per_sequence_without_rings": flat,
        "ring_factor": flat / per_seq,
        "layer_types": per_type,
        "max_sequences": max(free, 0) // per_seq,
        "max_sequences_without_rings": max(free, 0) // flat,
        "max_context": max_tokens(scheme, layers, kv_heads, head_dim, max(free, 0), KV_DTYPE, windows),
    }


def _cap_context(row: dict, limit: int | None) -> dict:
    """``max_context``: the longest single sequence, which is the memory's bound or the model's own
    (``max_position_embeddings``), whichever is smaller; ``max_context_memory`` keeps the memory's."""
    if "max_context" not in row:
        return row
    fits = row["max_context"]
    return {**row, "max_context": min(fits, limit) if limit else fits, "max_context_memory": fits}


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _types_text(types: list[dict]) -> str:
    sliding = [t for t in types if t["window"] is not None]
    if not sliding:
        return ""
    return "; " + ", ".join(f"{t['layers']} " + (f"sliding (window {t['window']:,})" if t["window"] else "full")
                            for t in types) + " layers"


def plan_text(p: dict) -> str:
    lines = [
        f"memory plan for {p['model']}: {_size(p['memory_bytes'])} budget"
        + (f" ({_size(p['reserve_bytes'])} reserved)" if p["reserve_bytes"] else "")
        + f", context {p['context']} tokens",
        f"weights: {_size(p['weights']['bytes'])} ({p['weights']['source']}); "
        f"left for the KV cache: {_size(p['free_for_kv_bytes'])}",
        f"attention: {p['attention']['layers']} layers x {p['attention']['kv_heads']} KV heads x head_dim "
        f"{p['attention']['head_dim']}" + _types_text(p["attention"]["layer_types"]),
        "",
        f"{'KV scheme':<16} {'bytes/token':>12} {'per sequence':>14} {'rings save':>11} {'sequences':>10} "
        f"{'longest sequence':>17}",
    ]
    for r in p["schemes"]:
        if "error" in r:
            lines.append(f"{r['scheme']:<16} n/a: {r['error']}")
            continue
        capped = r["max_context_memory"] > r["max_context"]
        lines.append(f"{r['scheme']:<16} {r['kv_bytes_per_token']:>12,.0f} {_size(r['bytes_per_sequence']):>14} "
                     f"{r['ring_factor']:>10.2f}x {r['max_sequences']:>10,} {r['max_context']:>16,}"
                     f"{'*' if capped else ' '}")
    limit = p["attention"]["max_position_embeddings"]
    if any(r.get("max_context_memory", 0) > r.get("max_context", 0) for r in p["schemes"]):
        lines.append(f"* the model's own limit: it attends over at most {limit:,} positions (max_position_embeddings); "
                     "the memory would hold more")
    if limit and p["context"] > limit:
        lines.append(f"note: --context {p['context']:,} is beyond the {limit:,} positions the model attends over")
    if p["free_for_kv_bytes"] == 0:
        lines.append("the weights alone do not fit in this budget")
    if any(t["window"] is not None for t in p["attention"]["layer_types"]):
        lines.append(f"per sequence at {p['context']:,} tokens counts each sliding layer's ring; 'rings save' is the "
                     "factor against keeping every position")
    lines += ["", f"counted: {p['counted']}"]
    return "\n".join(lines)
