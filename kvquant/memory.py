"""Bytes a whole sequence's KV cache takes, as the runtime's paged cache lays it out.

``bytes_per_token`` is the per-token rate of the quantized blocks; a sequence also
holds one unquantized residual block of ``residual`` tokens (keys and values in the
model dtype, every layer and KV head), whatever its length. Tokens of the newest,
partial block live in that residual, so ``n`` full blocks hold up to
``n * B + B - 1`` tokens. The memory planner sizes budgets with these two functions.
"""

from __future__ import annotations

import torch

from kvquant.quantize import block_bytes
from kvquant.scheme import KVScheme


def residual_bytes(scheme: KVScheme, num_layers: int, kv_heads: int, head_dim: int,
                   dtype: torch.dtype = torch.float16) -> int:
    """The fixed per-sequence cost: one block of ``residual`` tokens, keys and values, unquantized."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * kv_heads * 2 * scheme.residual * head_dim * itemsize


def sequence_bytes(scheme: KVScheme, num_layers: int, kv_heads: int, head_dim: int, tokens: int,
                   dtype: torch.dtype = torch.float16) -> int:
    """KV bytes of one sequence of ``tokens`` positions: its full blocks (scales included) and its residual."""
    full_blocks = tokens // scheme.block_size
    per_block = num_layers * kv_heads * block_bytes(scheme, head_dim, dtype)
    return full_blocks * per_block + residual_bytes(scheme, num_layers, kv_heads, head_dim, dtype)


def max_tokens(scheme: KVScheme, num_layers: int, kv_heads: int, head_dim: int, budget: int,
               dtype: torch.dtype = torch.float16) -> int:
    """The longest sequence whose KV cache fits in ``budget`` bytes (0 if not even the residual fits)."""
    fixed = residual_bytes(scheme, num_layers, kv_heads, head_dim, dtype)
    if budget < fixed:
        return 0
    per_block = num_layers * kv_heads * block_bytes(scheme, head_dim, dtype)
    blocks = (budget - fixed) // per_block
    return blocks * scheme.block_size + scheme.block_size - 1  # the residual holds a partial block


def stored_bytes(scheme: KVScheme, num_layers: int, kv_heads: int, head_dim: int, tokens: int,
                 dtype: torch.dtype = torch.float16) -> int:
    """Bytes that hold ``tokens`` positions of one sequence: its full blocks and the filled part of the
    residual. What attention reads per decode step, as opposed to what is allocated."""
    full_blocks, partial = divmod(tokens, scheme.block_size)
    per_block = num_layers * kv_heads * block_bytes(scheme, head_dim, dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return full_blocks * per_block + num_layers * kv_heads * 2 * partial * head_dim * itemsize
