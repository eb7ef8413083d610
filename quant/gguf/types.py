"""The GGUF weight types lowbit writes, what each stores, and its dequantization and plain RTN fit.

A tensor of a GGUF type is described by its **fields**, exactly the numbers the file stores
(``GGUFFields``): integer codes ``[rows, cols]``, per-sub-block integer scales and mins
(k-quants), and per-block float16 ``d`` / ``dmin``. Each type dequantizes as

* ``Q4_0``, ``Q5_0``, ``Q8_0`` (symmetric, one ``d`` per 32):  ``w = d * q``
* ``Q4_1``, ``Q5_1`` (one ``d`` and one added offset ``m`` per 32; ``m`` is held in ``dmin``): ``w = d * q + m``
* ``Q3_K``, ``Q6_K`` (symmetric k-quants):            ``w = (d * sc) * q``
* ``Q2_K``, ``Q4_K``, ``Q5_K`` (k-quants with mins):  ``w = (d * sc) * q - (dmin * mn)``

with ``d``/``dmin`` per super-block of 256 and ``sc``/``mn`` per sub-block (16 or 32), in
float32 in that order, as ggml does (so :func:`dequantize` matches ``gguf.quants`` bit for bit).
Codes are held as the integers multiplied (Q4_0's in ``[-8, 7]``, not the stored nibble); the
byte layouts are in ``quant/gguf/layout.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

QK_K = 256


@dataclass(frozen=True)
class GGUFType:
    """One quantized GGUF type: its block structure and the integer ranges of what it stores."""

    name: str
    block: int  # elements per block: one ``d`` (and ``dmin``) each
    sub_block: int | None  # elements per integer sub-block scale (k-quants); None: ``d`` alone
    code_range: tuple[int, int]  # the integers ``q`` multiplied, as stored
    scale_range: tuple[int, int] | None  # sub-block scales ``sc`` (k-quants)
    min_range: tuple[int, int] | None  # sub-block mins ``mn`` (asymmetric k-quants)
    symmetric: bool  # no offset (no ``dmin``)

    @property
    def ggml_type(self) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType[self.name]

    @property
    def block_bytes(self) -> int:
        return gguf.GGML_QUANT_SIZES[self.ggml_type][1]

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block

    @property
    def code_bits(self) -> int:
        lo, hi = self.code_range
        return (hi - lo).bit_length()

    @property
    def k_quant(self) -> bool:
        return self.sub_block is not None

    def row_bytes(self, cols: int) -> int:
        return cols // self.block * self.block_bytes


TYPES = {t.name: t for t in (
    GGUFType("Q4_0", 32, None, (-8, 7), None, None, True),
    GGUFType("Q4_1", 32, None, (0, 15), None, None, False),
    GGUFType("Q5_0", 32, None, (-16, 15), None, None, True),
    GGUFType("Q5_1", 32, None, (0, 31), None, None, False),
    GGUFType("Q8_0", 32, None, (-128, 127), None, None, True),
    GGUFType("Q2_K", QK_K, 16, (0, 3), (0, 15), (0, 15), False),
    GGUFType("Q3_K", QK_K, 16, (-4, 3), (-32, 31), None, True),
    GGUFType("Q4_K", QK_K, 32, (0, 15), (0, 63), (0, 63), False),
    GGUFType("Q5_K", QK_K, 32, (0, 31), (0, 63), (0, 63), False),
    GGUFType("Q6_K", QK_K, 16, (-32, 31), (-128, 127), None, True),
)}


# llama.cpp's tensor_type_fallback: a 256-block type on a row that does not split into 256s is
# written as this 32-block type instead (llama-quant.cpp)
SMALL_ROW_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def fallback(type_name: str | GGUFType, cols: int) -> GGUFType:
    """The type llama.cpp writes for a row of ``cols`` under ``type_name``: itself where its blocks tile
    the row, else its 32-block fallback; a ValueError where none fits."""
    t = gguf_type(type_name)
    if cols % t.block == 0:
        return t
    small = TYPES.get(SMALL_ROW_FALLBACK.get(t.name, ""))
    if small is None or cols % small.block:
        raise ValueError(f"a row of {cols} columns fits neither {t.name}'s blocks of {t.block} nor a 32-block "
                         "fallback; write it as F16")
    return small


def gguf_type(name: str | GGUFType) -> GGUFType:
    """The type of that name (case-insensitive), or a ValueError listing the ones lowbit writes."""
    if isinstance(name, GGUFType):
        return name
    found = TYPES.get(str(name).upper())
    if found is None:
        raise ValueError(f"unknown GGUF type {name!r}: lowbit writes {', '.join(TYPES)}")
    return found


@dataclass
class GGUFFields:
    """A tensor of a GGUF type as the file stores it (see the module docstring)."""

    type: GGUFType
    codes: torch.Tensor  # int8 [rows, cols]
    d: torch.Tensor  # float16 [rows, cols // block]
    dmin: torch.Tensor | None = None  # float16 [rows, cols // block]; Q4_1: the added offset m
    scales: torch.Tensor | None = None  # int8 [rows, cols // sub_block], k-quants
    mins: torch.Tensor | None = None  # int8 [rows, cols // sub_block], asymmetric k-quants

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def check(self) -> "GGUFFields":
        """Raise a ValueError naming the first field whose shape, dtype or range the type cannot store."""
        t, (rows, cols) = self.type, self.codes.shape
        _check_shape(t, cols)
        blocks, subs = (rows, cols // t.block), (rows, cols // (t.sub_block or t.block))
        wanted = {"codes": ((rows, cols), t.code_range), "d": (blocks, None),
                  "dmin": (blocks, None) if not t.symmetric else None,
                  "scales": (subs, t.scale_range) if t.k_quant else None,
                  "mins": (subs, t.min_range) if t.min_range else None}
        for name, want in wanted.items():
            value = getattr(self, name)
            if want is None:
                if value is not None:
                    raise ValueError(f"{t.name} stores no {name}, but the fields have one")
                continue
            if value is None:
                raise ValueError(f"{t.name} needs {name}, but the fields have none")
            shape, limits = want
            if tuple(value.shape) != shape:
                raise ValueError(f"{t.name} {name} must have shape {shape}, got {tuple(value.shape)}")
            if limits is None:
                if value.dtype != torch.float16:
                    raise ValueError(f"{t.name} {name} must be float16 (as stored), got {value.dtype}")
            elif value.numel() and (int(value.min()) < limits[0] or int(value.max()) > limits[1]):
                raise ValueError(f"{t.name} {name} must lie in {list(limits)}, got "
                                 f"[{int(value.min())}, {int(value.max())}]")
        return self


def _check_shape(t: GGUFType, cols: int) -> None:
    if cols % t.block:
        raise ValueError(f"{t.name} stores rows in blocks of {t.block}; a row of {cols} columns does not "
                         f"split into them (pick a type with smaller blocks, e.g. Q8_0/Q4_0 for 32, or F16)")


def _per_element(values: torch.Tensor, size: int) -> torch.Tensor:
    """``[rows, n]`` per-group values repeated over their ``size`` elements: ``[rows, n * size]``."""
    return values.float().repeat_interleave(size, dim=1)


def dequantize(fields: GGUFFields) -> torch.Tensor:
    """The float32 tensor the fields encode, computed as ggml computes it."""
    t = fields.type
    q = fields.codes.float()
    d = _per_element(fields.d, t.block)
    if t.k_quant:
        # ggml forms d * sc per sub-block in float32 first, then multiplies the code
        step = _per_element(fields.d.float().repeat_interleave(t.block // t.sub_block, 1) * fields.scales.float(),
                            t.sub_block)
        if t.symmetric:
            return step * q
        offset = _per_element(fields.dmin.float().repeat_interleave(t.block // t.sub_block, 1)
                              * fields.mins.float(), t.sub_block)
        return step * q - offset
    if t.symmetric:
        return d * q
    return d * q + _per_element(fields.dmin, t.block)


def _signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """The element of largest magnitude of each last-dimension row, with its sign."""
    return x.gather(-1, x.abs().argmax(-1, keepdim=True)).squeeze(-1)


def _safe_div(x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``x / step``, 0 where the step is 0 (an all-zero group)."""
    return torch.where(step == 0, torch.zeros_like(x), x / torch.where(step == 0, torch.ones_like(step), step))


