"""Writing and reading lowbit checkpoints: a Hugging Face directory, safetensors only.

Writes go to a temporary sibling directory that is renamed into place at the
end, so an interrupted run never leaves a half-written checkpoint and an
existing output is only replaced when the caller says so. The manifest
records what produced the checkpoint and the sha256 of every file, so a
truncated or altered file is caught on load.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys
import warnings
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# linear_schemes is re-exported: runtime.load reads a checkpoint's schemes through this module
from quant.format import QuantizedWeight, linear_schemes, quantization_config  # noqa: F401
from quant.moe import routers

MANIFEST = "lowbit_manifest.json"
MANIFEST_VERSION = 1
SHARD_BYTES = 4 << 30


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete or does not match its manifest."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it; put it straight back
    os.umask(mask)
    return mask


def apply_umask(directory: Path) -> None:
    """Give ``directory`` and its files the modes the user's umask asks for, as any other tool would:
    mkdtemp makes 0700 and safetensors writes 0600, which would hide a shared checkpoint from its readers."""
    mask = _umask()
    for p in [directory, *directory.rglob("*")]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def clean_partials(output: Path) -> list[Path]:
    """Remove what an interrupted save of ``output`` left beside it (``.NAME.partial-PID-*``,
    ``.NAME.old-PID``) unless its process still runs; return what was removed."""
    output = Path(output)
    removed = []
    for leftover in sorted(output.parent.glob(f".{output.name}.partial-*")) + sorted(
            output.parent.glob(f".{output.name}.old-*")):
        pid = re.search(r"\.(?:partial|old)-(\d+)-?", leftover.name)
        if pid and int(pid[1]) != os.getpid() and _pid_alive(int(pid[1])):
            continue  # another run is saving the same output right now
        shutil.rmtree(leftover, ignore_errors=True)
        removed.append(leftover)
    return removed


def is_checkpoint(path: Path) -> bool:
    """A directory lowbit wrote (it has a manifest), or an empty one: the only kinds --overwrite replaces."""
    path = Path(path)
    return path.is_dir() and ((path / MANIFEST).is_file() or not any(path.iterdir()))


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_output(output: Path, overwrite: bool = False, need_bytes: int = 0) -> None:
    """Fail before any work if ``output`` cannot be written: it exists (without ``overwrite``), it is
    not a lowbit checkpoint (with it), its parent is not a writable directory, or the disk is too full."""
    output = Path(output)
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite to replace it")
    if output.exists() and not is_checkpoint(output):
        raise CheckpointError(
            f"{output} is not a lowbit checkpoint (no {MANIFEST}), so --overwrite will not replace it: "
            "choose another output, or remove that directory yourself if it is no longer needed"
        )
    parent = _existing_ancestor(output.parent)
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write {output}: {parent} is not a writable directory; choose another output")
    for leftover in clean_partials(output):
        print(f"note: removed {leftover}, left by an interrupted save")
    free = shutil.disk_usage(parent).free
    if need_bytes > free:
        raise CheckpointError(
            f"not enough disk space for {output}: about {need_bytes / 1e9:.2f} GB needed, "
            f"{free / 1e9:.2f} GB free on {parent}; free some space or choose another output"
        )


def _claim_holder(claim: Path) -> dict:
    try:
        holder = json.loads(claim.read_text())
        return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else {}
    except (OSError, ValueError):
        return {}


@contextmanager
def claim_output(output: Path):
    """Hold ``output`` for this run: a second run to the same output fails at once, naming this one,
    instead of both working for an hour and one replacing the other. The claim (``.NAME.claim`` beside
    it) is made whole with a hard link, which fails if it exists; one left by a run that died is taken over."""
    output = Path(output).absolute()
    claim = output.with_name(f".{output.name}.claim")
    mine = output.with_name(f".{output.name}.claim-{os.getpid()}")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        mine.write_text(json.dumps({"pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                                    "command": " ".join(sys.argv)}))
    except OSError:  # an unwritable place: check_output says so, in its words
        yield
        return
    try:
        for _ in range(3):
            try:
                os.link(mine, claim)
                break
            except FileExistsError:
                holder = _claim_holder(claim)
                if holder and holder["pid"] != os.getpid() and _pid_alive(holder["pid"]):
                    raise CheckpointError(
                        f"{output} is being written by another lowbit run (pid {holder['pid']}, since "
                        f"{holder.get('since')}: {holder.get('command')}); wait for it or choose another output"
                    ) from None
                claim.unlink(missing_ok=True)  # its run is gone (or it was being written this instant)
        else:
            raise CheckpointError(f"could not claim {output}: {claim} keeps reappearing; try again")
    finally:
        mine.unlink(missing_ok=True)
    try:
        yield
    finally:
        claim.unlink(missing_ok=True)


@contextmanager
def staged_output(output: Path, overwrite: bool = False):
    """Yield a temporary directory that becomes ``output`` only if the block succeeds."""
    output = Path(output)
    check_output(output, overwrite)
    output.parent.mkdir(parents=True, exist_ok=True)
    # the pid in the name tells the next run whether the save that left this is still running
    stage = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-{os.getpid()}-", dir=output.parent))
    try:
        yield stage
        apply_umask(stage)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    old = None
    if output.exists() and not overwrite:  # written by someone else while this run worked
        shutil.rmtree(stage, ignore_errors=True)
        raise FileExistsError(f"{output} appeared while this run worked; nothing was replaced: "
                              "pass --overwrite to replace it, or choose another output")
    if output.exists():
        old = output.with_name(f".{output.name}.old-{os.getpid()}")
        output.rename(old)
    stage.rename(output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def state_dict_for_checkpoint(
    model: torch.nn.Module,
    quantized: dict[str, QuantizedWeight],
    dtype: torch.dtype | None,
) -> dict[str, torch.Tensor]:
    """The model's tensors with each quantized Linear's weight replaced by its packed form."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False)) and "lm_head" not in quantized
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module in quantized:
            continue
        if tied and name == "lm_head.weight":
            continue  # shared with embed_tokens; transformers re-ties it on load
        if tensor.is_floating_point() and dtype is not None:
            tensor = tensor.to(dtype)
        tensors[name] = tensor.detach().contiguous().cpu()
    for name, qw in quantized.items():
        scale_dtype = dtype or model.get_submodule(name).weight.dtype
        tensors.update(qw.to_tensors(name, scale_dtype))
    return tensors


