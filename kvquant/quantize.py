"""Quantize and dequantize keys and values: the one entry point every KV cache uses.

The transformers cache (:mod:`kvquant.hf`), the runtime's paged cache and the
GPU kernels' references all call these; each scheme's family (:mod:`kvquant.schemes`)
does the math and declares the layout.

Inputs are ``[..., T, D]``: any leading dimensions (batch, block, head), ``T``
tokens of ``D = head_dim`` channels. Quantized tensors keep the leading
dimensions; :func:`layout` gives their shapes for one block of ``T = residual``
tokens, which is what the runtime's paged cache stores per block and head:

| scheme | data | scale, zero |
|--------|------|-------------|
| fp16 | ``[T, D]`` model dtype | none |
| int8 keys and values | ``[T, D/4]`` int32 | ``[T, 1]`` float16 each: one per token |
| int4/int2 keys | ``[T, D*bits/32]`` int32 | ``[T/G, D]`` float16 each: one per channel and group of G tokens |
| int4/int2 values | ``[T, D*bits/32]`` int32 | ``[T, D/G]`` float16 each: one per token and group of G channels |
| fp8 keys and values | ``[T, D]`` float8_e4m3fn | scale ``[1, 1]`` float32 (per head and block), no zero |
| k8v4, k4v2, ... | each side as its width above (8 bits: as int8; 4, 2: as int4/int2) | |

Integer data is packed along ``D`` for every token (compressed-tensors' layout:
value ``i`` of a token occupies bits ``[i*bits, (i+1)*bits)`` of its little-endian
word stream, stored unsigned as ``q + 2**(bits-1)``). Dequantized:
``x = (q - zero) * scale`` with ``q`` signed and ``zero`` a float (KIVI's min/max
grid, see ``quant.affine.choose_qparams(float_zero=True)``); FP8: ``x = data * scale``
(:mod:`kvquant.schemes.integer`, :mod:`kvquant.schemes.fp8`).
"""

from __future__ import annotations

import torch

from kvquant.scheme import KVScheme
from kvquant.schemes.base import SCALE_DTYPE, QuantizedKV  # noqa: F401 (public here)


def quantize_kv(x: torch.Tensor, scheme: KVScheme, keys: bool) -> QuantizedKV:
    """Quantize keys (``keys=True``) or values ``[..., T, D]``. Keys grouped over tokens need
    ``T % group_size == 0``."""
    return scheme.definition.quantize(x, scheme, keys)


def dequantize_kv(qx: QuantizedKV, scheme: KVScheme, keys: bool, head_dim: int, dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Back to ``[..., T, D]`` in ``dtype``. ``out`` (that shape, any strides: a view of a larger
    buffer, as the runtime cache's read fills one) receives the values instead of a new tensor."""
    qx = QuantizedKV(*qx)  # a plain (data, scale, zero) tuple reads the same
    if out is None:
        if not scheme.quantized:
            return qx.data.to(dtype)  # no copy when the dtype is the stored one
        out = torch.empty((*qx.data.shape[:-1], head_dim), dtype=dtype, device=qx.data.device)
    return scheme.definition.dequantize(qx, scheme, keys, head_dim, out)


def quantize_blocks(x: torch.Tensor, scheme: KVScheme, keys: bool, block_size: int | None = None) -> QuantizedKV:
    """``x`` [S, H, n*B, D] as ``n`` blocks of ``B`` tokens, each quantized on its own:
    tensors [S, n, H, *layout] (block-major, as the runtime's pool stores them)."""
    blocks = x.unflatten(2, (-1, block_size or scheme.block_size)).transpose(1, 2)
    return quantize_kv(blocks, scheme, keys)


def dequantize_blocks(q: QuantizedKV, scheme: KVScheme, keys: bool, head_dim: int, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks`: [S, n, H, *layout] back to [S, H, n*B, D] (into ``out``
    when given: written through a block-major view, so no transposed copy is made)."""
    S, n, H, B = q.data.shape[:4]
    if out is None:
        out = torch.empty(S, H, n * B, head_dim, dtype=dtype, device=q.data.device)
    dequantize_kv(q, scheme, keys, head_dim, dtype, out=out.unflatten(2, (n, -1)).transpose(1, 2))
    return out


def fake_quantize_kv(x: torch.Tensor, scheme: KVScheme, keys: bool) -> torch.Tensor:
    """What attention sees after a round trip through the cache."""
    return dequantize_kv(quantize_kv(x, scheme, keys), scheme, keys, x.shape[-1], x.dtype)


def layout(scheme: KVScheme, head_dim: int, dtype: torch.dtype, keys: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of ``data``, ``scale``, ``zero`` for one block of one head (see the module docstring)."""
    return scheme.definition.layout(scheme, head_dim, dtype, keys)


def block_bytes(scheme: KVScheme, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block of keys and values for one head, scales included."""
    total = 0
    for keys in (True, False):
        for shape, dt in layout(scheme, head_dim, dtype, keys).values():
            total += torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
    return total


def bytes_per_token(scheme: KVScheme, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float16) -> float:
    """Bytes one cached token costs in a model, keys and values, scales included.

    The unquantized residual block is a fixed cost per sequence (``residual`` tokens in
    ``dtype``), not per token; the runtime cache's ``nbytes`` counts it.
    """
    return num_layers * kv_heads * block_bytes(scheme, head_dim, dtype) / scheme.block_size
