"""Byte sizes and device synchronization: the one home of each, shared by the runtime and evals."""

from __future__ import annotations

import math
import re

import torch

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value) -> int:
    """``24GB`` (10^9), ``24GiB`` (2^30), ``1.5 mb``, ``1e9``, ``4096`` or an int, to bytes.
    A ValueError names what could not be read."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = m and m[2].lower()
    if not m or unit not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size in bytes: use e.g. 24GB, 24GiB, 512MB or a byte count")
    size = float(m[1]) * _UNITS[unit]
    if not math.isfinite(size):  # 1e400GB: int() of it would be an OverflowError
        raise ValueError(f"{value!r} is too large to be a size in bytes")
    return int(size)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing elsewhere. For timing only."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
