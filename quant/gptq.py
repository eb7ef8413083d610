"""GPTQ: round columns one at a time and push each rounding error onto the
columns not yet rounded, weighted by the inverse Hessian of the layer's inputs
(Frantar et al., 2022), with lazy block updates.

``H = 2 Xᵀ X / n`` is accumulated by the sequential pipeline; this module only
decides integers and scales, through ``quant.affine``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from quant.affine import QuantScheme, choose_qparams, choose_qparams_mse, from_grid, to_grid
from quant.format import QuantizedWeight


@dataclass(frozen=True)
class GPTQConfig:
    # Act-order: columns by decreasing input energy. "weight" keeps groups contiguous (no
    # runtime cost), "group" stores g_idx, "none" keeps column order. The recipe's choice
    # becomes each layer's scheme.actorder, which is what gptq_quantize reads.
    actorder: str = "weight"
    block_size: int = 128
    # Fraction of the mean Hessian diagonal added to it. 0.03, between llm-compressor's 0.01 and the
    # 0.1 lowbit used before: on SmolLM2 W4 g64 with Austen calibration (BOS protocol, issue 17 §0,
    # bench/results/quality/gptq-factors-w4-*.json) 0.03 is level with llm-compressor on Persuasion (41.04
    # vs 41.01; 0.1: 41.73) and still beats RTN on Python source (10.82 vs 10.85), where 0.01 falls
    # behind it (11.24): a Hessian from one genre should not be trusted fully.
    dampening: float = 0.03
    mse_clip: bool = False  # search each group's range instead of min/max


def inverse_hessian_cholesky(H: torch.Tensor, dampening: float, name: str = "layer") -> torch.Tensor:
    """Upper Cholesky factor of ``(H + λI)⁻¹``; raises λ tenfold (with a warning) until it exists."""
    mean_diag = float(torch.diag(H).mean())
    damp = dampening
    for _ in range(6):
        Hd = H.clone()
        Hd.diagonal().add_(damp * mean_diag)
        L, info = torch.linalg.cholesky_ex(Hd)
        if info == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if info == 0:
                if damp != dampening:
                    warnings.warn(f"{name}: Hessian not positive definite; dampening raised to {damp:g}", stacklevel=2)
                return U
        damp *= 10
    raise ValueError(f"{name}: the Hessian stays singular even with dampening {damp / 10:g}; are its inputs all zero?")


def _group_qparams(w: torch.Tensor, scheme: QuantScheme, group: int, mse: bool, scale_dtype):
    """Qparams of ``w`` [out, k] in groups of ``group`` columns (-1: one group): [out, k / group]."""
    grouped = QuantScheme(scheme.bits, group, scheme.symmetric)
    if mse:
        return choose_qparams_mse(w, grouped, scale_dtype)
    return choose_qparams(w, grouped, scale_dtype=scale_dtype)


def gptq_quantize(
    weight: torch.Tensor,
    H: torch.Tensor,
    scheme: QuantScheme,
    config: GPTQConfig = GPTQConfig(),
    scale_dtype: torch.dtype | None = None,
    name: str = "layer",
) -> QuantizedWeight:
    """Quantize ``weight`` [out, in] given the input Hessian ``H`` [in, in].

    With act-order, columns are visited by decreasing ``diag(H)``. ``scheme.actorder``
    says how groups relate to that order: ``"weight"`` keeps groups contiguous in
    the stored order (their scales are fixed from the original weight up front, so
    no index is needed at inference); ``"group"`` forms groups in visiting order and
    returns ``g_idx``.
    """
    W, H, perm = _prepare(weight, H, scheme.actorder is not None)
    out_features, columns = W.shape
    scale_dtype = scale_dtype or weight.dtype
    g = scheme.group_len(columns)
    n_groups = columns // g

    act_order = scheme.actorder is not None
    static = act_order and scheme.actorder == "weight"
    if static:  # groups fixed in stored order before any error feedback: all of them in one call
        all_scales, all_zeros = _group_qparams(W[:, torch.argsort(perm)], scheme, g, config.mse_clip, scale_dtype)
        params = [(all_scales[:, i:i + 1], None if all_zeros is None else all_zeros[:, i:i + 1]) for i in range(n_groups)]
    scales = torch.empty(out_features, n_groups, dtype=scale_dtype)
    zeros = None if scheme.symmetric else torch.empty(out_features, n_groups, dtype=torch.int8)
    col_group = (perm // g if static else torch.arange(columns) // g).tolist()  # group of each visited column
    current = {"group": None}

    def round_column(i: int, w: torch.Tensor, upcoming) -> tuple[torch.Tensor, torch.Tensor]:
        if col_group[i] != current["group"]:  # entering another group: fetch (static) or choose its qparams
            grp = current["group"] = col_group[i]
            if static:
                group_scale, group_zero = params[grp]
            else:  # its scale sees the columns as updated so far
                group_scale, group_zero = _group_qparams(upcoming()[:, :g], scheme, -1, config.mse_clip, scale_dtype)
            scales[:, grp] = group_scale[:, 0]
            if zeros is not None:
                zeros[:, grp] = group_zero[:, 0]
            current["scale"] = group_scale.float()
            current["zero"] = None if group_zero is None else group_zero.float()
        q = to_grid(w, current["scale"], current["zero"], scheme)
        return q, from_grid(q, current["scale"], current["zero"])

    Q = _sweep(W, H, config, name, round_column)
    inverse = torch.argsort(perm)
    Q = Q[:, inverse]
    g_idx = None
    if act_order and scheme.actorder == "group":
        g_idx = (torch.arange(columns) // g)[inverse].to(torch.int32)
    return QuantizedWeight(Q.to(torch.int8), scales, zeros, scheme, g_idx)


def gptq_on_grid(weight: torch.Tensor, H: torch.Tensor, grid, config: GPTQConfig = GPTQConfig(),
                 name: str = "layer") -> torch.Tensor:
    """GPTQ's codes [out, in] (float) of ``weight`` on a grid fixed before any error feedback, such
    as a GGUF type's super-block grid (``quant.gguf_fit.Grid``): ``grid.round(w, columns)`` gives the
    nearest codes of columns ``columns`` and ``grid.value(q, columns)`` their values. Columns are
    visited by decreasing ``diag(H)`` unless ``config.actorder`` is ``"none"`` (the grid is fixed,
    so the order costs nothing at inference)."""
    global _last_inverse
    act_order = config.actorder != "none"
    reuse = _last_inverse is not None and _last_inverse[0] is H and _last_inverse[1] == (act_order, config.dampening)
    W, Hp, perm = _prepare(weight, H, act_order)
    U = _last_inverse[2] if reuse else inverse_hessian_cholesky(Hp, config.dampening, name)
    _last_inverse = (H, (act_order, config.dampening), U)
    order = perm.tolist()

    def round_column(i: int, w: torch.Tensor, upcoming) -> tuple[torch.Tensor, torch.Tensor]:
        column = slice(order[i], order[i] + 1)
        q = grid.round(w, column)
        return q, grid.value(q, column)

    return _sweep(W, Hp, config, name, round_column, U)[:, torch.argsort(perm)]


# the last Hessian gptq_on_grid inverted and its factor: q/k/v (gate/up) get one H object from the
# lockstep pass, so each layer inverts it once per distinct input, not once per Linear
_last_inverse: tuple | None = None


def _prepare(weight: torch.Tensor, H: torch.Tensor, act_order: bool):
    """Float copies of the weight and Hessian with dead inputs zeroed (inputs that never fire: any
    value works, zero is cheapest), both in visiting order (``perm``: by decreasing ``diag(H)``
    with act-order, else column order)."""
    W = weight.detach().float().clone()
    H = H.detach().float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(W.shape[1])
    return W[:, perm], H[perm][:, perm], perm


def _sweep(W: torch.Tensor, H: torch.Tensor, config: GPTQConfig, name: str, round_column,
           U: torch.Tensor | None = None) -> torch.Tensor:
    """The column sweep over ``W`` (in visiting order, ``H`` likewise): ``round_column(i, w,
    upcoming)`` rounds visited column ``i`` (``w`` [out, 1] as updated so far; ``upcoming()`` the
    columns from it on) to (codes, values); each error is pushed onto the columns not yet rounded
    through the upper Cholesky factor of ``H⁻¹`` (``U``, computed here unless given), with lazy block
    updates. Codes in visiting order."""
    U = inverse_hessian_cholesky(H, config.dampening, name) if U is None else U
    columns = W.shape[1]
    Q = torch.zeros_like(W)
    diag = torch.diagonal(U).tolist()
    for start in range(0, columns, config.block_size):
        end = min(start + config.block_size, columns)
        Wb, Ub = W[:, start:end].clone(), U[start:end, start:end]
        errors = torch.zeros_like(Wb)
        for j in range(end - start):
            i = start + j
            w = Wb[:, j:j + 1]
            q, value = round_column(i, w, lambda: torch.cat([Wb[:, j:], W[:, end:]], 1))
            Q[:, i:i + 1] = q
            err = (w - value) * (1.0 / diag[i])
            Wb[:, j:].addmm_(err, Ub[j:j + 1, j:], alpha=-1.0)
            errors[:, j:j + 1] = err
        W[:, end:] -= errors @ U[start:end, end:]
    return Q


def output_error(weight: torch.Tensor, approx: torch.Tensor, H: torch.Tensor) -> float:
    """Relative output error ``‖X(W - Ŵ)ᵀ‖ / ‖XWᵀ‖`` from the input Hessian alone."""
    W, D = weight.float(), weight.float() - approx.float()
    return math.sqrt(max(output_energy(D, H), 0.0) / max(output_energy(W, H), 1e-30))


def output_energy(W: torch.Tensor, H: torch.Tensor) -> float:
    """``tr(W H Wᵀ)``: with ``H = 2/n Σ xᵀx``, twice the mean over the calibration tokens of
    ``‖x Wᵀ‖²``. Of a rounding error ``ΔW`` it is the error's energy at the Linear's output."""
    return float(torch.einsum("oi,ij,oj->", W.float(), H.float(), W.float()))
