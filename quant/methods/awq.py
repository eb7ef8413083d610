"""AWQ: per-channel scales searched on the layer's calibration inputs and folded into the
float weights, then each Linear's range clipped; a rounding method follows (RTN when none is
listed: ``methods: [awq]``; ``[awq, gptq]`` for AWQ+GPTQ). The algorithm: ``quant.awq``."""

from __future__ import annotations

from quant.awq import AWQConfig, apply_awq
from quant.methods import Method


def prepare_layer(layer, inputs, plan, settings: AWQConfig, arch) -> dict:
    return apply_awq(layer, inputs, plan, settings, arch)


METHOD = Method("awq", AWQConfig, needs_data=True, stage="layer", prepare_layer=prepare_layer)