def _fp16(x: torch.Tensor) -> torch.Tensor:
    """Round to float16 as stored, saturating instead of overflowing to inf."""
    return x.clamp(-65504, 65504).to(torch.float16)


def fit_rtn(weight: torch.Tensor, type_name: str | GGUFType) -> GGUFFields:
    """Round-to-nearest onto the type's grid, from each group's range alone (no search, no data).

    Flat types follow ggml's reference choice of ``d`` (Q4_0: the signed extreme maps to -8; Q8_0:
    the magnitude to 127; Q4_1: min..max). k-quants take each sub-block's scale (and min) the same
    way, then quantize those to the type's integer scales against one float16 ``d`` (``dmin``) per
    super-block. Codes are rounded against the stored (float16, integer-scaled) steps.
    """
    t = gguf_type(type_name)
    w = weight.detach().float()
    if w.dim() != 2:
        raise ValueError(f"a GGUF weight must be 2-D [rows, cols], got shape {tuple(w.shape)}")
    _check_shape(t, w.shape[1])
    rows, cols = w.shape
    qlo, qhi = t.code_range
    group = t.sub_block or t.block
    wg = w.view(rows, cols // group, group)
    if t.symmetric:
        step = _signed_absmax(wg) / qlo if t.name != "Q8_0" else wg.abs().amax(-1) / 127
        offset = None
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        if t.k_quant:  # ggml's k-quants keep the min at or below zero (mn >= 0)
            lo = lo.clamp(max=0)
        step, offset = (hi - lo) / qhi, lo
    fields = GGUFFields(t, codes=None, d=None)
    if t.k_quant:
        step, step_scale = _quantize_scales(step, t.scale_range, t.block // group, signed=t.symmetric)
        fields.d, fields.scales = step_scale
        if offset is not None:
            offset, min_scale = _quantize_scales(-offset, t.min_range, t.block // group, signed=False)
            fields.dmin, fields.mins = min_scale
            offset = -offset
    else:
        fields.d = _fp16(step)
        step = fields.d.float()
        if offset is not None:
            fields.dmin = _fp16(offset)
            offset = fields.dmin.float()
    shifted = wg if offset is None else wg - offset.unsqueeze(-1)
    codes = torch.round(_safe_div(shifted, step.unsqueeze(-1))).clamp(qlo, qhi)
    fields.codes = codes.view(rows, cols).to(torch.int8)
    return fields.check()


def _quantize_scales(values: torch.Tensor, limits: tuple[int, int], per_block: int, signed: bool):
    """Per-sub-block float steps ``[rows, subs]`` onto integers against one float16 super-block
    factor: returns (the steps as stored, d * sc in float32, as ggml forms them), (d, sc)."""
    rows, subs = values.shape
    vb = values.view(rows, subs // per_block, per_block)
    factor = _signed_absmax(vb) / limits[0] if signed else vb.amax(-1) / limits[1]
    d = _fp16(factor)
    ints = torch.round(_safe_div(vb, d.float().unsqueeze(-1))).clamp(*limits)
    stored = (d.float().unsqueeze(-1) * ints).view(rows, subs)
    return stored, (d, ints.view(rows, subs).to(torch.int8))
