"""``lowbit export CKPT --gguf TYPE``: a lowbit checkpoint (or a float model) as a GGUF file.

Where a quantized Linear's grid is a GGUF type's (4-bit groups of 32, symmetric: Q4_0; with a zero
point: Q4_1; 8-bit groups of 32, symmetric: Q8_0) its integer codes are copied, not re-rounded:
Q4_0 and Q8_0 store ``scale * q`` (the scale as float16: exact for the float16 or bfloat16 scales
lowbit writes, as long as they are normal float16 numbers), Q4_1 stores ``(q - zero) * scale`` as
``d * (q + 8) + m`` with the offset ``m = -scale * (zero + 8)`` rounded once to float16. How far
that rounding moves any weight is measured and printed (in grid steps). Every other Linear, and every
Linear of a float model, is re-fitted by RTN onto the requested type's grid from the weight the
checkpoint dequantizes to, and the export says so. ``--gguf exact`` gives each Linear the type its
grid maps onto and refuses one that maps onto none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from quant.affine import QuantScheme
from quant.format import QuantizedWeight
from quant.gguf.types import TYPES, GGUFFields, GGUFType, fallback, fit_rtn, gguf_type
from quant.gguf.write import Weight, write_gguf

FLOAT_EXPORTS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
EXACT = "EXACT"

# lowbit grid (bits, group, symmetric) -> the GGUF type that stores it exactly
EXACT_TYPES = {(4, 32, True): "Q4_0", (4, 32, False): "Q4_1", (8, 32, True): "Q8_0"}

@dataclass
class ExportReport:
    exact: list[str] = field(default_factory=list)  # Linears whose codes were copied
    refit: dict[str, str] = field(default_factory=dict)  # Linear -> why it was re-fitted
    rounded: float = 0.0  # largest change of a copied weight from storing scales/offsets in float16, in grid steps
    types: dict[str, str] = field(default_factory=dict)  # GGUF tensor -> its type

    def lines(self) -> list[str]:
        out = []
        if self.exact:
            note = (f"; scales/offsets rounded to float16 move a weight by at most {self.rounded:.2g} of a grid step"
                    if self.rounded else "")
            out.append(f"{len(self.exact)} Linears copied exactly (codes and scales as the checkpoint stores them{note})")
        reasons = {}
        for name, why in self.refit.items():
            reasons.setdefault(why, []).append(name)
        for why, names in reasons.items():
            out.append(f"{len(names)} Linears re-fitted by RTN ({why}), e.g. {names[0]}")
        counts = {}
        for t in self.types.values():
            counts[t] = counts.get(t, 0) + 1
        out.append("tensor types: " + ", ".join(f"{t} x{n}" for t, n in sorted(counts.items())))
        return out


def exact_fields(qw: QuantizedWeight, t: GGUFType) -> tuple[GGUFFields, float] | None:
    """The checkpoint's codes on ``t``'s grid, copied, and how far storing its scales (and Q4_1's
    offsets) in float16 moved a dequantized weight, in grid steps (0 for float16 or bfloat16 scales of
    normal size); None when the grids differ."""
    s = qw.scheme
    if qw.g_idx is not None or EXACT_TYPES.get((s.bits, s.group_size, s.symmetric)) != t.name:
        return None
    scale = qw.scale.float()
    d = scale.to(torch.float16)
    span = max(abs(t.code_range[0]), t.code_range[1])  # the largest |code| a scale multiplies
    moved = (d.float() - scale).abs() * span
    if s.symmetric:
        fields = GGUFFields(t, qw.q.to(torch.int8), d)
    else:
        offset = -scale * (qw.zero.float() + 8)  # (q - z) * s = s * (q + 8) - s * (z + 8)
        m = offset.to(torch.float16)
        moved = moved + (m.float() - offset).abs()
        fields = GGUFFields(t, (qw.q.int() + 8).to(torch.int8), d, dmin=m)
    steps = float((moved / scale.abs().clamp_min(1e-30)).max()) if scale.numel() else 0.0
    return fields.check(), steps


def _why_not_exact(scheme: QuantScheme | None, qw: QuantizedWeight | None, t: GGUFType) -> str:
    if scheme is None:
        return "a float Linear"
    if qw is not None and qw.g_idx is not None:
        return "act-order groups"
    grid = EXACT_TYPES.get((scheme.bits, scheme.group_size, scheme.symmetric))
    if grid is None:
        return f"{scheme.describe()} is no GGUF grid"
    return f"{scheme.describe()} is {grid}'s grid, not {t.name}'s"


def linear_weights(tensors: dict, schemes: dict[str, QuantScheme], linears: list[str], target: str,
                   report: ExportReport) -> dict[str, Weight]:
    """``{name.weight: fields}`` for each Linear in ``linears`` (quantized per ``schemes`` or float)."""
    out = {}
    for name in linears:
        scheme = schemes.get(name)
        qw = QuantizedWeight.from_tensors(tensors, name, scheme) if scheme else None
        weight = qw.dequantize(torch.float32) if qw else tensors[f"{name}.weight"].float()
        if target == EXACT:
            grid = EXACT_TYPES.get((scheme.bits, scheme.group_size, scheme.symmetric)) if scheme else None
            if grid is None or (qw is not None and qw.g_idx is not None):
                raise ValueError(f"{name}: {_why_not_exact(scheme, qw, TYPES['Q4_0'])}; --gguf exact takes only "
                                 "4-bit or symmetric 8-bit groups of 32 (pick a GGUF type to re-fit it)")
            want = TYPES[grid]
        else:
            want = gguf_type(target)
        found = exact_fields(qw, want) if qw is not None else None
        if found is not None:
            out[f"{name}.weight"], rounding = found
            report.exact.append(name)
            report.rounded = max(report.rounded, rounding)
            continue
        if target == EXACT:
            raise ValueError(f"{name}: {_why_not_exact(scheme, qw, want)}; --gguf exact cannot copy it")
        fitted = fallback(want, weight.shape[1])
        why = _why_not_exact(scheme, qw, want)
        if fitted is not want:
            why += f"; {weight.shape[1]} columns are no multiple of {want.block}, so {fitted.name} as llama.cpp does"
        report.refit[name] = why
        out[f"{name}.weight"] = fit_rtn(weight, fitted)
    return out


def _linear_names(tensors: dict, config: dict) -> list[str]:
    """Every Linear of the decoder layers (stored quantized or float) and a quantized head."""
    packed = {k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed")}
    layer_floats = {k[: -len(".weight")] for k, v in tensors.items()
                    if k.endswith("_proj.weight") and ".layers." in k and v.dim() == 2}
    return sorted(packed | layer_floats)


def export(source: str, type_name: str, out: Path, overwrite: bool = False) -> ExportReport:
    """Write ``source`` (lowbit checkpoint, float model directory or alias) as a GGUF file of
    ``type_name`` (a quantized type, 'exact', or F16/BF16/F32) at ``out``."""
    from quant.checkpoint import linear_schemes, read_config, read_tensors, verify
    from quant.models import resolve

    target = type_name.upper()
    if target not in (*FLOAT_EXPORTS, EXACT, *TYPES):  # before anything is read
        raise ValueError(f"unknown GGUF type {type_name!r}: lowbit writes {', '.join(TYPES)}, exact "
                         f"(each Linear on its own grid) or {'/'.join(FLOAT_EXPORTS)}")
    path = resolve(source)
    verify(path)
    config = read_config(path)
    tensors = read_tensors(path)
    linears = _linear_names(tensors, config)
    schemes = linear_schemes(config, linears)
    report = ExportReport()
    if target in FLOAT_EXPORTS:
        weights = {}
        for name in linears:
            if name in schemes:
                report.refit[name] = "dequantized to float"
                weights[f"{name}.weight"] = QuantizedWeight.from_tensors(tensors, name, schemes[name]).dequantize(torch.float32)
    else:
        if not schemes and config.get("quantization_config"):
            raise ValueError(f"{path}: no quantized Linear found although config.json has a quantization_config")
        if target == EXACT and not schemes:
            raise ValueError(f"{path} is a float model: --gguf exact copies a quantized checkpoint's codes; "
                             f"pick a type ({', '.join(TYPES)}) to fit it by RTN, or F16")
        # a quantized checkpoint's float Linears stay float (its recipe left them so); a float model's are fitted
        fit = [n for n in linears if n in schemes or not schemes]
        weights = linear_weights(tensors, schemes, fit, target, report)
    quant_parts = {f"{n}.{s}" for n in schemes for s in
                   ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")}
    rest = {k: v for k, v in tensors.items() if k not in quant_parts and k not in weights}
    ordered = [*rest.items(), *weights.items()]
    # a float model fitted to a quantized type: its other 2-D tensors (embeddings) as float16, as
    # llama.cpp's convert does; a checkpoint's are written as stored, so the file runs what lowbit runs
    float_type = FLOAT_EXPORTS.get(target) or (torch.float16 if not schemes else None)
    report.types = write_gguf(out, config, path, ordered, name=Path(str(source)).name,
                              float_type=float_type, overwrite=overwrite)
    return report
