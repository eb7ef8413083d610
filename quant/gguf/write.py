"""Writing a model as a GGUF file llama.cpp loads: metadata, tokenizer, tensor names and order.

:func:`write_gguf` takes the model's Hugging Face config, the directory holding its tokenizer and
its tensors under their Hugging Face names, each a float tensor or :class:`GGUFFields` (any GGUF
type, per tensor: an export copying lowbit's codes and a recipe fitting a k-quant both end here).
It renames the tensors as llama.cpp's graph wants them, permutes the q/k rows of the llama graph
into llama.cpp's rotary order, leaves a tied head out (llama.cpp reuses the embedding), writes the
hyper-parameters and the tokenizer, and renames the file into place only once it is complete.
"""

from __future__ import annotations

import math
import os
import warnings
from hashlib import sha256
from pathlib import Path
from typing import Iterable, Union

import gguf
import numpy as np
import torch

from quant.architectures import architecture, decoder_config
from quant.gguf.layout import pack
from quant.gguf.types import GGUFFields

Weight = Union[GGUFFields, torch.Tensor]

# lowbit's families llama.cpp runs through one of its graphs: model_type -> (arch, q/k rows permuted)
ARCHES = {
    "llama": (gguf.MODEL_ARCH.LLAMA, True),
    "mistral": (gguf.MODEL_ARCH.LLAMA, True),
    "qwen2": (gguf.MODEL_ARCH.QWEN2, False),
    "qwen3": (gguf.MODEL_ARCH.QWEN3, False),
    # Phi-3 and Phi-4: q/k/v and gate/up stored joined, as llama.cpp's attn_qkv and ffn_up take them
    # (rows q, k, v; gate then up, its SwiGLU's halves); NEOX rotary, as Hugging Face's
    "phi3": (gguf.MODEL_ARCH.PHI3, False),
}

FLOAT_TYPES = {torch.float32: gguf.GGMLQuantizationType.F32, torch.float16: gguf.GGMLQuantizationType.F16,
               torch.bfloat16: gguf.GGMLQuantizationType.BF16}

# llama.cpp tells BPE pre-tokenizers apart by the hash of a test text's tokens (convert_hf_to_gguf.py's
# get_vocab_base_pre, llama.cpp b-0.3.36 of llama-cpp-python): the entries of lowbit's families.
PRE_TOKENIZER_TEXT = (
    '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 '
    '3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
    '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
    '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
PRE_TOKENIZERS = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM, SmolLM2
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5/2/2.5
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
}

# what the file type says, for a file whose quantized tensors all have one type
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q4_0": "MOSTLY_Q4_0",
              "Q4_1": "MOSTLY_Q4_1", "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1", "Q8_0": "MOSTLY_Q8_0",
              "Q2_K": "MOSTLY_Q2_K", "Q3_K": "MOSTLY_Q3_K_S", "Q4_K": "MOSTLY_Q4_K_S", "Q5_K": "MOSTLY_Q5_K_S",
              "Q6_K": "MOSTLY_Q6_K"}


def gguf_arch(config: dict) -> tuple[gguf.MODEL_ARCH, bool]:
    """llama.cpp's graph for this config and whether its q/k rows are permuted; a ValueError otherwise."""
    found = ARCHES.get(config.get("model_type"))
    if found is None:
        raise ValueError(f"GGUF export covers the families {', '.join(ARCHES)}; this model is "
                         f"{config.get('model_type')!r} (export it with llama.cpp's convert_hf_to_gguf.py instead)")
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"GGUF export writes RoPE over the whole head; this model rotates a part of it "
                         f"(partial_rotary_factor {config['partial_rotary_factor']})")
    layers, context = config["num_hidden_layers"], config.get("max_position_embeddings", math.inf)
    windows = {w for w in architecture(config["model_type"]).sliding_windows(config, layers) if w and w < context}
    if windows:  # these llama.cpp graphs (phi3's: disabled there) attend over the whole context
        warnings.warn(f"llama.cpp's {gguf.MODEL_ARCH_NAMES[found[0]]} graph ignores the sliding window "
                      f"({', '.join(map(str, sorted(windows)))} tokens): its outputs differ from lowbit's past it")
    return found


