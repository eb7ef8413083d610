"""A Linear layer stored as in a compressed-tensors pack-quantized checkpoint."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from quant.affine import QuantScheme
from quant.packing import pack, packed_length
from runtime import cpu_linear
from runtime.kernels import reference, weight_layout

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_REPORTED_CPU_REASONS: set[str] = set()  # why layers keep the dense reference on CPU, warned once each
_REPORTED_UNTUNED: set[str] = set()  # shapes the GEMM tuning found no configuration for, warned once each


def runs_kernels(x: torch.Tensor) -> bool:
    """Whether ``x`` goes through the fused Triton kernels (CUDA) or the reference (anything else).
    Tests replace this to run the kernels in the Triton interpreter on CPU tensors."""
    return x.is_cuda


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
        self._kernel: weight_layout.KernelWeight | None = None
        self._kernel_unsupported: str | None = None  # why the kernels cannot read this layer
        self._fell_back = False  # switched to the reference by fall_back
        self._cpu: cpu_linear.CpuWeight | None = None  # the CPU kernels' weight (materialize)
        self._cpu_unsupported: str | None = None  # why no CPU kernel takes this layer ("" : one does)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return reference.dequantize_weight(
            self.weight_packed, self.weight_scale, getattr(self, "weight_zero_point", None),
            (self.out_features, self.in_features), self.scheme, dtype, getattr(self, "weight_g_idx", None),
        )

    def kernel_weight(self) -> weight_layout.KernelWeight:
        """The packed weight re-laid for the Triton kernels (built once, never stored)."""
        return weight_layout.make_kernel_weight(
            self.weight_packed, self.weight_scale, getattr(self, "weight_zero_point", None),
            (self.out_features, self.in_features), self.scheme, getattr(self, "weight_g_idx", None),
        )

    def materialize(self, dtype: torch.dtype, cpu_kernels: bool = True) -> None:
        """Prepare the weight for inference in ``dtype`` on the buffers' device (at load): the
        backend is chosen here, once per layer.

        On GPU the fused kernels read a re-laid copy of the packed weight (``kernel_weight``).
        The checkpoint-layout buffers stay (state_dict, the dense fallback), so a GPU holds the
        packed weight twice; keeping only the kernel copy there is a known follow-up.
        On CPU PyTorch's weight-only kernels read their own packed copy (``runtime/cpu_linear.py``),
        which replaces ``weight_packed`` (read back from it on demand). Layers no kernel takes, and
        layers sent back by ``fall_back``, multiply with a dense weight dequantized once here
        (``cpu_kernels=False``: every layer, the reference that tests compare at float32 precision).
        """
        if self.weight_scale.is_cuda and self.kernels_can_run(dtype):
            self._kernel, self._dense = self.kernel_weight(), None
        elif self.weight_scale.device.type == "cpu" and cpu_kernels and self._cpu_can_run():
            if self._cpu is None:
                self._cpu = cpu_linear.build(
                    self.weight_packed, self.weight_scale, getattr(self, "weight_zero_point", None),
                    (self.out_features, self.in_features), self.scheme, getattr(self, "weight_g_idx", None))
            self._dense = None
            if self._cpu.codes_readable and "weight_packed" in self._buffers:
                del self._buffers["weight_packed"]  # one packed copy: __getattr__ reads it back from the kernel's
        else:
            self._dense = self.dequantized_weight(dtype)

    def __getattr__(self, name: str):
        if name == "weight_packed" and self.__dict__.get("_cpu") is not None:
            return self._cpu_weight_packed()
        return super().__getattr__(name)

    def _cpu_weight_packed(self) -> torch.Tensor:
        """The checkpoint's ``weight_packed``, rebuilt from the CPU kernel's copy (exact)."""
        return pack(self._cpu.codes(), self.scheme.bits, dim=1)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if "weight_packed" not in self._buffers:  # held by the CPU kernel's copy: saved as the checkpoint stores it
            destination[prefix + "weight_packed"] = self._cpu_weight_packed()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._drop_cpu_weight()  # new tensors: the kernel's copy is stale
        self._dense = self._kernel = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _drop_cpu_weight(self) -> None:
        """Back to the checkpoint's buffers: ``weight_packed`` read back from the CPU kernel's copy."""
        if self._cpu is not None:
            packed = self._cpu_weight_packed() if "weight_packed" not in self._buffers else None
            self._cpu = None
            if packed is not None:
                self.register_buffer("weight_packed", packed)

    def fall_back(self, reason: str) -> None:
        """Run this layer on the dense reference path from now on (the load-time self-check's switch
        when a kernel fails or disagrees with the reference); ``reason`` is what was wrong. The
        self-check has warned once for every layer it switches, so the forward does not again."""
        self._drop_cpu_weight()
        self._kernel_unsupported, self._kernel, self._fell_back = reason, None, True

    @property
    def fallback_reason(self) -> str | None:
        """Why this layer cannot run the kernels (None: it can, or nothing has asked yet)."""
        return self._kernel_unsupported or self._cpu_unsupported or None

    @property
    def on_cpu_kernel(self) -> bool:
        """Whether this layer runs PyTorch's CPU weight-only kernel (chosen by ``materialize``)."""
        return self._cpu is not None

    def kernels_can_run(self, dtype: torch.dtype) -> bool:
        """Whether the Triton kernels take this layer with ``dtype`` activations (warns why not)."""
        if self._kernel_unsupported is None:
            reason = weight_layout.unsupported_reason(self.scheme, self.in_features, getattr(self, "weight_g_idx", None))
            self._kernel_unsupported = reason or ""
        reason = self._kernel_unsupported or (None if dtype in KERNEL_DTYPES else f"{dtype} activations")
        if reason and not self._fell_back:
            warnings.warn(f"a {self.scheme.describe()} layer runs the dense reference instead of the kernels: {reason}")
        return not reason

    def _cpu_can_run(self) -> bool:
        if self._fell_back:
            return False
        if self._cpu_unsupported is None:
            reason = cpu_linear.unsupported_reason(self.scheme, self.in_features, self.out_features,
                                                   getattr(self, "weight_g_idx", None))
            self._cpu_unsupported = reason or ""
            if reason and reason not in _REPORTED_CPU_REASONS:  # once per reason, not per layer
                _REPORTED_CPU_REASONS.add(reason)
                warnings.warn(f"{self.scheme.describe()} layers with {reason} run the dense reference on CPU "
                              "(a float copy of the weight)")
        return not self._cpu_unsupported

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The dispatch point: CUDA inputs go to the fused Triton kernels, CPU inputs to the CPU kernels
        # when materialize chose them, everything else to the reference. Rows of a shape for which
        # the GEMM tuning found no configuration that runs and matches the reference go to the
        # reference too (the dense weight then sits beside the kernel's for the other row counts).
        if runs_kernels(x) and self.kernels_can_run(x.dtype):
            from runtime.kernels import quant_matmul  # imports triton: only where kernels run
            from runtime.kernels.matmul_tuning import NoConfiguration

            if self._kernel is None or self._kernel.qweight.device != x.device:
                self._kernel = self.kernel_weight()
            try:
                return quant_matmul.quant_matmul(x, self._kernel, self.bias)
            except NoConfiguration as e:
                report_untuned(str(e))
        if self._cpu is not None and x.is_cpu:
            return self._cpu(x, self.bias)
        if self._dense is None or self._dense.dtype != x.dtype or self._dense.device != x.device:
            self._dense = self.dequantized_weight(x.dtype)
        return reference.quant_linear(x, self._dense, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme.describe()}"


