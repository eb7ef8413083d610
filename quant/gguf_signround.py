"""SignRound on a GGUF type's own grid: the rounding offsets and ranges that
``quant.learned_rounding`` learns, learnt through the type's dequantization.

``learn_rounding`` runs as for lowbit's affine grids (signed gradient descent on each decoder
layer's output); what it learns per Linear is held here (:class:`GridRounding`):

- the grid starts as the type's fitted one (``quant.gguf_fit.fit_grid``, searched with the
  calibration inputs' energy per channel, as the GPTQ path's is; ``init_range: minmax``: the
  plain min/max fit ``quant.gguf.fit_rtn``, AutoRound's start);
- ``offset`` V per weight in ``[-0.5, 0.5]`` code steps, added before rounding, as SignRound's;
- a ratio per sub-block (per block for the 32-block types) on its scale, and one on its min
  (types with an offset), in ``[min_range, 2 - min_range]``: the fitted grid is already a
  searched one, so the ratios may widen it as well as shrink it; they move in smaller steps than
  the offsets (:data:`RANGE_STEP`). A k-quant's scale is
  ``d * sc``: the ratio moves the integer ``sc`` (rounded, clamped to the type's range, the
  super-block's fp16 ``d`` and ``dmin`` kept); a 32-block type's ``d`` (and ``m``) is rounded to
  fp16. Every rounding passes its gradient straight through.

So the weight each step sees is the one llama.cpp would compute from the fields, and the
result (:meth:`GridRounding.result`) is those fields (``quant.gguf_fit.FittedWeight``).
"""

from __future__ import annotations

import torch

from quant.gguf import GGUFFields, fit_rtn, gguf_type
from quant.gguf_fit import FittedWeight, Grid, fit_grid
from quant.sequential import LayerInputs


