"""SignRound (AutoRound's algorithm): each decoder layer's rounding offsets and group ranges
learned by signed gradient descent against the float model's output of the layer, then
rounded into the ordinary affine scheme (the algorithm: ``quant.learned_rounding``).
``[awq, signround]`` runs AWQ's scales first. On a GGUF type (a recipe's ``gguf:``) the offsets and
ranges are learnt through the type's own grid: ``quant.gguf_signround``."""

from __future__ import annotations

from quant.gguf_mix import GridScheme
from quant.learned_rounding import CHOICES, SignRoundConfig, learn_rounding
from quant.methods import Method


def round_layer(layer, inputs, plan, settings: SignRoundConfig, scale_dtype, where: str):
    parameters = None
    if any(isinstance(s, GridScheme) for s in plan.values()):  # GGUF types: learnt through their own grids
        from quant.gguf_signround import grid_parameters  # imports the gguf package: only when planned

        parameters = grid_parameters(layer, inputs, plan)
    return learn_rounding(layer, inputs, plan, settings, scale_dtype, where, parameters)


METHOD = Method("signround", SignRoundConfig, needs_data=True, stage="round", statistics="layer",
                round_layer=round_layer, float_stream=lambda settings: settings.target == "model",
                choices=CHOICES, ranks=False)  # its gradients are not summed across ranks yet
