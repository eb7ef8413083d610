"""Dense bit packing of signed integers into int32 words.

Byte-compatible with compressed-tensors ``pack-quantized``: a value is stored
unsigned (``q + 2**(bits-1)``), and element ``i`` of a run along the packed
dimension occupies bits ``[i*bits, (i+1)*bits)`` of the run's little-endian bit
stream, so every 32 elements fill exactly ``bits`` words (values may straddle
words when ``bits`` does not divide 32). The run is zero-padded to a multiple
of 32 and cut to ``ceil(n * bits / 32)`` words.
"""

from __future__ import annotations

import math
import sys

import torch

_ROWS_PER_CHUNK = 2048  # bounds the temporary bit tensor on large layers
# Widths whose values never straddle a byte: on a little-endian host the words' bytes are the
# stream's bytes in order, so packing and unpacking work on bytes (int8 lanes: a quarter of the
# memory traffic of int32 shifts; 8 bits is a bare reinterpretation).
_BYTE_WIDTHS = (2, 4, 8) if sys.byteorder == "little" else ()


def packed_length(n: int, bits: int) -> int:
    return math.ceil(n * bits / 32)


def pack(q: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Pack int8 values along ``dim`` of a 2-D tensor into int32 words."""
    if q.dtype != torch.int8:
        raise TypeError(f"pack expects int8 values, got {q.dtype}")
    if q.ndim != 2:
        raise ValueError(f"pack expects a 2-D tensor, got shape {tuple(q.shape)}")
    if dim in (0, -2):
        return pack(q.t(), bits).t().contiguous()
    rows, n = q.shape
    if bits in _BYTE_WIDTHS:
        return _pack_bytes(q, bits)
    u = (q.to(torch.int64) + (1 << (bits - 1))) & ((1 << bits) - 1)
    u = torch.nn.functional.pad(u, (0, (-n) % 32))
    if 32 % bits == 0:  # values never straddle words: shift them straight into place
        per_word = 32 // bits
        shifts = torch.arange(per_word, device=q.device, dtype=torch.int64) * bits
        words = (u.view(rows, -1, per_word) << shifts).sum(-1)
        words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
        return words[:, : packed_length(n, bits)].contiguous()
    out = torch.empty(rows, u.shape[1] * bits // 32, dtype=torch.int32, device=q.device)
    shifts = torch.arange(bits, device=q.device)
    word_shifts = torch.arange(32, device=q.device, dtype=torch.int64)
    for r in range(0, rows, _ROWS_PER_CHUNK):
        chunk = u[r : r + _ROWS_PER_CHUNK]
        bitstream = ((chunk.unsqueeze(-1) >> shifts) & 1).flatten(1)  # [rows, n_pad * bits]
        words = (bitstream.unflatten(1, (-1, 32)) << word_shifts).sum(-1)
        words = torch.where(words >= 1 << 31, words - (1 << 32), words)
        out[r : r + _ROWS_PER_CHUNK] = words.to(torch.int32)
    return out[:, : packed_length(n, bits)].contiguous()


def unpack(packed: torch.Tensor, bits: int, n: int, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`pack`: ``n`` int8 values along ``dim``."""
    if packed.dtype != torch.int32:
        raise TypeError(f"unpack expects int32 words, got {packed.dtype}")
    if packed.ndim != 2:
        raise ValueError(f"unpack expects a 2-D tensor, got shape {tuple(packed.shape)}")
    if dim in (0, -2):
        return unpack(packed.t(), bits, n).t().contiguous()
    expected = packed_length(n, bits)
    if packed.shape[1] != expected:
        raise ValueError(f"{n} values of {bits} bits need {expected} words, got {packed.shape[1]}")
    rows = packed.shape[0]
    if bits in _BYTE_WIDTHS:
        return _unpack_bytes(packed, bits, n)
    if 32 % bits == 0:  # values never straddle words
        per_word = 32 // bits
        shifts = torch.arange(per_word, device=packed.device, dtype=torch.int32) * bits
        values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # arithmetic shift, then mask
        return (values.flatten(1)[:, :n] - (1 << (bits - 1))).to(torch.int8)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    words = torch.nn.functional.pad(words, (0, (-expected) % bits))
    out = torch.empty(rows, n, dtype=torch.int8, device=packed.device)
    word_shifts = torch.arange(32, device=packed.device, dtype=torch.int64)
    weights = 1 << torch.arange(bits, device=packed.device, dtype=torch.int64)
    for r in range(0, rows, _ROWS_PER_CHUNK):
        bitstream = ((words[r : r + _ROWS_PER_CHUNK].unsqueeze(-1) >> word_shifts) & 1).flatten(1)
        values = (bitstream.unflatten(1, (-1, bits)) * weights).sum(-1)[:, :n]
        out[r : r + _ROWS_PER_CHUNK] = (values - (1 << (bits - 1))).to(torch.int8)
    return out


def _pack_bytes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack` for 2, 4 and 8 bits: each byte of the stream is ``8 / bits`` values, the first in
    its low bits; rows padded to 32 values (whole words), then cut to the words they need."""
    rows, n = q.shape
    per_byte = 8 // bits
    # unsigned q + 2**(bits-1) of a two's-complement int8 is q with the field's top bit flipped
    u = (q.contiguous().view(torch.uint8) ^ (1 << (bits - 1))) & ((1 << bits) - 1)
    u = torch.nn.functional.pad(u, (0, (-n) % 32)).contiguous().view(rows, -1, per_byte)
    stream = u[..., 0].contiguous()
    for i in range(1, per_byte):
        stream |= u[..., i] << (bits * i)
    return stream.view(torch.int32)[:, : packed_length(n, bits)].contiguous()


def _unpack_bytes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """:func:`unpack` for 2, 4 and 8 bits, on the stream's bytes. 8 bits: flipping the top bit turns
    the stored ``q + 128`` into ``q`` in two's complement. 2 and 4: each byte widened to the
    ``8 / bits`` bytes of an int16/int32 with field ``i`` shifted into byte ``i`` and masked, so the
    wide word's bytes are the unsigned values in order (little-endian); less ``2**(bits-1)`` as int8."""
    stream = packed.contiguous().view(torch.uint8)
    if bits == 8:
        return (stream ^ 0x80).view(torch.int8)[:, :n].contiguous()
    per_byte = 8 // bits
    byte = stream.to(torch.int16 if per_byte == 2 else torch.int32)
    wide = byte.clone()
    for i in range(1, per_byte):
        wide |= byte << ((8 - bits) * i)  # field i (bits i*bits..) lands on bits 8*i..
    wide &= sum(((1 << bits) - 1) << (8 * i) for i in range(per_byte))
    values = wide.view(torch.int8).view(packed.shape[0], -1).sub_(1 << (bits - 1))
    return values[:, :n].contiguous()
