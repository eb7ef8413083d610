"""Affine quantization math: the one place that decides scales, zero points and rounding.

Every method (RTN, GPTQ, AWQ), the checkpoint writer, the KV quantizers and the
kernel references call these functions. Conventions follow compressed-tensors so
that stored integers mean the same thing to vLLM and transformers:

* integers are signed: ``q`` in ``[-2**(bits-1), 2**(bits-1) - 1]``;
* ``x ≈ (q - zero) * scale``; symmetric schemes have no zero (it is 0);
* groups run along the last dimension: ``group_size`` consecutive elements share
  one scale; ``group_size=-1`` means one group for the whole row (per channel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (2, 3, 4, 8)


@dataclass(frozen=True)
class QuantScheme:
    """How one tensor is quantized: bit width, group length and symmetry."""

    bits: int = 4
    group_size: int = 128
    symmetric: bool = False
    # GPTQ's act-order as compressed-tensors names it: None (columns in order), "weight"
    # (quantized in activation order, groups kept contiguous: no runtime cost) or "group"
    # (groups follow activation order: a per-column group index, g_idx, at runtime).
    actorder: str | None = None

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.group_size != -1 and self.group_size < 1:
            raise ValueError(f"group_size must be positive or -1 (per channel), got {self.group_size}")
        if self.actorder not in (None, "weight", "group"):
            raise ValueError(f"actorder must be None, 'weight' or 'group', got {self.actorder!r}")

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def group_len(self, columns: int) -> int:
        """Elements per group for a row of ``columns`` elements."""
        return columns if self.group_size == -1 else self.group_size

    def num_groups(self, columns: int) -> int:
        g = self.group_len(columns)
        if columns % g:
            raise ValueError(
                f"{columns} columns do not split into groups of {g}; "
                "pick a scheme with quant.affine.fit_group_size first"
            )
        return columns // g

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        order = f" actorder={self.actorder}" if self.actorder else ""
        return f"w{self.bits} {group} {'sym' if self.symmetric else 'asym'}{order}"


def fit_group_size(columns: int, group_size: int, min_group: int = 32) -> int:
    """The group length to use for a row of ``columns`` elements.

    The interchange format (compressed-tensors) cannot store a ragged last group,
    so a width that ``group_size`` does not divide gets the largest divisor of the
    width below ``group_size`` (smaller groups: at least as accurate, a few more
    scale bytes). If that divisor would be tiny, fall back to one group per row.
    """
    if group_size == -1 or columns % group_size == 0:
        return group_size
    for g in range(min(group_size, columns), min_group - 1, -1):
        if columns % g == 0:
            return g
    return -1


def _grouped(x: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """View ``[..., K]`` as ``[..., K // g, g]``."""
    g = scheme.group_len(x.shape[-1])
    return x.unflatten(-1, (scheme.num_groups(x.shape[-1]), g))


def choose_qparams(
    x: torch.Tensor,
    scheme: QuantScheme,
    clip_ratio: float | torch.Tensor = 1.0,
    scale_dtype: torch.dtype | None = None,
    float_zero: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min/max scales (and zero points) per group of the last dimension.

    Returns ``scale`` of shape ``[..., K // g]`` in ``scale_dtype`` (default
    ``x.dtype``: pass the dtype the checkpoint will store, so rounding happens
    against the scale that is actually saved) and ``zero`` as int8 of the same
    shape, or ``None`` for symmetric schemes. ``clip_ratio`` (scalar, or
    broadcastable to the scale) shrinks the range; search methods pass values
    below 1. An asymmetric integer grid also takes a pair ``(lo_ratio, hi_ratio)``
    that shrinks the two ends apart (learned rounding tunes them separately).

    ``float_zero`` (KV caches, as KIVI): the grid spans the group's own min..max
    even when it lies far from zero (key channels carry large offsets), and the
    zero point is an unrounded float in ``scale_dtype``; ``clip_ratio`` then shrinks
    the range about its centre, not towards zero. Weights keep integer zero points,
    the only kind the checkpoint format stores.
    """
    xg = _grouped(x.float(), scheme)
    dtype = scale_dtype or x.dtype
    lo_ratio, hi_ratio = clip_ratio if isinstance(clip_ratio, tuple) else (clip_ratio, clip_ratio)
    if isinstance(clip_ratio, tuple) and (scheme.symmetric or float_zero):
        raise ValueError("a (lo, hi) clip_ratio pair needs an asymmetric integer grid; pass one ratio")
    eps = torch.finfo(dtype).tiny  # an all-zero group still gets a scale the stored dtype can hold
    if scheme.symmetric:
        amax = xg.abs().amax(dim=-1) * clip_ratio
        # Use the whole signed range like compressed-tensors: amax maps to (qmax - qmin) / 2.
        scale = (amax / ((scheme.qmax - scheme.qmin) / 2)).clamp_min(eps)
        return scale.to(dtype), None
    lo, hi = xg.amin(dim=-1), xg.amax(dim=-1)
    if float_zero:
        # A floor on the scale keeps |zero| = |lo| / scale below 2**14, so a constant group
        # still gets a zero point that float16 can hold.
        eps = torch.maximum(torch.maximum(lo.abs(), hi.abs()) * 2.0**-14, torch.tensor(eps))
    else:
        # Keep zero inside the range so it is exactly representable (padding, ReLU zeros)
        # and the zero point always fits the signed integer range.
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    if not float_zero:
        lo, hi = lo * lo_ratio, hi * hi_ratio
    elif clip_ratio != 1.0:  # about the centre, in the float32 steps the KV kernels' quantize-on-write takes
        mid, half = (lo + hi) * 0.5, (hi - lo) * (0.5 * clip_ratio)
        lo, hi = mid - half, mid + half
    scale = ((hi - lo) / (scheme.qmax - scheme.qmin)).clamp_min(eps).to(dtype)
    zero = scheme.qmin - lo / scale.float()
    if float_zero:
        return scale, zero.to(dtype)
    return scale, torch.round(zero).clamp(scheme.qmin, scheme.qmax).to(torch.int8)


def clip_search(
    x: torch.Tensor,
    scheme: QuantScheme,
    scale_dtype: torch.dtype | None = None,
    steps: int = 20,
    max_shrink: float = 0.2,
    norm: float = 2.4,
) -> torch.Tensor:
    """Each group's range ratio in ``[1 - max_shrink, 1]`` (``steps`` of them tried, the
    largest first) that minimizes ``sum |x - fake_quantize(x)| ** norm``: clipping a few
    outliers buys a finer grid for everything else. Shape ``[..., K // g]``, float32."""
    best_err = best_ratio = None
    for ratio in torch.linspace(1.0, 1.0 - max_shrink, steps).tolist():
        scale, zero = choose_qparams(x, scheme, ratio, scale_dtype)
        err = (dequantize(quantize(x, scale, zero, scheme), scale, zero, scheme, torch.float32) - x.float())
        err = _grouped(err.abs().pow(norm), scheme).sum(-1)
        if best_err is None:
            best_err, best_ratio = err, torch.full_like(err, ratio)
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, ratio, best_ratio)
    return best_ratio


def choose_qparams_mse(x: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype | None = None,
                       **search) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like :func:`choose_qparams`, with each group's range shrunk by :func:`clip_search`'s ratio
    (``search``: its ``steps``, ``max_shrink``, ``norm``)."""
    return choose_qparams(x, scheme, clip_search(x, scheme, scale_dtype, **search), scale_dtype)


def to_grid(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme,
            offset: torch.Tensor | None = None) -> torch.Tensor:
    """Elementwise rounding onto the integer grid (float result); shapes broadcast. ``offset``
    (learned rounding, in grid steps) is added before rounding: 0.3 turns 1.4 into 2, not 1."""
    q = x.float() / scale.float()
    if offset is not None:
        q = q + offset.float()
    if zero is not None:
        q = q + zero.float()
    return torch.round(q).clamp(scheme.qmin, scheme.qmax)


def from_grid(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Elementwise ``(q - zero) * scale`` in float32; shapes broadcast. ``out`` (any dtype and
    strides, e.g. a view of a larger buffer): the result is written there, rounded once from
    float32 as ``.to(out.dtype)`` rounds (the KV cache dequantizes into its read buffer)."""
    # integer codes promote to float32 in the subtraction itself: the same values, one pass fewer
    q = q.float() if zero is None else torch.sub(q, zero.float())
    return torch.mul(q, scale.float(), out=out)


def quantize(
    x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round ``x`` onto the integer grid: int8 of the same shape as ``x``; ``offset`` (same shape
    as ``x``, in grid steps) is added before rounding (:func:`to_grid`)."""
    zero = None if zero is None else zero.unsqueeze(-1)
    offset = None if offset is None else _grouped(offset, scheme)
    q = to_grid(_grouped(x, scheme), scale.unsqueeze(-1), zero, scheme, offset)
    return q.flatten(-2).to(torch.int8)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    scheme: QuantScheme,
    dtype: torch.dtype | None = None,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Integers back to floats: ``(q - zero) * scale`` per group.

    ``g_idx`` (act-order checkpoints) gives each input column's group when
    columns of a group are not contiguous.
    """
    if g_idx is not None:
        zero = None if zero is None else zero[..., g_idx]
        x = from_grid(q, scale[..., g_idx], zero)
    else:
        zero = None if zero is None else zero.unsqueeze(-1)
        x = from_grid(_grouped(q, scheme), scale.unsqueeze(-1), zero).flatten(-2)
    return x.to(dtype or scale.dtype)


def fake_quantize(x: torch.Tensor, scheme: QuantScheme, clip_ratio=1.0) -> torch.Tensor:
    """Quantize then dequantize with min/max qparams (what RTN does to a weight)."""
    scale, zero = choose_qparams(x, scheme, clip_ratio)
    return dequantize(quantize(x, scale, zero, scheme), scale, zero, scheme, x.dtype)