def _ste(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """``rounded`` forward, ``x``'s gradient backward."""
    return x + (rounded - x).detach()


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return _ste(x, x.detach().clamp(-65504.0, 65504.0).half().float())


# how far one SignSGD step moves a range ratio, relative to an offset's step. The grid starts at a
# searched optimum, where the ratios' gradient signs flip from step to step: at the offsets' step
# (1) every k-quant sub-block scale moved by about one integer per step and no step beat the start
# (one layer of the tiny Llama, 60 steps, held-out relative output error Q4_K 0.0137 / Q2_K 0.213,
# offsets alone 0.0094 / 0.115); at 0.1: 0.0109 / 0.116; at 0.02: 0.0089 / 0.114
RANGE_STEP = 0.02


class GridRounding:
    """One Linear's learned parameters on its GGUF grid (the interface ``learn_rounding`` drives)."""

    def __init__(self, weight: torch.Tensor, type_name: str, config, h_diag: torch.Tensor | None = None):
        self.weight = weight.detach().float()
        self.type = gguf_type(type_name)
        if config.init_range == "minmax":
            start = Grid.from_fields(fit_rtn(self.weight, self.type))
        else:
            start = fit_grid(self.weight, self.type, h_diag)
        self.start = start.fields
        self.group = self.type.sub_block or self.type.block
        self.offset = torch.zeros_like(self.weight, requires_grad=True)
        groups = self.weight.shape[1] // self.group
        self.ratios = [torch.ones(self.weight.shape[0], groups, requires_grad=True)
                       for _ in range(1 if self.type.symmetric else 2)]

    def params(self) -> list[torch.Tensor]:
        return [self.offset, *self.ratios]

    def _per_group(self, t: torch.Tensor) -> torch.Tensor:
        """A per-block field [out, blocks] repeated over its sub-blocks: [out, groups]."""
        return t.float().repeat_interleave(self.type.block // self.group, dim=1)

    @staticmethod
    def _effective(ratio: torch.Tensor) -> torch.Tensor:
        """The factor a learned ratio puts on a scale (or min): 1 at the start, moving RANGE_STEP as fast."""
        return 1 + (ratio - 1) * RANGE_STEP

    def _integers(self, start: torch.Tensor, ratio: torch.Tensor, limits) -> torch.Tensor:
        v = start.float() * self._effective(ratio)
        return _ste(v, v.detach().round().clamp(*limits))

    def scale_offset(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's step and offset [out, groups], as the fields the ratios give would hold them."""
        t, f = self.type, self.start
        if t.k_quant:
            scale = self._per_group(f.d) * self._integers(f.scales, self.ratios[0], t.scale_range)
            if t.symmetric:
                return scale, scale * t.code_range[0]
            return scale, -self._per_group(f.dmin) * self._integers(f.mins, self.ratios[1], t.min_range)
        scale = _fp16(f.d.float() * self._effective(self.ratios[0]))
        if t.symmetric:
            return scale, scale * t.code_range[0]
        return scale, _fp16(f.dmin.float() * self._effective(self.ratios[1]))

    def _codes(self, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """Unsigned codes [out, in] with the learned offsets, rounding's gradient passed straight through."""
        s, o = (x.repeat_interleave(self.group, dim=1) for x in (scale, offset))
        safe = torch.where(s.detach() == 0, torch.ones_like(s), s)
        u = (self.weight - o) / safe + self.offset
        lo, hi = self.type.code_range
        return _ste(u, u.detach().round().clamp(0, hi - lo)) * (s.detach() != 0)

    def fake_quantized(self) -> torch.Tensor:
        scale, offset = self.scale_offset()
        u = self._codes(scale, offset)
        return u * scale.repeat_interleave(self.group, 1) + offset.repeat_interleave(self.group, 1)

    def clamp_(self, min_range: float) -> None:
        with torch.no_grad():
            self.offset.clamp_(-0.5, 0.5)
            for r in self.ratios:
                r.clamp_(1 - (1 - min_range) / RANGE_STEP, 1 + (1 - min_range) / RANGE_STEP)  # factor in [m, 2 - m]

    def fields(self) -> GGUFFields:
        """The grid's stored fields under the learned ratios (codes not yet set)."""
        t, f = self.type, self.start
        with torch.no_grad():
            if t.k_quant:
                sc = self._integers(f.scales, self.ratios[0], t.scale_range).to(torch.int8)
                mins = None if t.symmetric else self._integers(f.mins, self.ratios[1], t.min_range).to(torch.int8)
                return GGUFFields(t, None, f.d, f.dmin, sc, mins)
            scale, offset = self.scale_offset()
            return GGUFFields(t, None, scale.half(), None if t.symmetric else offset.half())

    def result(self) -> FittedWeight:
        grid = Grid.from_fields(self.fields())
        with torch.no_grad():
            return grid.with_codes(self._codes(grid.scale, grid.offset))


def input_energy(layer: torch.nn.Module, inputs: LayerInputs, names) -> dict[str, torch.Tensor]:
    """The mean square of each input channel of the named Linears over the calibration windows
    (``diag(H)`` up to a factor, which the grid search does not see)."""
    sums: dict[str, torch.Tensor] = {}
    rows: dict[str, int] = {}

    def hook(name):
        def fn(module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            sums[name] = sums.get(name, 0) + x.pow(2).sum(0)
            rows[name] = rows.get(name, 0) + x.shape[0]

        return fn

    handles = [layer.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    try:
        with torch.no_grad():
            for h, kw in zip(inputs.hidden, inputs.kwargs):
                layer(h, **kw)
    finally:
        for handle in handles:
            handle.remove()
    return {n: sums[n] / rows[n] for n in sums}


def grid_parameters(layer: torch.nn.Module, inputs: LayerInputs, plan: dict):
    """``learn_rounding``'s ``parameters``: each Linear's :class:`GridRounding` on its planned type,
    its grid searched with the energy of the inputs that reach it in this layer."""
    energy = input_energy(layer, inputs, list(plan))

    def make(name: str, weight: torch.Tensor, scheme, scale_dtype, config) -> GridRounding:
        return GridRounding(weight, scheme.type_name, config, energy.get(name))

    return make
