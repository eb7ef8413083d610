"""Calibrated rounding fitted to a GGUF type's own grid (llama.cpp's k-quants and 32-blocks).

A GGUF type fixes how a row of weights is stored: blocks of 32 with one fp16 scale (Q4_0,
Q5_0, Q8_0; Q4_1/Q5_1 also an fp16 offset), or super-blocks of 256 whose sub-blocks of 16 or 32
carry a scale (and a min) that is itself an integer times the super-block's fp16 ``d`` (and
``dmin``). Rounding each weight after the fact onto that grid throws away what GPTQ learnt, so
here the grid comes first and the codes second:

1. :func:`fit_grid` chooses every sub-block's scale and offset (a weighted search like
   llama.cpp's ``make_qkx3_quants`` / ``make_qx_quants``, the weights being the calibration
   inputs' energy per input channel, ``diag(H)``, as llama.cpp uses an importance matrix), then
   quantizes the sub-block scales to the type's integers with a search over the super-block's
   ``d`` / ``dmin`` against the weighted error of the whole super-block;
2. the codes are rounded on that fixed grid: to nearest (:meth:`Grid.round`), or by GPTQ with
   error feedback through the inverse Hessian (:func:`quant.gptq.gptq_on_grid`).

Every value the result dequantizes to is computed as llama.cpp computes it (fp16 ``d`` times
the integer sub-block scale, in float32), so what the calibration pass propagates to the next
layer is what llama.cpp will run. The fields (:class:`FittedTensor`) are llama.cpp's block
structs unpacked: codes as unsigned integers, sub-block scales as integers, ``d``/``dmin`` fp16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.gguf import GGUFFields, GGUFType, dequantize, gguf_type


def _fp16(x: torch.Tensor) -> torch.Tensor:
    """What an fp16 field holds, back in float32 (saturating: fp16's largest finite value)."""
    return x.clamp(-65504.0, 65504.0).half().float()


def _group(t: GGUFType) -> int:
    """Weights that share one scale (and offset)."""
    return t.sub_block or t.block


def round_linear(weight: torch.Tensor, scheme: "GridScheme", H: torch.Tensor | None, gptq_config=None,
                 name: str = "layer") -> "FittedWeight":
    """The methods' seam: GPTQ on the fitted grid when given ``gptq_config`` (and H), else nearest
    rounding on a grid searched with ``diag(H)`` (without H: llama.cpp's data-free weights)."""
    if gptq_config is not None and H is not None:
        return round_gptq(weight, scheme.type_name, H, gptq_config, name)
    return round_to_nearest(weight, scheme.type_name, None if H is None else torch.diagonal(H))


@dataclass
class FittedWeight:
    """A weight as GGUF ``fields``; what the calibration pass carries on to the next layer is
    :meth:`dequantize`, llama.cpp's own arithmetic on those fields."""

    fields: GGUFFields

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.fields).to(dtype or torch.float32)

    def describe(self) -> str:
        return self.fields.type.name


