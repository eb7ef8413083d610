"""What quantization wins on disk, read from safetensors headers (no tensor data loaded)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from quant.checkpoint import CheckpointError, read_header
from quant.format import TENSOR_SUFFIXES as QUANT_PARTS  # packed, scale, zero point, shape, g_idx


@dataclass(frozen=True)
class WeightStats:
    quantized_params: int  # weights of quantized Linears
    quantized_bytes: int  # their packed values + scales + zero points
    other_params: int  # everything else (embeddings, norms, unquantized Linears)
    other_bytes: int
    bits_per_weight: float

    @property
    def total_params(self) -> int:
        return self.quantized_params + self.other_params

    @property
    def model_bits_per_param(self) -> float:
        """Whole model: every tensor byte (embeddings, norms, scales, ...) over every parameter."""
        return 8 * (self.quantized_bytes + self.other_bytes) / self.total_params if self.total_params else 0.0


def bytes_on_disk(path) -> int:
    """Every file of the checkpoint as shipped: weights, config, tokenizer, manifest."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _weight_shape(entries: dict, prefix: str) -> tuple[int, int]:
    """A quantized layer's (out, in) from its stored ``weight_shape``, with a clear error when unreadable."""
    if f"{prefix}.weight_shape" not in entries:
        raise CheckpointError(f"{prefix} has weight_packed but no weight_shape: not a complete pack-quantized layer")
    file, _ = entries[f"{prefix}.weight_shape"]
    try:
        with safe_open(file, framework="pt") as st:
            out, inp = (int(v) for v in st.get_tensor(f"{prefix}.weight_shape"))
    except Exception as e:  # safetensors raises several types for cut-short data
        raise CheckpointError(f"cannot read {file}: {e}; re-create or re-download the checkpoint") from None
    return out, inp


def weight_stats(path) -> WeightStats:
    """Bits per weight of the quantized Linears, scales and zero points included.

    For a model with no quantized layer, bits_per_weight is that of its 2-D
    Linear weights other than the embedding and the head (what a recipe would
    quantize), so float and quantized models compare on the same tensors.
    """
    entries = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        for name, info in read_header(file).items():
            entries[name] = (file, info)
    # the header's byte offsets give each tensor's exact size, whatever its dtype
    size = {n: i["data_offsets"][1] - i["data_offsets"][0] for n, (_, i) in entries.items()}
    prefixes = {n.rsplit(".", 1)[0] for n in entries if n.endswith(".weight_packed")}
    q_params = q_bytes = 0
    for prefix in prefixes:
        out, inp = _weight_shape(entries, prefix)
        q_params += out * inp
        # everything a quantized layer stores counts, except its 16-byte shape record
        q_bytes += sum(size.get(f"{prefix}.{part}", 0) for part in QUANT_PARTS if part != "weight_shape")
    quant_names = {f"{p}.{part}" for p in prefixes for part in QUANT_PARTS}
    other = [n for n in entries if n not in quant_names]
    o_params = sum(math.prod(entries[n][1]["shape"]) for n in other)
    o_bytes = sum(size[n] for n in other)
    if q_params:
        bpw = 8 * q_bytes / q_params
    else:
        linears = [n for n in other if len(entries[n][1]["shape"]) == 2 and n.endswith(".weight")
                   and "embed_tokens" not in n and not n.startswith("lm_head")]
        params = sum(math.prod(entries[n][1]["shape"]) for n in linears)
        bpw = 8 * sum(size[n] for n in linears) / params if params else 0.0
    return WeightStats(q_params, q_bytes, o_params, o_bytes, bpw)
