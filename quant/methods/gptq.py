"""GPTQ: columns rounded in turn, each error pushed onto the columns not yet rounded through the
inverse Hessian of the Linear's calibration inputs (the algorithm: ``quant.gptq``)."""

from __future__ import annotations

from quant.gguf_mix import GridScheme
from quant.gptq import GPTQConfig, gptq_quantize
from quant.methods import Method


def round_linear(weight, scheme, settings: GPTQConfig, scale_dtype, H, name: str):
    if isinstance(scheme, GridScheme):  # a GGUF type: GPTQ on its fitted grid
        from quant import gguf_fit  # imports the gguf package: only when a GGUF type is planned

        return gguf_fit.round_linear(weight, scheme, H, settings, name)
    return gptq_quantize(weight, H, scheme, settings, scale_dtype, name)


def actorder(settings: GPTQConfig) -> str | None:
    return None if settings.actorder == "none" else settings.actorder


METHOD = Method("gptq", GPTQConfig, needs_data=True, stage="round", statistics="hessian",
                round_linear=round_linear, actorder=actorder,
                choices={"actorder": ("weight", "group", "none")})