def write_safetensors(tensors: dict[str, torch.Tensor], directory: Path) -> list[str]:
    """Write one file, or shards plus the standard index when the model is large."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], directory / "model.safetensors", metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(shard, directory / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return names


def save(
    model: torch.nn.Module,
    quantized: dict[str, QuantizedWeight],
    output: Path,
    *,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    manifest: dict | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` with its ``quantized`` Linears as a compressed-tensors checkpoint."""
    output = Path(output)
    with disk_full_named(output):
        return _save(model, quantized, output, tokenizer, dtype, manifest, overwrite)


@contextmanager
def disk_full_named(output: Path):
    """A write that fills the disk is one error naming the output (safetensors reports it as its own
    error type, the rest as OSError ENOSPC); the staged directory is gone by then, so nothing is left."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as e:
        if getattr(e, "errno", None) != errno.ENOSPC and "No space left" not in str(e):
            raise
        raise CheckpointError(f"the disk filled while writing {output}; nothing was written (no partial "
                              "checkpoint is left): free some space or choose another output") from None


def _save(model, quantized, output, tokenizer, dtype, manifest, overwrite) -> Path:
    plan = {name: qw.scheme for name, qw in quantized.items()}
    all_linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with staged_output(output, overwrite) as stage:
        write_safetensors(state_dict_for_checkpoint(model, quantized, dtype), stage)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        if dtype is not None:
            config["dtype"] = str(dtype).removeprefix("torch.")
        if "lm_head" in quantized:
            config["tie_word_embeddings"] = False  # the head now differs from the embedding
        ignored = [n for n in all_linears if n not in plan] + routers(model)
        config["quantization_config"] = quantization_config(plan, ignored)
        (stage / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(stage)
        if tokenizer is not None:
            tokenizer.save_pretrained(stage)
        write_manifest(stage, manifest or {})
    return output


def write_manifest(directory: Path, info: dict) -> None:
    files = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    body = {
        "lowbit_manifest": MANIFEST_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **info,
        "files": {name: {"sha256": sha256(directory / name), "bytes": (directory / name).stat().st_size} for name in files},
    }
    # written aside and renamed: a reader (another run verifying the shared model cache) never sees half of it
    partial = directory / f".{MANIFEST}.{os.getpid()}"
    partial.write_text(json.dumps(body, indent=2))
    partial.replace(directory / MANIFEST)


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
