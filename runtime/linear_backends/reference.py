"""The reference backend: the weight dequantized once into a dense tensor of the activations' dtype,
then ``F.linear``. Runs every layer on every device; what the others are checked against and what a
layer falls back to."""

from __future__ import annotations

import torch

from runtime.kernels import reference
from runtime.linear_backends.base import LinearBackend, LinearCase


class Reference(LinearBackend):
    name = "reference"

    def refuses(self, case: LinearCase) -> str | None:
        return None

    def build(self, layer, case: LinearCase) -> torch.Tensor:
        return layer.dequantized_weight(case.dtype)

    def run(self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return reference.quant_linear(x, weight, bias)

    def accepts(self, weight: torch.Tensor, x: torch.Tensor) -> bool:
        return weight.dtype == x.dtype and weight.device == x.device
