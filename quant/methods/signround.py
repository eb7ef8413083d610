"""SignRound (AutoRound's algorithm): each decoder layer's rounding offsets and group ranges
learned by signed gradient descent against the float model's output of the layer, then
rounded into the ordinary affine scheme (the algorithm: ``quant.learned_rounding``).
``[awq, signround]`` runs AWQ's scales first."""

from __future__ import annotations

from quant.learned_rounding import CHOICES, SignRoundConfig, learn_rounding
from quant.methods import Method


def round_layer(layer, inputs, plan, settings: SignRoundConfig, scale_dtype, where: str):
    return learn_rounding(layer, inputs, plan, settings, scale_dtype, where)


METHOD = Method("signround", SignRoundConfig, needs_data=True, stage="round", statistics="layer",
                round_layer=round_layer, float_stream=lambda settings: settings.target == "model",
                choices=CHOICES, ranks=False)  # its gradients are not summed across ranks yet
