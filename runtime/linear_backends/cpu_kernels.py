"""What the two CPU kernel backends share: ``runtime.cpu_linear``'s public API (``unsupported_reason``,
``build``, the weight's ``__call__(x, bias)``, ``codes()``, ``codes_readable``). The kernels run bf16
activations whatever the model's dtype (the weight converts), so no activation dtype is refused."""

from __future__ import annotations

import torch

from quant.affine import QuantScheme
from quant.packing import pack
from runtime import cpu_linear
from runtime.linear_backends.base import LinearBackend, LinearCase


class CpuKernels(LinearBackend):
    tags = frozenset({"cpu"})
    devices = ("cpu",)

    def takes_bits(self, bits: int) -> str | None:
        """Why this backend's kernel does not take ``bits``-bit codes (None: it does)."""
        raise NotImplementedError

    def refuses(self, case: LinearCase) -> str | None:
        return (super().refuses(case) or self.takes_bits(case.scheme.bits)
                or cpu_linear.unsupported_reason(case.scheme, case.in_features, case.out_features, case.g_idx))

    def build(self, layer, case: LinearCase):
        return cpu_linear.build(layer.weight_packed, layer.weight_scale, getattr(layer, "weight_zero_point", None),
                                (case.out_features, case.in_features), case.scheme, case.g_idx)

    def run(self, weight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return weight(x, bias)

    def accepts(self, weight, x: torch.Tensor) -> bool:
        return x.is_cpu

    def holds_codes(self, weight) -> bool:
        return weight.codes_readable

    def read_back(self, weight, scheme: QuantScheme) -> torch.Tensor:
        return pack(weight.codes(), scheme.bits, dim=1)
