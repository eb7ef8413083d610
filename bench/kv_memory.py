"""KV-cache memory for bench/kv.py: bytes per token of each scheme, computed from its layout and
measured on an allocated runtime cache, and how many sequences fit a memory budget.

The runtime sizes its caches itself (``runtime.cache``, ``kvquant.bytes_per_token``) and
``lowbit plan`` answers a user's "what fits" (``evals.planner``); these rows are the bench's check
that the two agree with what is really allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvquant import KVScheme, bytes_per_token


@dataclass(frozen=True)
class ModelShape:
    """What a KV cache's size depends on."""

    num_layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, decoder_cfg) -> "ModelShape":
        return cls(decoder_cfg.num_layers, decoder_cfg.num_kv_heads, decoder_cfg.head_dim)


def allocated_bytes(scheme: KVScheme, shape: ModelShape, sequences: int, context: int,
                    dtype: torch.dtype = torch.float16) -> int:
    """Bytes a runtime cache for ``sequences`` x ``context`` tokens really allocates (built on the
    CPU and counted: pool, residual blocks, block table)."""
    from runtime.cache import KVCache

    cache = KVCache(shape.num_layers, sequences, shape.kv_heads, shape.head_dim, context, dtype, "cpu", scheme=scheme)
    return cache.nbytes()


def memory_row(scheme: KVScheme, shape: ModelShape, context: int, dtype: torch.dtype = torch.float16) -> dict:
    """Bytes per token of one scheme: computed from the layout, and measured on an allocated cache."""
    computed = bytes_per_token(scheme, shape.num_layers, shape.kv_heads, shape.head_dim, dtype)
    fp16 = bytes_per_token(KVScheme(), shape.num_layers, shape.kv_heads, shape.head_dim, dtype)
    measured = allocated_bytes(scheme, shape, 1, context, dtype) / context
    return {
        "scheme": scheme.name,
        "bytes_per_token": computed,
        "vs_fp16": computed / fp16,
        "measured_bytes_per_token": measured,  # includes the per-sequence residual block at this context
        "measured_context": context,
    }


def capacity(scheme: KVScheme, shape: ModelShape, budget_bytes: int, context: int,
             dtype: torch.dtype = torch.float16, measure: bool = True) -> dict:
    """How many sequences of ``context`` tokens fit in ``budget_bytes`` of KV cache.

    The count comes from one sequence's allocated bytes; with ``measure`` a cache for that many
    sequences is then allocated and counted (``measured_bytes``), to show that it fits.
    """
    per_sequence = allocated_bytes(scheme, shape, 1, context, dtype)
    sequences = budget_bytes // per_sequence
    row = {"scheme": scheme.name, "budget_bytes": budget_bytes, "context": context,
           "bytes_per_sequence": per_sequence, "sequences": int(sequences)}
    if measure and sequences:
        row["measured_bytes"] = allocated_bytes(scheme, shape, int(sequences), context, dtype)
    return row


def capacity_table(schemes: list[KVScheme], shape: ModelShape, budget_bytes: int, contexts: list[int],
                   dtype: torch.dtype = torch.float16, measure: bool = True) -> list[dict]:
    return [capacity(s, shape, budget_bytes, c, dtype, measure) for c in contexts for s in schemes]


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n} B"
