"""Reading lowbit checkpoints: a Hugging Face directory, safetensors only (writing them:
``quant/checkpoint_write.py``).

The manifest records what produced the checkpoint and the sha256 of every file, so a truncated or
altered file is caught on load; every file a directory names must lie inside it, headers must fit
their files, the config must agree with the stored tensors and no stored float may be NaN or inf.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

# linear_schemes is re-exported: runtime.load reads a checkpoint's schemes through this module
from quant.format import linear_schemes  # noqa: F401

MANIFEST = "lowbit_manifest.json"
MANIFEST_VERSION = 1


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete or does not match its manifest."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(path: Path) -> dict | None:
    f = Path(path) / MANIFEST
    if not f.exists():
        return None
    try:
        manifest = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} is not valid JSON ({e}); re-create or re-download the checkpoint") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{f} lists no files; re-create or re-download the checkpoint")
    return manifest


# Files a loader reads (runtime, transformers, the tokenizer): each must be in the manifest, so that
# an added shard or config cannot change the model behind a verified checkpoint's back.
LOADED_FILES = ("*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
                "tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "*.model", "chat_template.*")


INDEX = "model.safetensors.index.json"


def _roots(directory: Path) -> list[Path]:
    """Where the files of ``directory`` may really lie: in it, or (a Hugging Face hub snapshot, whose
    files are links to ``../../blobs/<hash>``) in its repository's blob store."""
    root = directory.resolve()
    return [root, root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [root]


def inside(directory: Path, name, named_by: str) -> Path:
    """``directory / name``, or one error when ``name`` (which ``named_by`` gives) is absolute, climbs out
    with ``..`` or is a link to a file elsewhere: a model directory is read from its own files only."""
    directory = Path(directory)
    relative = Path(name) if isinstance(name, str) and name.strip() else None
    if relative is None or relative.is_absolute() or ".." in relative.parts:
        raise CheckpointError(f"{named_by} names {name!r}, which is not a file inside {directory}: lowbit reads "
                              "only the model directory's own files; re-create or re-download the model")
    file = directory / relative
    real = file.resolve()
    if not any(real.is_relative_to(root) for root in _roots(directory)):
        raise CheckpointError(f"{file} is a link to {real}, outside {directory}: lowbit reads only the model "
                              "directory's own files; copy the file into the directory if you trust it")
    return file


def read_index(path: Path) -> dict[str, Path] | None:
    """Tensor name -> file from ``model.safetensors.index.json`` (every file inside ``path``); None without one."""
    index = Path(path) / INDEX
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (ValueError, KeyError, TypeError) as e:  # ValueError: bad JSON or bytes
        raise CheckpointError(f"{index} is not a safetensors index ({type(e).__name__}: {e}); "
                              "re-create or re-download the model") from None
    files = {f: inside(path, f, str(index)) for f in set(map(str, weight_map.values()))}
    return {name: files[str(f)] for name, f in weight_map.items()}


def check_contained(path: Path) -> None:
    """Every file a loader reads from ``path`` (transformers included) lies inside it: the index names
    none elsewhere and none is a link out. Cheap (no file is read but the index); every load, inspect and
    quantize runs it, manifest or not."""
    path = Path(path)
    for pattern in LOADED_FILES:
        for f in path.glob(pattern):
            inside(path, f.name, str(path))
    read_index(path)


class UnverifiedCheckpointWarning(UserWarning):
    """A model directory without a manifest: its files are read as they are."""


def verify(path: Path) -> dict | None:
    """Check every file listed in the manifest and refuse loadable files it does not list; return the
    manifest. Without one, warn (a float model from elsewhere has none; a lowbit checkpoint always has
    one) and return None."""
    path = Path(path)
    check_contained(path)
    manifest = read_manifest(path)
    if manifest is None:
        warnings.warn(f"{path} has no {MANIFEST}: its files are not verified (every lowbit checkpoint has one; "
                      "if this is one, the manifest was removed and nothing here can be trusted)",
                      UnverifiedCheckpointWarning, stacklevel=2)
        return None
    listed = manifest["files"]
    for name, entry in listed.items():
        f = inside(path, name, str(path / MANIFEST))
        if not isinstance(entry, dict) or not {"bytes", "sha256"} <= entry.keys():
            raise CheckpointError(f"{path / MANIFEST}: the entry of {name} lacks its bytes and sha256; "
                                  "re-create or re-download the checkpoint")
        if not f.exists():
            raise CheckpointError(f"{f} is listed in {MANIFEST} but missing; the checkpoint is incomplete")
        if f.stat().st_size != entry["bytes"] or sha256(f) != entry["sha256"]:
            raise CheckpointError(
                f"{f} does not match its sha256 in {MANIFEST} (truncated or altered); "
                "re-create or re-download the checkpoint"
            )
    extra = sorted({f.name for pattern in LOADED_FILES for f in path.glob(pattern) if f.is_file()} - set(listed))
    if extra:
        raise CheckpointError(
            f"{path} holds {', '.join(extra)}, which {MANIFEST} does not list: a loader would read "
            "it unverified; remove it, or re-create the checkpoint"
        )
    return manifest


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def safetensors_files(path: Path) -> list[Path]:
    """The directory's safetensors files; an error before anything is loaded when it holds only
    pickle weights (torch.load on a file from elsewhere can run any code)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        listing = Path(path).iterdir() if Path(path).is_dir() else []
        pickles = sorted(f.name for f in listing if f.suffix in PICKLE_SUFFIXES)
        found = f"it holds {', '.join(pickles)}, pickle files that " if pickles else ""
        raise CheckpointError(
            f"no *.safetensors files in {path}: {found}lowbit never loads pickle, which can run code; "
            "convert the model to safetensors where you trust it (transformers: model.save_pretrained(dir))"
        )
    return files


MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit on a header


def read_header(file: Path) -> dict:
    """A safetensors file's tensor table (name -> dtype, shape, data_offsets), without its data."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            # the length is the file's own claim: bounded before it sizes a read (2**40 would be a MemoryError)
            if length > min(MAX_HEADER_BYTES, os.fstat(f.fileno()).st_size - 8):
                raise ValueError(f"its header claims {length:,} bytes, more than the file or the format holds")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
    except (struct.error, UnicodeDecodeError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        # a truncated or altered file: say which one, not just what the JSON parser saw
        raise CheckpointError(f"{file}: not a readable safetensors file, "
                              f"its header is cut short or corrupt ({e})") from None
    header.pop("__metadata__", None)
    return header


def _all_finite(tensor: torch.Tensor) -> bool:
    # the smallest and largest values are NaN or infinite when any value is: one pass in the stored
    # type, where isfinite().all() first writes a bool tensor as large as the weight
    if tensor.numel() == 0:
        return True
    try:
        return all(math.isfinite(v.item()) for v in torch.aminmax(tensor))
    except (RuntimeError, NotImplementedError):  # a type aminmax does not take (float8)
        return bool(torch.isfinite(tensor.float()).all())


def check_finite(name: str, tensor: torch.Tensor, file: Path) -> None:
    """A NaN or infinite value in a stored float tensor makes every output NaN (empty text, perplexity nan):
    refused where it is read, with the tensor named."""
    if tensor.is_floating_point() and not _all_finite(tensor):
        raise CheckpointError(f"{file}: {name} holds NaN or infinite values, so the model's outputs would be "
                              "NaN; re-create the checkpoint (the manifest cannot catch a file rewritten with it)")


def read_tensors(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    tensors = {}
    for f in safetensors_files(path):
        try:
            with safe_open(f, framework="pt", device=device) as st:
                for key in st.keys():
                    tensors[key] = st.get_tensor(key)
                    check_finite(key, tensors[key], f)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises several types for corrupt headers
            raise CheckpointError(f"cannot read {f}: {e}") from e
    return tensors


SCALE_SUFFIX = ".weight_scale"


def check_scales(path: Path) -> None:
    """The quantized Linears' scales are finite (read alone: they are a small part of a checkpoint)."""
    for f in safetensors_files(path):
        names = [k for k in read_header(f) if k.endswith(SCALE_SUFFIX)]
        if not names:
            continue
        try:
            with safe_open(f, framework="pt") as st:
                scales = {name: st.get_tensor(name) for name in names}
        except Exception as e:  # safetensors raises several types for damaged files
            raise CheckpointError(f"cannot read {f}: {e}") from None
        for name, scale in scales.items():
            check_finite(name, scale, f)


def read_config(path: Path) -> dict:
    """``config.json``, its sizes checked against the stored tensors (``check_config``) before anything
    is built from them."""
    f = Path(path) / "config.json"
    if not f.exists():
        raise CheckpointError(f"{f} not found: a checkpoint is a Hugging Face model directory with config.json")
    try:
        config = json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f} is not valid JSON ({e}); re-create or re-download the model") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{f} is not a JSON object; re-create or re-download the model")
    check_config(Path(path), config)
    return config


# ------------------------------------------------------------- config.json against the stored tensors

# The keys that size a decoder: each a positive integer (True: required, False: may be absent or null).
SIZE_KEYS = {"num_hidden_layers": True, "hidden_size": True, "vocab_size": True, "num_attention_heads": True,
             "num_key_value_heads": False, "head_dim": False, "intermediate_size": False}


def _config_error(path: Path, key: str, value, why: str) -> CheckpointError:
    return CheckpointError(f"{path / 'config.json'}: {key} is {value!r}, {why}; "
                           "fix config.json or re-download the model")


def check_config(path: Path, config: dict) -> None:
    """A supported family's sizes are positive integers that agree with each other and with the stored
    tensors (their headers only): one error naming the key before anything is built from them, where a
    layer count of 100,000 would build for minutes and a size of -1 end in a traceback."""
    from quant.architectures import ARCHITECTURES, decoder_config

    arch = ARCHITECTURES.get(config.get("model_type"))
    if arch is None:
        return  # not a family lowbit runs: the runtime's own error names it
    text = decoder_config(config)
    for key, required in SIZE_KEYS.items():
        value = text.get(key)
        if (required or value is not None) and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise _config_error(path, key, value, "it must be a positive integer")
    heads, hidden = text["num_attention_heads"], text["hidden_size"]
    kv_heads = text.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise _config_error(path, "num_key_value_heads", kv_heads, f"it must divide num_attention_heads ({heads})")
    if not text.get("head_dim") and hidden % heads:
        raise _config_error(path, "num_attention_heads", heads, f"it must divide hidden_size ({hidden})")
    head_dim = text.get("head_dim") or hidden // heads
    _check_against_tensors(path, text, arch.layers, {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim,
                                                     "qkv_proj": (heads + 2 * kv_heads) * head_dim})


def _stored_shapes(path: Path) -> dict[str, list]:
    return {name: info.get("shape") if isinstance(info, dict) else None
            for f in sorted(Path(path).glob("*.safetensors")) for name, info in read_header(f).items()}


def _out_features(shapes: dict, linear: str) -> int | None:
    """A Linear's output features as stored: rows of its float weight, or of its packed weight or scales."""
    for part in ("weight", "weight_packed", "weight_scale"):
        shape = shapes.get(f"{linear}.{part}")
        if shape:
            return shape[0]
    return None


def _check_against_tensors(path: Path, text: dict, layers: str, attention: dict[str, int]) -> None:
    shapes = _stored_shapes(path)
    stored = {int(m[1]) for name in shapes if (m := re.match(re.escape(layers) + r"\.(\d+)\.", name))}
    n = text["num_hidden_layers"]
    if stored and stored != set(range(n)):
        raise _config_error(path, "num_hidden_layers", n, f"but the weights hold {len(stored)} decoder layers "
                                                          f"({layers}.{min(stored)} .. {layers}.{max(stored)})")
    embed = shapes.get(f"{layers.rpartition('.')[0]}.embed_tokens.weight")
    if embed and len(embed) == 2:
        for key, stored_size in (("vocab_size", embed[0]), ("hidden_size", embed[1])):
            if text[key] != stored_size:
                raise _config_error(path, key, text[key], f"but the stored embedding is {embed[0]} x {embed[1]}")
    keys = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads", "qkv_proj": "num_attention_heads"}
    for proj, expected in attention.items():
        found = _out_features(shapes, f"{layers}.0.self_attn.{proj}")
        if found is not None and found != expected:
            key = keys[proj]
            raise _config_error(path, key, text.get(key), f"which with head_dim gives {proj} {expected} outputs, "
                                                          f"but the stored {proj} has {found}")
