"""The quantized matmul's tuned winners kept on disk, so a later process skips the timing.

An Engine's start-up on a GPU tunes every quantized Linear shape in every M bucket (each time some
17 candidates compiled and timed: minutes). ``matmul_tuning.tune`` keeps each checked winner here
and, in a later process, takes it instead of timing once it passes the check again (a kept entry
that fails is discarded). One JSON file per entry, named by the hash of its key; the key is
everything a winner depends on: the GPU (name, compute capability, CUDA release), the torch and
Triton releases, a hash of the kernels' sources (``runtime/kernels/*.py``), the shape (M bucket,
outputs, inputs, bits, group, zero points, act-order, dtype) and the candidate list. The file
holds the key too, so a file that does not read back as this key (corrupt, truncated, another
version) is ignored with a warning and replaced by the next winner.

Where: ``$LOWBIT_TUNING_CACHE`` (a directory), else ``~/.cache/lowbit/tuning``;
``LOWBIT_TUNING_CACHE=0`` turns it off. Writes go to a temporary file renamed into place, so a
reader never sees half a file; a folder that cannot be read or written warns once and tuning goes on.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch

from runtime.kernels.matmul_configs import MatmulConfig
from runtime.kernels.weight_layout import KernelWeight

ENV = "LOWBIT_TUNING_CACHE"
KERNEL_SOURCES = Path(__file__).resolve().parent
_WARNED: set[str] = set()  # folders and files warned about in this process (one warning each)


def directory() -> Path | None:
    """Where entries are kept; None when ``LOWBIT_TUNING_CACHE=0`` turns the cache off."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in ("0", "off", "false", "no"):
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "lowbit" / "tuning"


@functools.cache
def sources_hash() -> str:
    """sha256 of the kernels' sources (names and contents): a changed kernel is tuned afresh."""
    digest = hashlib.sha256()
    for path in sorted(KERNEL_SOURCES.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def gpu(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type  # (tests tune CPU tensors in the interpreter)
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)}, sm_{major}{minor}, CUDA {torch.version.cuda}"


def entry_key(M: int, kw: KernelWeight, dtype: torch.dtype, device: torch.device,
              candidates: list[MatmulConfig]) -> dict:
    import triton

    return {"gpu": gpu(device), "torch": torch.__version__, "triton": triton.__version__, "sources": sources_hash(),
            "shape": [M, kw.out_features, kw.in_features, kw.bits, kw.group_len, kw.zeros is not None,
                      kw.perm is not None, str(dtype).removeprefix("torch.")],
            "candidates": [dataclasses.asdict(c) for c in candidates]}


def entry_path(root: Path, key: dict) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return root / f"{name}.json"


def load(M: int, kw: KernelWeight, dtype: torch.dtype, device: torch.device,
         candidates: list[MatmulConfig]) -> MatmulConfig | None:
    """The winner kept for this key, or None (none kept, the cache off, or a file that does not
    read back: warned, left for the next winner to replace)."""
    root = directory()
    if root is None:
        return None
    key = entry_key(M, kw, dtype, device, candidates)
    path = entry_path(root, key)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        _unusable(root, e)
        return None
    try:
        entry = json.loads(text)
        if entry["key"] != key:
            raise ValueError("the file holds another key")
        config = MatmulConfig(**entry["winner"])
        if config not in candidates:
            raise ValueError(f"{config} is not a candidate")
    except (ValueError, KeyError, TypeError) as e:  # (json's JSONDecodeError is a ValueError)
        _warn_once(str(path), f"the tuning cache's entry {path} is ignored ({type(e).__name__}: {e}); the "
                   f"candidates are timed and the entry replaced")
        return None
    return config


def store(M: int, kw: KernelWeight, dtype: torch.dtype, device: torch.device, candidates: list[MatmulConfig],
          winner: MatmulConfig) -> None:
    root = directory()
    if root is None:
        return
    key = entry_key(M, kw, dtype, device, candidates)
    text = json.dumps({"key": key, "winner": dataclasses.asdict(winner)}, indent=1, sort_keys=True)
    temporary = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=root, suffix=".tmp")
        with os.fdopen(handle, "w") as f:
            f.write(text)
        os.replace(temporary, entry_path(root, key))  # atomic: a reader sees the old file or the new one
    except OSError as e:
        _unusable(root, e)
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)


def discard(M: int, kw: KernelWeight, dtype: torch.dtype, device: torch.device,
            candidates: list[MatmulConfig]) -> None:
    root = directory()
    if root is None:
        return
    try:
        entry_path(root, entry_key(M, kw, dtype, device, candidates)).unlink(missing_ok=True)
    except OSError as e:
        _unusable(root, e)


def _unusable(root: Path, e: OSError) -> None:
    _warn_once(str(root), f"the tuning cache {root} cannot be read or written ({type(e).__name__}: {e}); tuned "
               f"configurations are timed in each process")


def _warn_once(what: str, message: str) -> None:
    """One warning per folder or file in a process, however many shapes meet it."""
    if what not in _WARNED:
        _WARNED.add(what)
        warnings.warn(message, stacklevel=4)
