"""The fused Triton kernels on CUDA (``runtime/kernels/quant_matmul.py``): the packed weight re-laid
once for them (``weight_layout.KernelWeight``), the launch configuration tuned per row bucket at
first use. The checkpoint's buffers stay beside it (state_dict, the reference they fall back to).

Tests without a GPU run these kernels in the Triton interpreter on CPU tensors: ``LOWBIT_TRITON_ON_CPU=1``
(with ``TRITON_INTERPRET=1``, which tests/conftest.py sets) lets this backend take CPU layers."""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

from runtime.kernels import weight_layout
from runtime.linear_backends.base import LinearBackend, LinearCase, NotThese

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
ON_CPU_ENV = "LOWBIT_TRITON_ON_CPU"  # "1": CPU layers too (the interpreter; tests)
_REPORTED_UNTUNED: set[str] = set()  # shapes the GEMM tuning found no configuration for, warned once each


class Triton(LinearBackend):
    name = "triton"
    tags = frozenset({"triton", "gpu"})
    devices = ("cuda",)

    def serves(self) -> tuple[str, ...]:
        return ("cuda", "cpu") if os.environ.get(ON_CPU_ENV) == "1" else self.devices

    def refuses(self, case: LinearCase) -> str | None:
        reason = super().refuses(case)
        if reason:
            return reason
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton)"
        reason = weight_layout.unsupported_reason(case.scheme, case.in_features, case.g_idx)
        if reason is None and case.dtype not in KERNEL_DTYPES:
            reason = f"{str(case.dtype).removeprefix('torch.')} activations (the kernels take float16 and bfloat16)"
        return reason

    def build(self, layer, case: LinearCase) -> weight_layout.KernelWeight:
        return weight_layout.make_kernel_weight(
            layer.weight_packed, layer.weight_scale, getattr(layer, "weight_zero_point", None),
            (case.out_features, case.in_features), case.scheme, case.g_idx)

    def accepts(self, weight: weight_layout.KernelWeight, x: torch.Tensor) -> bool:
        return x.dtype in KERNEL_DTYPES and x.device == weight.qweight.device

    def run(self, weight: weight_layout.KernelWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from runtime.kernels import quant_matmul  # imports triton: only where it runs
        from runtime.kernels.matmul_tuning import NoConfiguration

        try:
            return quant_matmul.quant_matmul(x, weight, bias)
        except NoConfiguration as e:  # this row count's bucket: no configuration runs and matches the reference
            report_untuned(str(e))
            raise NotThese(str(e)) from e

    def self_check(self, layer, weight, dtype: torch.dtype, rows: tuple[int, ...], tuned: bool) -> str | None:
        from runtime.kernel_checks import check_linear

        return check_linear(layer, weight, dtype, rows, tuned)

    def tune(self, weight: weight_layout.KernelWeight, buckets: tuple[int, ...], dtype: torch.dtype) -> int:
        """Tune the launch configuration of each row bucket (``quant_matmul.m_bucket``'s) now; returns
        how many were asked. A bucket with no configuration that runs and matches the reference is
        left to ``run`` (the reference for its rows, one warning)."""
        from runtime.kernels import quant_matmul
        from runtime.kernels.matmul_tuning import NoConfiguration

        for M in buckets:
            try:
                quant_matmul.choose_config(M, weight, dtype, weight.qweight.device)
            except NoConfiguration:
                continue
        return len(buckets)


def report_untuned(reason: str) -> None:
    """One warning per shape the GEMM tuning found no configuration for (``reason`` names the
    kernel, the shape and why each candidate failed), however many layers and calls meet it."""
    if reason not in _REPORTED_UNTUNED:
        _REPORTED_UNTUNED.add(reason)
        warnings.warn(f"{reason}; layers of this shape run the dense reference (dequantize + matmul) for inputs of "
                      "this row count (its M bucket) instead (correct, slower)", stacklevel=4)