def _rows(weight: Weight, index: torch.Tensor) -> Weight:
    """The weight with its rows (output channels) reordered: GGUF blocks run along a row, so every
    stored field moves with its row and nothing is re-rounded."""
    if isinstance(weight, torch.Tensor):
        return weight.index_select(0, index)
    pick = {k: None if getattr(weight, k) is None else getattr(weight, k).index_select(0, index)
            for k in ("codes", "d", "dmin", "scales", "mins")}
    return GGUFFields(weight.type, **pick)


def rotary_permutation(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp's llama graph rotates pairs (i, i + 1) where Hugging Face rotates (i, i + d/2) of each
    head: the row order convert_hf_to_gguf.py's ``permute`` gives."""
    return torch.arange(rows).view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(rows)


def _rope(config: dict) -> dict:
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    rope["rope_theta"] = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope["rope_type"] not in ("default", "llama3", "linear"):
        raise ValueError(f"GGUF export writes default, llama3 and linear RoPE; this model's is {rope['rope_type']!r}")
    return rope


def llama3_rope_factors(rope: dict, head_dim: int) -> torch.Tensor:
    """Llama 3.1's per-frequency RoPE divisors, the ``rope_freqs`` tensor llama.cpp reads."""
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, old = rope.get("factor", 8.0), rope.get("original_max_position_embeddings", 8192)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def _hparams(writer: gguf.GGUFWriter, text: dict) -> dict:
    heads, hidden = text["num_attention_heads"], text["hidden_size"]
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or hidden // heads
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_context_length(text.get("max_position_embeddings", 2048))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(text.get("rms_norm_eps", 1e-6))
    writer.add_vocab_size(text["vocab_size"])
    rope = _rope(text)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    return {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "rope": rope}


def pre_tokenizer(tokenizer) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer, by its tokens' hash; 'default' (with a
    warning) for one llama.cpp's table of lowbit's families does not know."""
    digest = sha256(str(tokenizer.encode(PRE_TOKENIZER_TEXT)).encode()).hexdigest()
    if digest not in PRE_TOKENIZERS:
        warnings.warn("llama.cpp will split text before BPE with its default rules: this tokenizer's "
                      "pre-tokenizer is not one of lowbit's families' (token ids given directly are unaffected)")
    return PRE_TOKENIZERS.get(digest, "default")


def add_tokenizer(writer: gguf.GGUFWriter, tokenizer_dir: Path, vocab_size: int) -> list[str]:
    """A byte-level BPE tokenizer (tokenizer.json) as llama.cpp's ``gpt2`` model: tokens, their types,
    merges and special tokens, as convert_hf_to_gguf.py writes them; returns the tokens."""
    import json

    from transformers import AutoTokenizer

    spec = Path(tokenizer_dir) / "tokenizer.json"
    if not spec.exists():
        raise ValueError(f"{tokenizer_dir} has no tokenizer.json: GGUF export writes byte-level BPE tokenizers "
                         "(SentencePiece-only tokenizers are not written yet)")
    decoder = (json.loads(spec.read_text()).get("decoder") or {}).get("type")
    if decoder != "ByteLevel":
        raise ValueError(f"{spec}: a {decoder or 'non-byte-level'} decoder; GGUF export writes byte-level BPE "
                         "tokenizers (Llama 3, SmolLM2, Qwen) only")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    if max(reverse) >= vocab_size:
        raise ValueError(f"the tokenizer has token id {max(reverse)}, beyond the model's vocab_size {vocab_size}")
    added, decoders = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        token = reverse.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif token in added:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if decoders[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(Path(tokenizer_dir), load_merges=True)
    if not special.merges:  # llama.cpp refuses a BPE vocabulary without merges, and GGUF has no empty arrays
        raise ValueError(f"{spec} holds no BPE merges: llama.cpp cannot load a byte-level BPE vocabulary without them")
    special.add_to_gguf(writer, quiet=True)
    return tokens


# llama.cpp (llama-vocab.cpp) sets attributes of these tokens in a file whose name says phi-3, and fails to
# load one whose vocabulary lacks any of them
PHI3_NAMES, PHI3_TOKENS = ("phi-3", "phi3"), ("</s>", "<unk>", "<s>", "<|endoftext|>")


def loadable_name(name: str, tokens: list[str]) -> str:
    """``name``, or (with a warning) ``name`` with its phi-3 spelt 'phi 3' where llama.cpp would fail on it."""
    missing = [t for t in PHI3_TOKENS if t not in set(tokens)]
    if not any(n in name.lower() for n in PHI3_NAMES) or not missing:
        return name
    safe = name
    for n in PHI3_NAMES:
        safe = safe.replace(n, "phi 3").replace(n.upper(), "PHI 3").replace(n.capitalize(), "Phi 3")
    safe = safe if not any(n in safe.lower() for n in PHI3_NAMES) else "model"
    warnings.warn(f"the file is named {safe!r}, not {name!r}: llama.cpp fails to load a file named phi-3 whose "
                  f"vocabulary lacks {', '.join(missing)}")
    return safe


def _add_tensor(writer: gguf.GGUFWriter, name: str, weight: Weight, float_type: torch.dtype | None) -> str:
    if isinstance(weight, GGUFFields):
        writer.add_tensor(name, pack(weight), raw_dtype=weight.type.ggml_type)
        return weight.type.name
    w = weight.detach().cpu()
    # llama.cpp keeps 1-D tensors (norms, biases) in float32; others in the requested or stored float type
    dtype = torch.float32 if w.dim() == 1 else (float_type or w.dtype)
    if dtype not in FLOAT_TYPES:
        raise ValueError(f"{name}: a {w.dtype} tensor; GGUF floats are float32, float16 or bfloat16")
    w = w.to(dtype)
    raw = w.view(torch.int16).numpy() if dtype == torch.bfloat16 else w.numpy()
    writer.add_tensor(name, raw, raw_dtype=FLOAT_TYPES[dtype])
    return FLOAT_TYPES[dtype].name


def write_gguf(out: Path, config: dict, tokenizer_dir: Path, weights: Iterable[tuple[str, Weight]], *,
               name: str = "model", float_type: torch.dtype | None = None, overwrite: bool = False) -> dict[str, str]:
    """Write the model to ``out``; returns each GGUF tensor's type. ``weights``: (Hugging Face name,
    float tensor or GGUFFields) for every tensor of the decoder; 2-D float tensors are written in
    ``float_type`` (default: their own dtype). Nothing is left at ``out`` if anything fails."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    if out.exists() and (out.is_dir() or out.read_bytes()[:4] != b"GGUF"):
        raise FileExistsError(f"{out} exists and is not a GGUF file; lowbit replaces only GGUF files")
    text = decoder_config(config)
    arch, permuted = gguf_arch(text)
    staging = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(staging, gguf.MODEL_ARCH_NAMES[arch])
    try:
        shape = _hparams(writer, text)
        writer.add_name(loadable_name(name, add_tokenizer(writer, tokenizer_dir, text["vocab_size"])))
        names = gguf.get_tensor_name_map(arch, text["num_hidden_layers"])
        types, tied = {}, text.get("tie_word_embeddings", False)
        if shape["rope"]["rope_type"] == "llama3":
            types["rope_freqs.weight"] = _add_tensor(writer, "rope_freqs.weight",
                                                     llama3_rope_factors(shape["rope"], shape["head_dim"]), None)
        for hf_name, weight in weights:
            if hf_name == "lm_head.weight" and tied and not isinstance(weight, GGUFFields):
                continue  # llama.cpp reads a missing output.weight as the tied embedding (a quantized head is its own)
            target = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if target is None:
                raise ValueError(f"{hf_name}: no llama.cpp tensor of the {text['model_type']} graph has this name")
            if permuted and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = shape["heads"] if "q_proj" in hf_name else shape["kv_heads"]
                weight = _rows(weight, rotary_permutation(weight.shape[0], heads))
            types[target] = _add_tensor(writer, target, weight, float_type)
        quantized = {t for t in types.values() if t not in ("F32", "F16", "BF16")}
        kind = quantized.pop() if len(quantized) == 1 else ("F16" if not quantized else None)
        if kind is not None:
            writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[kind]])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(staging, out)
    except BaseException:
        writer.close()
        staging.unlink(missing_ok=True)
        raise
    return types


def tensor_bytes(path: Path) -> dict[str, np.ndarray]:
    """Each tensor's stored bytes of a GGUF file (tests, and reading back what was written)."""
    reader = gguf.GGUFReader(path)
    return {t.name: np.asarray(t.data) for t in reader.tensors}
