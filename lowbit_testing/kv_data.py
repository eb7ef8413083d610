"""KV-cache test data the KV tests share."""

from __future__ import annotations

import torch


def keys_with_offset_channels(*lead, tokens=128, dim=64, seed=0):
    """Keys as LLMs make them: a few channels carry a large, persistent offset."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, tokens, dim, generator=g)
    offsets = torch.zeros(dim)
    offsets[torch.randperm(dim, generator=g)[:4]] = 12.0
    return x + offsets


def rel_err(a, b):
    return float((a - b).norm() / b.norm())
