"""Bytes a whole sequence's KV cache takes, as the runtime's paged cache allocates it.

``bytes_per_token`` is the per-token rate of the quantized blocks; a sequence of up
to ``n * B`` tokens gets ``n`` pool blocks (``runtime.cache.KVCache`` allocates
``ceil(max_len / B)`` per sequence) and one unquantized residual block of
``residual`` tokens (keys and values in the model dtype, every layer and KV head),
whatever its length. The memory planner sizes budgets with these functions; a
test holds them to the bytes an allocated cache really has.
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
    """KV bytes allocated for one sequence of up to ``tokens`` positions: its pool blocks (scales included)
    and its residual block (the block table, 4 bytes per block, is left out)."""
    blocks = -(-tokens // scheme.block_size)
    per_block = num_layers * kv_heads * block_bytes(scheme, head_dim, dtype)
    return blocks * per_block + residual_bytes(scheme, num_layers, kv_heads, head_dim, dtype)


def max_tokens(scheme: KVScheme, num_layers: int, kv_heads: int, head_dim: int, budget: int,
               dtype: torch.dtype = torch.float16) -> int:
    """The longest sequence whose KV cache fits in ``budget`` bytes (0 if not even the residual fits)."""
    fixed = residual_bytes(scheme, num_layers, kv_heads, head_dim, dtype)
    if budget < fixed:
        return 0
    per_block = num_layers * kv_heads * block_bytes(scheme, head_dim, dtype)
    blocks = (budget - fixed) // per_block
    return blocks * scheme.block_size


def stored_bytes(scheme: KVScheme, num_layers: int, kv_heads: int, head_dim: int, tokens: int,
                 dtype: torch.dtype = torch.float16) -> int:
    """Bytes that hold ``tokens`` positions of one sequence: its full blocks and the filled part of the
    residual. What attention reads per decode step, as opposed to what is allocated."""
    full_blocks, partial = divmod(tokens, scheme.block_size)
    per_block = num_layers * kv_heads * block_bytes(scheme, head_dim, dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return full_blocks * per_block + num_layers * kv_heads * 2 * partial * head_dim * itemsize
