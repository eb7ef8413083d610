"""The decoder's RMSNorms: the plain one (with the residual add fused into one launch on the
kernels) and Gemma's, which scales by ``1 + weight``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    kernels = False  # the fused Triton kernel (Decoder.use_kernels), else PyTorch
    # runtime/native/decode_ops.cpp where it is built, on CPU with float32 activations
    # (runtime.load.use_native_ops): the add and the norm one call, not two ATen ops of several kernels
    native = None

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalize in float32 (as HF does), scale in the compute dtype. F.rms_norm is HF's
        # x * rsqrt(mean(x^2) + eps) in one call, bit for bit in float32, and 30% faster per norm
        # than the five ops it replaces on a decode step's [1, 576] (bench/results/cpu/NOTES.md)
        weight = self._parameters["weight"]  # not self.weight: nn.Module.__getattr__ costs ~2 us, 61 norms a step
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.eps)
        return weight * F.rms_norm(x.float(), weight.shape, eps=self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None):
        """``(norm(x + residual), x + residual)``: the residual stream's add and the next norm,
        one launch on the kernels (``residual`` None: no add)."""
        if self.kernels:
            from runtime.kernels.small_ops import add_rmsnorm

            return add_rmsnorm(x, residual, self.weight, self.eps)
        if self.native is not None:
            return self.native.add_rms_norm(x, residual, self._parameters["weight"], self.eps)
        s = x if residual is None else x + residual
        return self(s), s


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by ``1 + weight``, in float32, rounded once (as transformers does).
    The fused add + RMSNorm kernel rounds before it scales by ``weight``, so these norms always run
    as PyTorch (two launches more per norm on a GPU; a kernel with the offset is later work)."""

    native = None  # as on the GPU: no native op with the offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None):
        s = x if residual is None else x + residual
        return self(s), s


def make_norm(cfg, dim: int) -> RMSNorm:
    """The family's norm for a ``runtime.model.DecoderConfig``: Gemma's (1 + w) one where it stores w - 1."""
    return OffsetRMSNorm(dim, cfg.rms_norm_eps) if cfg.norm_offset else RMSNorm(dim, cfg.rms_norm_eps)
