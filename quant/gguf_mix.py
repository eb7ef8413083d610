"""llama.cpp's per-tensor type policy for its mixes (Q2_K, Q3_K_M, Q4_K_M, ...), so a GGUF file
lowbit writes holds the same type in every tensor as ``llama-quantize`` would write.

Transcribed from ``llama_tensor_get_type_impl`` and ``tensor_type_fallback`` in llama.cpp's
``src/llama-quant.cpp`` (the copy vendored in llama-cpp-python 0.3.36), for dense decoder
models (no experts, not Falcon, not 70B-sized): a mix names a default type, a few tensors get
more bits (attn_v, ffn_down, attn_output, the output matrix), and a tensor whose rows do not
split into the type's blocks (hidden size 576: SmolLM2-135M) falls back to a 32-block type.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# mix -> its default type (llama_ftype_get_default_type); plain types are their own mix
MIXES = {"Q2_K": "Q2_K", "Q3_K_M": "Q3_K", "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K",
         "Q6_K": "Q6_K", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q8_0": "Q8_0"}

ROLES = (  # (pattern on a Hugging Face module name, llama.cpp's tensor category)
    (r"self_attn\.q_proj$", "attn_q"), (r"self_attn\.k_proj$", "attn_k"), (r"self_attn\.v_proj$", "attn_v"),
    (r"self_attn\.o_proj$", "attn_output"), (r"mlp\.gate_proj$", "ffn_gate"), (r"mlp\.up_proj$", "ffn_up"),
    (r"mlp\.down_proj$", "ffn_down"), (r"(^|\.)lm_head$", "output"), (r"embed_tokens$", "token_embd"),
)


def check_mix(mix: str) -> str:
    name = str(mix).upper()
    if name not in MIXES:
        raise ValueError(f"unknown GGUF type {mix!r}: lowbit writes {', '.join(MIXES)}")
    return name


def role(name: str) -> str | None:
    """llama.cpp's category of a Hugging Face module name, None for one it has none for."""
    for pattern, category in ROLES:
        if re.search(pattern, name):
            return category
    return None


def layer_index(name: str) -> int | None:
    found = re.search(r"\.layers\.(\d+)\.", name)
    return int(found.group(1)) if found else None


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _by_mix(mix: str, category: str, i: int, n: int, n_gqa: int, has_imatrix: bool) -> str:
    """The type before the shape fallback (llama_tensor_get_type_impl, dense models)."""
    default = MIXES[mix]
    if category == "attn_v":
        if mix == "Q2_K":
            return "Q4_K" if n_gqa >= 4 else "Q3_K"
        if mix == "Q3_K_M":
            return "Q5_K" if i < 2 else "Q4_K"
        if mix in ("Q4_K_M", "Q5_K_M") and _more_bits(i, n):
            return "Q6_K"
        if mix == "Q4_K_S" and i < 4:
            return "Q5_K"
    elif category == "ffn_down":
        if mix == "Q2_K":
            return "Q3_K"
        if mix == "Q3_K_M":
            return "Q5_K" if i < n // 16 else "Q4_K"
        if mix in ("Q4_K_M", "Q5_K_M") and _more_bits(i, n):
            return "Q6_K"
        if mix == "Q4_K_S" and i < n // 8:
            return "Q5_K"
        if mix == "Q4_0" and has_imatrix and i < n // 8:
            return "Q4_1"
    elif category == "attn_output":
        return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K"}.get(mix, default)
    return default


def _output_type(mix: str, columns: int) -> str:
    """The output matrix (and a tied token embedding, which is it): Q6_K, or Q8_0 where the row does
    not split into the default type's blocks."""
    from quant.gguf import gguf_type

    default = MIXES[mix]
    if columns % gguf_type(default).block:
        return "Q8_0"
    return default if default == "Q8_0" else "Q6_K"


def tensor_types(shapes: dict[str, tuple[int, int]], mix: str, n_layers: int, n_gqa: int,
                 tied_embeddings: bool, has_imatrix: bool = True) -> dict[str, str]:
    """The type llama-quantize gives each 2-D tensor (Hugging Face name -> (rows, columns)) under
    ``mix``; a tensor with no category is left out (kept float)."""
    from quant.gguf import fallback  # llama.cpp's tensor_type_fallback

    mix = check_mix(mix)
    types = {}
    for name, (_, columns) in shapes.items():
        category = role(name)
        if category is None:
            continue
        if category == "output" or (category == "token_embd" and tied_embeddings):
            types[name] = _output_type(mix, columns)
            continue
        i = layer_index(name)
        chosen = MIXES[mix] if i is None else _by_mix(mix, category, i, n_layers, n_gqa, has_imatrix)
        types[name] = fallback(chosen, columns).name
    return types


@dataclass(frozen=True)
class GridScheme:
    """A plan's scheme for a Linear stored as GGUF type ``type_name``: the rounding methods that
    take it (``rtn``, ``gptq``) round onto the type's fitted grid (``quant.gguf_fit.round_linear``;
    ``awq`` searches with it, ``signround`` learns on it; this module imports no ``gguf`` at the
    top, so the methods can name this class where the package is absent)."""

    type_name: str

    def describe(self) -> str:
        return f"gguf {self.type_name}"

    def _type(self):
        from quant.gguf import gguf_type

        return gguf_type(self.type_name)

    def group_len(self, columns: int) -> int:
        """Weights that share one scale (and offset): the type's sub-block, or its block (AWQ's groups)."""
        t = self._type()
        return t.sub_block or t.block

    @property
    def symmetric(self) -> bool:
        return self._type().symmetric


