"""A Linear layer stored as in a compressed-tensors pack-quantized checkpoint."""

from __future__ import annotations

import torch
from torch import nn

from quant.affine import QuantScheme
from quant.packing import packed_length
from runtime.kernels import reference


class QuantLinear(nn.Module):
    """Holds ``weight_packed``/``weight_scale``/``weight_zero_point``/``weight_shape`` buffers
    named as in the checkpoint, so its tensors load by name."""

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, bias: bool = False,
                 scale_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        groups = scheme.num_groups(in_features)
        self.register_buffer("weight_packed", torch.empty(out_features, packed_length(in_features, scheme.bits), dtype=torch.int32))
        self.register_buffer("weight_scale", torch.empty(out_features, groups, dtype=scale_dtype))
        self.register_buffer("weight_shape", torch.empty(2, dtype=torch.int64))
        if not scheme.symmetric:
            zp = torch.empty(packed_length(out_features, scheme.bits), groups, dtype=torch.int32)
            self.register_buffer("weight_zero_point", zp)
        if scheme.actorder == "group":
            self.register_buffer("weight_g_idx", torch.empty(in_features, dtype=torch.int32))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._dense: torch.Tensor | None = None

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return reference.dequantize_weight(
            self.weight_packed, self.weight_scale, getattr(self, "weight_zero_point", None),
            (self.out_features, self.in_features), self.scheme, dtype, getattr(self, "weight_g_idx", None),
        )

    def materialize(self, dtype: torch.dtype) -> None:
        """Build the dense weight the reference path multiplies by.

        On CPU the reference path is the implementation. Unpacking every weight on every
        decode step would dominate the step, so the dense weight is built once (at load)
        and kept: correct and fast enough for CPU, at the memory of a float model. The
        fused GPU kernels read the packed buffers directly instead.
        """
        self._dense = self.dequantized_weight(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The dispatch point: the fused Triton W4A16/W8A16 kernels will take CUDA inputs here
        # (reading weight_packed directly); everything else runs the reference.
        if self._dense is None or self._dense.dtype != x.dtype or self._dense.device != x.device:
            self.materialize(x.dtype)
        return reference.quant_linear(x, self._dense, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme.describe()}"
