"""Writing and reading lowbit checkpoints: a Hugging Face directory, safetensors only.

Writes go to a temporary sibling directory that is renamed into place at the
end, so an interrupted run never leaves a half-written checkpoint and an
existing output is only replaced when the caller says so. The manifest
records what produced the checkpoint and the sha256 of every file, so a
truncated or altered file is caught on load.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quant.affine import QuantScheme
from quant.format import QuantizedWeight, linear_schemes, quantization_config

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


@contextmanager
def staged_output(output: Path, overwrite: bool = False):
    """Yield a temporary directory that becomes ``output`` only if the block succeeds."""
    output = Path(output)
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite to replace it")
    output.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    old = None
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
        config["quantization_config"] = quantization_config(plan, [n for n in all_linears if n not in plan])
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
    (directory / MANIFEST).write_text(json.dumps(body, indent=2))


def read_manifest(path: Path) -> dict | None:
    f = Path(path) / MANIFEST
    return json.loads(f.read_text()) if f.exists() else None


def verify(path: Path) -> dict | None:
    """Check every file listed in the manifest; return the manifest (None if there is none)."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest is None:
        return None
    for name, entry in manifest.get("files", {}).items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{f} is listed in {MANIFEST} but missing; the checkpoint is incomplete")
        if f.stat().st_size != entry["bytes"] or sha256(f) != entry["sha256"]:
            raise CheckpointError(
                f"{f} does not match its sha256 in {MANIFEST} (truncated or altered); "
                "re-create or re-download the checkpoint"
            )
    return manifest


def safetensors_files(path: Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path} (lowbit reads safetensors only, never pickle)")
    return files


def read_tensors(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    tensors = {}
    for f in safetensors_files(path):
        try:
            with safe_open(f, framework="pt", device=device) as st:
                for key in st.keys():
                    tensors[key] = st.get_tensor(key)
        except Exception as e:  # safetensors raises several types for corrupt headers
            raise CheckpointError(f"cannot read {f}: {e}") from e
    return tensors


def read_config(path: Path) -> dict:
    f = Path(path) / "config.json"
    if not f.exists():
        raise CheckpointError(f"{f} not found: a checkpoint is a Hugging Face model directory with config.json")
    return json.loads(f.read_text())


def read_schemes(path: Path, linear_names: list[str]) -> dict[str, QuantScheme]:
    return linear_schemes(read_config(path), linear_names)