def report_untuned(reason: str) -> None:
    """One warning per shape the GEMM tuning found no configuration for (``reason`` names the
    kernel, the shape and why each candidate failed), however many layers and calls meet it."""
    if reason not in _REPORTED_UNTUNED:
        _REPORTED_UNTUNED.add(reason)
        warnings.warn(f"{reason}; layers of this shape run the dense reference (dequantize + matmul) for inputs of "
                      "this row count (its M bucket) instead (correct, slower)", stacklevel=3)


def concat_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One layer computing ``parts`` side by side (their outputs concatenated), built at load from
    their loaded tensors (never stored in a checkpoint): q/k/v or gate/up as one GEMM. None when
    they cannot be joined (mixed kinds or schemes, act-order groups that differ)."""
    first = parts[0]
    if any(type(p) is not type(first) or (p.bias is None) != (first.bias is None) for p in parts):
        return None
    total = sum(p.out_features for p in parts)
    bias = torch.cat([p.bias for p in parts]) if first.bias is not None else None
    if type(first) is nn.Linear:
        joined = nn.Linear(first.in_features, total, bias=bias is not None, device="meta")
        joined.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
    elif isinstance(first, QuantLinear):
        joined = _concat_quant(parts, total)
        if joined is None:
            return None
    else:
        return None
    if bias is not None:
        joined.bias = nn.Parameter(bias, requires_grad=False)
    return joined


def _concat_quant(parts: list[QuantLinear], total: int) -> QuantLinear | None:
    first = parts[0]
    pack = 32 // first.scheme.bits  # zero points are packed along the outputs: each part must fill its words
    g_idx = [getattr(p, "weight_g_idx", None) for p in parts]
    if (any(p.scheme != first.scheme or p.weight_scale.dtype != first.weight_scale.dtype for p in parts)
            or (not first.scheme.symmetric and any(p.out_features % pack for p in parts))
            or (g_idx[0] is not None and any(not torch.equal(g, g_idx[0]) for g in g_idx))):
        return None
    with torch.device("meta"):
        joined = QuantLinear(first.in_features, total, first.scheme, first.bias is not None, first.weight_scale.dtype)
    for name in ("weight_packed", "weight_scale", "weight_zero_point"):
        if hasattr(first, name):
            setattr(joined, name, torch.cat([getattr(p, name) for p in parts]))
    joined.weight_shape = torch.tensor([total, first.in_features], device=first.weight_packed.device)
    if g_idx[0] is not None:
        joined.weight_g_idx = g_idx[0]
    return joined