@dataclass
class Grid:
    """A fixed grid for a weight [out, in]: in group j (the type's sub-block, or block), unsigned
    code ``u`` in ``[0, levels)`` means ``scale[:, j] * u + offset[:, j]``; the stored code is
    ``u + code_range[0]``."""

    type: GGUFType
    scale: torch.Tensor  # [out, in / group] float32
    offset: torch.Tensor  # [out, in / group] float32
    fields: GGUFFields  # d, dmin, scales, mins as stored (codes None until rounded)

    @property
    def levels(self) -> int:
        lo, hi = self.type.code_range
        return hi - lo + 1

    def _expand(self, t: torch.Tensor, columns: slice | None) -> torch.Tensor:
        g = _group(self.type)
        if columns is None:
            return t.repeat_interleave(g, dim=1)
        return t[:, torch.arange(columns.start, columns.stop) // g]

    def value(self, u: torch.Tensor, columns: slice | None = None) -> torch.Tensor:
        return u * self._expand(self.scale, columns) + self._expand(self.offset, columns)

    def round(self, w: torch.Tensor, columns: slice | None = None) -> torch.Tensor:
        """Nearest unsigned codes of ``w`` (all columns, or the slice ``columns`` of them), as float."""
        s, o = self._expand(self.scale, columns), self._expand(self.offset, columns)
        safe = torch.where(s == 0, torch.ones_like(s), s)
        u = torch.round((w.float() - o) / safe).clamp(0, self.levels - 1)
        return torch.where(s == 0, torch.zeros_like(u), u)

    def with_codes(self, u: torch.Tensor) -> FittedWeight:
        f = self.fields
        codes = (u + self.type.code_range[0]).to(torch.int8)
        return FittedWeight(GGUFFields(f.type, codes, f.d, f.dmin, f.scales, f.mins).check())

    @classmethod
    def from_fields(cls, f: GGUFFields) -> "Grid":
        t = f.type
        per_block = t.block // _group(t)
        d = f.d.float().repeat_interleave(per_block, dim=1)
        scale = d * f.scales.float() if t.k_quant else d
        if t.symmetric:
            offset = scale * t.code_range[0]
        elif t.k_quant:
            offset = -f.dmin.float().repeat_interleave(per_block, dim=1) * f.mins.float()
        else:  # Q4_1/Q5_1: dmin holds the added m
            offset = f.dmin.float()
        return cls(t, scale, offset, f)


# ---- step 1: each sub-block's own scale and offset (float), by a weighted search ----

def _fit_min(x: torch.Tensor, w: torch.Tensor, nmax: int, clamp_min: bool, steps: int = 18,
             rmin: float = -0.9, rdelta: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x ≈ s*q + o`` for rows of ``x`` [n, g], q in [0, nmax]: llama.cpp's ``make_qkx3_quants``
    vectorized: candidate inverse scales around nmax/(max - min), each refit by weighted least
    squares, the best kept. ``clamp_min``: o <= 0 (a k-quant stores -o as an unsigned min)."""
    lo = x.amin(1, keepdim=True)
    lo = lo.clamp(max=0) if clamp_min else lo
    span = (x.amax(1, keepdim=True) - lo).clamp_min(1e-30)
    shifted, wx = x - lo, w * x
    sw, swx, swx2 = w.sum(1, keepdim=True), wx.sum(1, keepdim=True), (wx * x).sum(1, keepdim=True)
    best_s, best_o = span / nmax, lo
    best_err = _err(x, w, best_s, best_o, torch.round(shifted / best_s).clamp(0, nmax))
    for k in range(steps + 1):
        q = torch.round(shifted * ((nmax + rmin + rdelta * k) / span)).clamp_(0, nmax)
        wq = w * q
        swl, swl2, swlx = wq.sum(1, keepdim=True), (wq * q).sum(1, keepdim=True), (q * wx).sum(1, keepdim=True)
        D = sw * swl2 - swl * swl
        ok = D > 0
        Ds = torch.where(ok, D, torch.ones_like(D))
        s = (sw * swlx - swx * swl) / Ds
        o = (swl2 * swx - swl * swlx) / Ds
        if clamp_min:
            pos = o > 0
            s = torch.where(pos, swlx / swl2.clamp_min(1e-30), s)
            o = torch.where(pos, torch.zeros_like(o), o)
        # at a least-squares fit the residual is orthogonal to q and (unless o was clamped) to 1
        err = swx2 - s * swlx - o * swx
        better = ok & (err < best_err)
        best_err, best_s, best_o = torch.where(better, err, best_err), torch.where(better, s, best_s), torch.where(better, o, best_o)
    return best_s.squeeze(1), best_o.squeeze(1)


def _fit_sym(x: torch.Tensor, w: torch.Tensor, nmax: int, steps: int = 9) -> torch.Tensor:
    """``x ≈ s*l``, l in [-nmax, nmax - 1], per row of ``x`` [n, g]: llama.cpp's ``make_qx_quants``
    (the largest |x| maps to -nmax at the start, so the scale may be negative), vectorized."""
    idx = x.abs().argmax(1, keepdim=True)
    amax = x.gather(1, idx)
    amax = torch.where(amax == 0, torch.full_like(amax, 1e-30), amax)
    best_s, best_score = torch.zeros_like(amax), torch.full_like(amax, -1.0)
    for k in range(-steps, steps + 1):
        l = torch.round(x * (-(nmax + 0.1 * k) / amax)).clamp(-nmax, nmax - 1)
        sumlx, suml2 = (w * x * l).sum(1, keepdim=True), (w * l * l).sum(1, keepdim=True)
        score = torch.where(suml2 > 0, sumlx * sumlx / suml2.clamp_min(1e-30), torch.zeros_like(sumlx))
        better = score > best_score
        best_score = torch.where(better, score, best_score)
        best_s = torch.where(better, sumlx / suml2.clamp_min(1e-30), best_s)
    return best_s.squeeze(1)


def _err(x, w, s, o, q):
    return (w * (s * q + o - x) ** 2).sum(1, keepdim=True)


def importance(weight: torch.Tensor, t: GGUFType, h_diag: torch.Tensor | None) -> torch.Tensor:
    """Per-weight importance [out, in] for the grid search: llama.cpp's ``qw * sqrt(sigma2 + x²)``
    (sigma2: the mean square of the block's row segment, twice it for k-quants) with
    ``qw = diag(H)``, the inputs' energy per channel (what llama-imatrix collects); without H,
    llama.cpp's own data-free choice ``sqrt(sigma2) + |x|``."""
    x = weight.float()
    seg = x.unflatten(1, (-1, t.block))
    sigma2 = (2.0 if t.k_quant else 1.0) * seg.pow(2).mean(-1, keepdim=True)
    if h_diag is None:
        return (sigma2.sqrt() + seg.abs()).flatten(1)
    qw = h_diag.float().clamp_min(0).unflatten(0, (-1, t.block))
    return (qw * (sigma2 + seg * seg).sqrt()).flatten(1)


# ---- step 2: a k-quant's sub-block scales to integers under an fp16 super-scale ----

SUPER_FACTORS = (1.0, 0.95, 1.05, 0.9, 0.85)  # tried for d (and dmin), times max/levels


def _quantize_levels(v: torch.Tensor, top: torch.Tensor, levels: tuple[int, int], factor: float):
    """fp16 super-scale ``d`` [out, nb] and the integers of ``v`` [out, nb, nsub] under it: ``top``
    (the largest value, its sign kept for signed levels) maps to ``factor`` times the end of
    ``levels`` (the negative end for signed levels, as llama.cpp does)."""
    lo, hi = levels
    d = _fp16(top * factor / (hi if lo == 0 else lo))
    safe = torch.where(d == 0, torch.ones_like(d), d)
    return d, torch.round(v / safe.unsqueeze(-1)).clamp(lo, hi)


def _block_error(x, w, t: GGUFType, scale, offset, levels: int) -> torch.Tensor:
    """Weighted error of nearest rounding on (scale, offset) [out, nb, nsub], per super-block [out, nb]."""
    xs = x.unflatten(1, (scale.shape[1], scale.shape[2], t.sub_block))
    ws = w.unflatten(1, xs.shape[1:])
    s, o = scale.unsqueeze(-1), offset.unsqueeze(-1)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    u = torch.where(s == 0, torch.zeros_like(xs), torch.round((xs - o) / safe).clamp(0, levels - 1))
    return (ws * (s * u + o - xs) ** 2).sum((-1, -2))


def _search_super(x, w, t: GGUFType, v, top, limits, levels, error_of):
    """The super-scale for ``v`` [out, nb, nsub] among :data:`SUPER_FACTORS` with the least
    ``error_of(d, ints)`` per super-block: (d fp16 [out, nb], ints [out, nb, nsub])."""
    best = None
    for f in SUPER_FACTORS:
        d, ints = _quantize_levels(v, top, limits, f)
        err = error_of(d, ints)
        if best is None:
            best = (err, d, ints)
            continue
        better = err < best[0]
        best = (torch.where(better, err, best[0]), torch.where(better, d, best[1]),
                torch.where(better.unsqueeze(-1), ints, best[2]))
    return best[1], best[2]


def _k_quant_fields(x, w, t: GGUFType, s, o, levels: int) -> GGUFFields:
    """d (and dmin), integer scales (and mins) of a k-quant, each super-scale searched for the
    least weighted error of its super-block (d first, with mins at their plain quantization; then
    dmin with d fixed)."""
    if t.symmetric:
        top = s.gather(2, s.abs().argmax(2, keepdim=True)).squeeze(2)
        d, sc = _search_super(x, w, t, s, top, t.scale_range, levels,
                              lambda d, sc: _block_error(x, w, t, d.unsqueeze(-1) * sc,
                                                         d.unsqueeze(-1) * sc * t.code_range[0], levels))
        return GGUFFields(t, None, d.half(), scales=sc.flatten(1).to(torch.int8))
    m = (-o).clamp_min(0)
    dmin, mins = _quantize_levels(m, m.amax(2), t.min_range, 1.0)
    d, sc = _search_super(x, w, t, s, s.amax(2), t.scale_range, levels,
                          lambda d, sc: _block_error(x, w, t, d.unsqueeze(-1) * sc, -dmin.unsqueeze(-1) * mins, levels))
    scale = d.unsqueeze(-1) * sc
    dmin, mins = _search_super(x, w, t, m, m.amax(2), t.min_range, levels,
                               lambda dm, mn: _block_error(x, w, t, scale, -dm.unsqueeze(-1) * mn, levels))
    return GGUFFields(t, None, d.half(), dmin.half(), sc.flatten(1).to(torch.int8), mins.flatten(1).to(torch.int8))


def fit_grid(weight: torch.Tensor, type_name: str | GGUFType, h_diag: torch.Tensor | None = None) -> Grid:
    """The grid of ``weight`` [out, in] under a GGUF type, chosen before any code is rounded;
    ``h_diag``: the calibration inputs' ``diag(H)`` [in] (None: no calibration data)."""
    t = gguf_type(type_name)
    out, columns = weight.shape
    if columns % t.block:
        raise ValueError(f"{t.name} stores rows in blocks of {t.block}; a row of {columns} does not split "
                         f"into them (llama.cpp falls back to a 32-block type: quant.gguf.fallback)")
    x = weight.detach().float()
    w = importance(x, t, h_diag)
    g = _group(t)
    lo, hi = t.code_range
    levels = hi - lo + 1
    xs, ws = x.reshape(-1, g), w.reshape(-1, g)
    if t.symmetric:
        s = _fit_sym(xs, ws, -lo) if t.name != "Q8_0" else xs.abs().amax(1) / 127  # llama.cpp's Q8_0: amax/127
        o = s * lo
    else:
        s, o = _fit_min(xs, ws, levels - 1, clamp_min=t.k_quant)
    per_block = t.block // g
    s, o = s.reshape(out, -1, per_block), o.reshape(out, -1, per_block)
    if t.k_quant:
        fields = _k_quant_fields(x, w, t, s, o, levels)
    else:  # one fp16 scale (and offset) per 32-block
        fields = GGUFFields(t, None, s.flatten(1).half(), None if t.symmetric else o.flatten(1).half())
    return Grid.from_fields(fields)


def round_to_nearest(weight: torch.Tensor, type_name: str | GGUFType, h_diag: torch.Tensor | None = None) -> FittedWeight:
    """``weight`` on its fitted grid, each code rounded to nearest (llama-quantize's way)."""
    grid = fit_grid(weight, type_name, h_diag)
    return grid.with_codes(grid.round(weight))


def round_gptq(weight: torch.Tensor, type_name: str | GGUFType, H: torch.Tensor, config=None,
               name: str = "layer") -> FittedWeight:
    """``weight`` on its fitted grid (searched with ``diag(H)``), codes rounded by GPTQ."""
    from quant.gptq import GPTQConfig, gptq_on_grid

    grid = fit_grid(weight, type_name, torch.diagonal(H))
    return grid.with_codes(gptq_on_grid(weight, H, grid, config or GPTQConfig(), name))


def weighted_loss(weight: torch.Tensor, approx: torch.Tensor, H: torch.Tensor) -> float:
    """``tr(ΔW H ΔWᵀ)``: the calibration loss of a rounding at the Linear's output."""
    D = weight.float() - approx.float()
    return float(torch.einsum("oi,ij,oj->", D, H.float(), D))
