"""Writing lowbit checkpoints: the output directory claimed for one run, a staged temporary sibling
renamed into place at the end (an interrupted run never leaves a half-written checkpoint, and an
existing output is only replaced when the caller says so), the tensors, config and manifest.
Reading and verifying them is ``quant/checkpoint.py``."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from quant.checkpoint import MANIFEST, MANIFEST_VERSION, CheckpointError, sha256
from quant.format import QuantizedWeight, quantization_config
from quant.moe import routers

SHARD_BYTES = 4 << 30


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
