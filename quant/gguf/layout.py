"""GGUF byte layouts: ``pack(fields)`` to the bytes llama.cpp reads, ``unpack`` back to fields.

Each block is laid out as ggml's ``block_*`` structs (ggml-common.h). Codes are stored as
unsigned integers (the code minus the type's lowest code), split into bit planes as the
kernels want them: nibbles, 2-bit "crumbs", single high bits, each plane a run of 16/32/64
elements packed across bytes. All of it is numpy on whole tensors: no loop over blocks.
"""

from __future__ import annotations

import numpy as np
import torch

from quant.gguf.types import GGUFFields, GGUFType, gguf_type


def _pack_planes(values: np.ndarray, width: int) -> np.ndarray:
    """``[..., k, L]`` integers of ``width`` bits (k = 8 // width) into ``[..., L]`` bytes:
    plane i takes bits ``width * i`` upward."""
    shifts = (np.arange(values.shape[-2], dtype=np.uint8) * width).reshape(-1, 1)
    return np.bitwise_or.reduce(values.astype(np.uint8) << shifts, axis=-2)


def _unpack_planes(data: np.ndarray, width: int) -> np.ndarray:
    """Inverse of :func:`_pack_planes`: ``[..., L]`` bytes into ``[..., 8 // width, L]``."""
    shifts = (np.arange(8 // width, dtype=np.uint8) * width).reshape(-1, 1)
    return (data[..., None, :] >> shifts) & np.uint8((1 << width) - 1)


def _f16_bytes(x: torch.Tensor, nb: int) -> np.ndarray:
    return x.detach().cpu().contiguous().numpy().astype(np.float16).reshape(nb, 1).view(np.uint8)


def _f16(data: np.ndarray, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(data).view(np.float16).reshape(rows, -1).copy())


def _ints(x: torch.Tensor | None, shape) -> np.ndarray:
    return x.detach().cpu().to(torch.int16).numpy().reshape(shape)


def _pack_scales_6bit(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 8 six-bit scales and 8 six-bit mins per super-block into 12 bytes (get_scale_min_k4)."""
    lo_sc, hi_sc, lo_mn, hi_mn = sc[:, :4], sc[:, 4:], mn[:, :4], mn[:, 4:]
    return np.concatenate([lo_sc | ((hi_sc >> 4) << 6), lo_mn | ((hi_mn >> 4) << 6),
                           (hi_sc & 15) | ((hi_mn & 15) << 4)], axis=1).astype(np.uint8)


def _unpack_scales_6bit(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b, c = data[:, 0:4], data[:, 4:8], data[:, 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, mn


def _pack_scales_q3(s: np.ndarray) -> np.ndarray:
    """Q3_K: 16 six-bit scales (stored + 32) into 12 bytes: low nibbles, then the high 2-bit pairs."""
    low = _pack_planes((s & 15).reshape(-1, 2, 8), 4)
    high = _pack_planes((s >> 4).reshape(-1, 4, 4), 2)
    return np.concatenate([low, high], axis=1)


def _unpack_scales_q3(data: np.ndarray) -> np.ndarray:
    low = _unpack_planes(data[:, :8], 4).reshape(-1, 16)
    high = _unpack_planes(data[:, 8:12], 2).reshape(-1, 16)
    return low | (high << 4)


def _pack_high_bits(high: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: each block's 32 fifth bits as one little-endian uint32 (bit j: element j)."""
    return _pack_planes(high.reshape(-1, 4, 8).transpose(0, 2, 1), 1)


def _unpack_high_bits(data: np.ndarray) -> np.ndarray:
    return _unpack_planes(data, 1).transpose(0, 2, 1).reshape(-1, 32)


def _blocks(fields: GGUFFields) -> tuple[int, np.ndarray]:
    """(number of blocks, the unsigned codes ``[blocks, block]``)."""
    t = fields.type
    u = _ints(fields.codes, (-1, t.block)) - t.code_range[0]
    return u.shape[0], u.astype(np.uint8)


def pack(fields: GGUFFields) -> np.ndarray:
    """The bytes of a tensor as a GGUF file stores it: uint8 ``[rows, row_bytes]``."""
    fields.check()
    t, (rows, cols) = fields.type, fields.shape
    nb, u = _blocks(fields)
    d = _f16_bytes(fields.d, nb)
    name = t.name
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        offset = [_f16_bytes(fields.dmin, nb)] if not t.symmetric else []
        high = [_pack_high_bits(u >> 4)] if name.startswith("Q5") else []
        parts = [d, *offset, *high, _pack_planes((u & 15).reshape(nb, 2, 16), 4)]
    elif name == "Q8_0":
        parts = [d, _ints(fields.codes, (nb, 32)).astype(np.int8).view(np.uint8)]
    elif name == "Q2_K":
        scales = _ints(fields.scales, (nb, 16)) | (_ints(fields.mins, (nb, 16)) << 4)
        parts = [scales.astype(np.uint8), _pack_planes(u.reshape(nb, 2, 4, 32), 2).reshape(nb, 64), d,
                 _f16_bytes(fields.dmin, nb)]
    elif name == "Q3_K":
        hmask = _pack_planes((u >> 2).reshape(nb, 8, 32), 1)
        low = _pack_planes((u & 3).reshape(nb, 2, 4, 32), 2).reshape(nb, 64)
        parts = [hmask, low, _pack_scales_q3(_ints(fields.scales, (nb, 16)) + 32), d]
    elif name in ("Q4_K", "Q5_K"):
        scales = _pack_scales_6bit(_ints(fields.scales, (nb, 8)), _ints(fields.mins, (nb, 8)))
        low = _pack_planes((u & 15).reshape(nb, 4, 2, 32), 4).reshape(nb, 128)
        high = [_pack_planes((u >> 4).reshape(nb, 8, 32), 1)] if name == "Q5_K" else []
        parts = [d, _f16_bytes(fields.dmin, nb), scales, *high, low]
    elif name == "Q6_K":
        low = _pack_planes((u & 15).reshape(nb, 2, 2, 64), 4).reshape(nb, 128)
        high = _pack_planes((u >> 4).reshape(nb, 2, 4, 32), 2).reshape(nb, 64)
        parts = [low, high, _ints(fields.scales, (nb, 16)).astype(np.int8).view(np.uint8), d]
    else:  # pragma: no cover - TYPES and this function list the same names
        raise ValueError(f"no byte layout for {name}")
    return np.concatenate(parts, axis=1).reshape(rows, t.row_bytes(cols))


def _split(data: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    return np.split(data, np.cumsum(sizes)[:-1], axis=1)


def unpack(type_name: str | GGUFType, data: np.ndarray | bytes, shape: tuple[int, int]) -> GGUFFields:
    """The fields of a tensor of ``shape`` (rows, cols) from its stored bytes."""
    t = gguf_type(type_name)
    rows, cols = shape
    if cols % t.block:
        raise ValueError(f"{t.name}: {cols} columns do not split into blocks of {t.block}")
    raw = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray)) else np.asarray(data, np.uint8)
    if raw.size != rows * t.row_bytes(cols):
        raise ValueError(f"{t.name} {rows}x{cols} takes {rows * t.row_bytes(cols)} bytes, got {raw.size}")
    blocks = raw.reshape(-1, t.block_bytes)
    nb, name = blocks.shape[0], t.name
    dmin = scales = mins = None
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        sizes = [2] + ([2] if not t.symmetric else []) + ([4] if name.startswith("Q5") else []) + [16]
        d, *rest, qs = _split(blocks, sizes)
        dmin = _f16(rest.pop(0), rows) if not t.symmetric else None
        u = _unpack_planes(qs, 4).reshape(nb, 32)
        if rest:
            u = u | (_unpack_high_bits(rest[0]) << 4)
    elif name == "Q8_0":
        d, qs = _split(blocks, [2, 32])
        u = qs.view(np.int8).astype(np.int16) + 128
    elif name == "Q2_K":
        sm, qs, d, m = _split(blocks, [16, 64, 2, 2])
        scales, mins, dmin = sm & 15, sm >> 4, _f16(m, rows)
        u = _unpack_planes(qs.reshape(nb, 2, 32), 2)
    elif name == "Q3_K":
        hmask, qs, sc, d = _split(blocks, [32, 64, 12, 2])
        u = _unpack_planes(qs.reshape(nb, 2, 32), 2).reshape(nb, 256) | (_unpack_planes(hmask, 1).reshape(nb, 256) << 2)
        scales = _unpack_scales_q3(sc).astype(np.int16) - 32
    elif name in ("Q4_K", "Q5_K"):
        high = [32] if name == "Q5_K" else []
        d, m, sc, *qh, qs = _split(blocks, [2, 2, 12, *high, 128])
        scales, mins = _unpack_scales_6bit(sc)
        dmin = _f16(m, rows)
        u = _unpack_planes(qs.reshape(nb, 4, 32), 4).reshape(nb, 256)
        if qh:
            u = u | (_unpack_planes(qh[0], 1).reshape(nb, 256) << 4)
    elif name == "Q6_K":
        ql, qh, sc, d = _split(blocks, [128, 64, 16, 2])
        low = _unpack_planes(ql.reshape(nb, 2, 64), 4).reshape(nb, 256)
        high = _unpack_planes(qh.reshape(nb, 2, 32), 2).reshape(nb, 256)
        u, scales = low | (high << 4), sc.view(np.int8)
    else:  # pragma: no cover
        raise ValueError(f"no byte layout for {name}")

    def ints(x):
        return None if x is None else torch.from_numpy(np.ascontiguousarray(x).astype(np.int8).reshape(rows, -1))

    codes = torch.from_numpy((u.reshape(rows, cols).astype(np.int16) + t.code_range[0]).astype(np.int8))
    return GGUFFields(t, codes, _f16(d, rows), dmin, ints(scales), ints(mins))
