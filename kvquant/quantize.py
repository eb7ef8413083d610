"""Quantize and dequantize keys and values: the one implementation every KV cache uses.

The transformers cache (:mod:`kvquant.hf`), the runtime's paged cache and the
GPU kernels' references all call these. The integer math is ``quant.affine``'s
(groups along the last dimension, so per-channel keys are a transpose) and the
bit packing ``quant.packing``'s; only FP8 is its own (a cast, not an affine grid).

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

Integer data is packed along ``D`` for every token (compressed-tensors' layout:
value ``i`` of a token occupies bits ``[i*bits, (i+1)*bits)`` of its little-endian
word stream, stored unsigned as ``q + 2**(bits-1)``). Dequantized:
``x = (q - zero) * scale`` with ``q`` signed and ``zero`` a float (KIVI's min/max
grid, see ``quant.affine.choose_qparams(float_zero=True)``); FP8: ``x = data * scale``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from kvquant.scheme import FP8_MAX, KVScheme
from quant.affine import QuantScheme, choose_qparams, from_grid, quantize
from quant.packing import pack, packed_length, unpack

SCALE_DTYPE = torch.float16  # scales and zero points of the integer schemes
FP8_DTYPE = torch.float8_e4m3fn


class QuantizedKV(NamedTuple):
    data: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None

    def map(self, fn) -> "QuantizedKV":
        """Apply ``fn`` to every tensor (index, move, reshape the leading dimensions)."""
        return QuantizedKV(*(None if t is None else fn(t) for t in self))


def _affine_scheme(scheme: KVScheme, keys: bool) -> tuple[QuantScheme, bool]:
    """The affine grid of keys or values, and whether groups run over tokens (keys per channel)."""
    if scheme.bits == 8:
        return QuantScheme(bits=8, group_size=-1), False  # per token: the whole head is one group
    return QuantScheme(bits=scheme.bits, group_size=scheme.group_size), keys


def _quantize_int(x: torch.Tensor, scheme: KVScheme, keys: bool) -> QuantizedKV:
    grid, per_channel = _affine_scheme(scheme, keys)
    if per_channel:
        x = x.transpose(-1, -2)  # [..., D, T]: groups of G tokens along the last dim
    scale, zero = choose_qparams(x, grid, scheme.range_ratio(keys), scale_dtype=SCALE_DTYPE, float_zero=True)
    q = quantize(x, scale, zero, grid)
    if per_channel:
        q, scale, zero = q.transpose(-1, -2), scale.transpose(-1, -2), zero.transpose(-1, -2)
    d = q.shape[-1]
    data = pack(q.reshape(-1, d), scheme.bits).reshape(*q.shape[:-1], -1)
    return QuantizedKV(data, scale.contiguous(), zero.contiguous())


def _dequantize_int(qx: QuantizedKV, scheme: KVScheme, keys: bool, head_dim: int, out: torch.Tensor) -> torch.Tensor:
    grid, per_channel = _affine_scheme(scheme, keys)
    data, scale, zero = qx
    q = unpack(data.reshape(-1, data.shape[-1]), scheme.bits, head_dim).reshape(*data.shape[:-1], head_dim)
    # Each scale and zero broadcast over its group, in the [..., T, D] layout itself: no transposes.
    if per_channel:  # one per channel and group of G tokens: [..., T/G, D]
        split, expand = (-2, (-1, scheme.group_size)), -2
    else:  # one per token and group of channels: [..., T, D/g]
        split, expand = (-1, (-1, grid.group_len(head_dim))), -1
    from_grid(q.unflatten(*split), scale.unsqueeze(expand), zero.unsqueeze(expand), out=out.unflatten(*split))
    return out


def _quantize_fp8(x: torch.Tensor) -> QuantizedKV:
    # One scale per head and block: the block's largest magnitude lands on e4m3's largest value.
    amax = x.abs().amax(dim=(-2, -1), keepdim=True).float()
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return QuantizedKV((x.float() / scale).to(FP8_DTYPE), scale)


def _fp8_to_float(data: torch.Tensor) -> torch.Tensor:
    """``data.float()``, as a gather from the 256 values e4m3 can hold: the same numbers, several
    times faster than PyTorch's elementwise float8 conversion on CPU."""
    return _fp8_values(data.device).index_select(0, data.view(torch.uint8).flatten().int()).view(data.shape)


@functools.cache
def _fp8_values(device: torch.device) -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float().to(device)


def quantize_kv(x: torch.Tensor, scheme: KVScheme, keys: bool) -> QuantizedKV:
    """Quantize keys (``keys=True``) or values ``[..., T, D]``. KIVI keys need ``T % group_size == 0``."""
    if not scheme.quantized:
        return QuantizedKV(x)
    if scheme.fp8:
        return _quantize_fp8(x)
    return _quantize_int(x, scheme, keys)


def dequantize_kv(qx: QuantizedKV, scheme: KVScheme, keys: bool, head_dim: int, dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Back to ``[..., T, D]`` in ``dtype``. ``out`` (that shape, any strides: a view of a larger
    buffer, as the runtime cache's read fills one) receives the values instead of a new tensor."""
    qx = QuantizedKV(*qx)  # a plain (data, scale, zero) tuple reads the same
    if not scheme.quantized:
        return qx.data.to(dtype) if out is None else out.copy_(qx.data)
    if out is None:
        out = torch.empty((*qx.data.shape[:-1], head_dim), dtype=dtype, device=qx.data.device)
    if scheme.fp8:
        return torch.mul(_fp8_to_float(qx.data), qx.scale, out=out)
    return _dequantize_int(qx, scheme, keys, head_dim, out)


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
    T, D, G = scheme.block_size, head_dim, scheme.group_size
    if not scheme.quantized:
        return {"data": ((T, D), dtype)}
    if scheme.fp8:
        return {"data": ((T, D), FP8_DTYPE), "scale": ((1, 1), torch.float32)}
    if scheme.bits == 8:
        groups = (T, 1)
    else:
        groups = (T // G, D) if keys else (T, D // G)
    return {
        "data": ((T, packed_length(D, scheme.bits)), torch.int32),
        "scale": (groups, SCALE_DTYPE),
        "zero": (groups, SCALE_DTYPE),
    }


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
