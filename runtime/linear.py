"""A Linear layer stored as in a compressed-tensors pack-quantized checkpoint."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from quant.affine import QuantScheme
from quant.packing import packed_length
from runtime import backend as backends
from runtime import linear_backends
from runtime.kernels import reference, weight_layout
from runtime import cpu_linear
from runtime.linear_backends import LinearCase, NotThese

_REPORTED_REFERENCE: set[str] = set()  # why layers run the reference (materialize), warned once each


class QuantLinear(nn.Module):
    """Holds ``weight_packed``/``weight_scale``/``weight_zero_point``/``weight_shape`` buffers
    named as in the checkpoint, so its tensors load by name, and runs them on a backend
    (``runtime/linear_backends/``) chosen once, at load (:meth:`materialize`).

    Its public surface for the rest of the runtime, the tests and the benches: ``choice`` (the
    backend and every one passed over, with why), ``backend_name``, :meth:`use_backend`,
    :meth:`fall_back`, ``fallback_reason``, :meth:`kernel_weight` and :meth:`tune` (the Triton
    tuner's), :meth:`self_check`. The backend's weight is the layer's own business."""

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
        self._forget_backend()
        self._failed: dict[str, str] = {}  # backend name -> why it was left (fall_back): never chosen again

    def _forget_backend(self) -> None:
        self.choice: backends.Choice | None = None  # the backend and the ones passed over (materialize)
        self._weight = None  # the chosen backend's weight (from build)
        self._holds_codes = False  # _weight holds the codes: weight_packed is read back from it
        self._dense: torch.Tensor | None = None  # a dense weight for inputs the backend does not take
        self._asked: tuple = (None, None, None)  # materialize's off, only, priority (fall_back chooses again)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return reference.dequantize_weight(
            self.weight_packed, self.weight_scale, getattr(self, "weight_zero_point", None),
            (self.out_features, self.in_features), self.scheme, dtype, getattr(self, "weight_g_idx", None),
        )

    def case(self, dtype: torch.dtype) -> LinearCase:
        """What the backends are asked about: this layer with ``dtype`` activations, where its buffers are."""
        return LinearCase(self.scheme, self.in_features, self.out_features, self.weight_scale.device.type, dtype,
                          getattr(self, "weight_g_idx", None))

    # ------------------------------------------------------------------ choosing and building

    def materialize(self, dtype: torch.dtype, off: frozenset[str] | None = None, only: str | None = None,
                    priority: list | None = None) -> None:
        """Choose this layer's backend for ``dtype`` activations (``runtime.backend.choose`` over
        ``priority``, default ``linear_backends.PRIORITY``; ``off``: switched-off names and group
        words, default ``LOWBIT_DISABLE``; ``only``: a backend by name) and build its weight now, so
        the first request does not pay for it. Backends this layer fell back from stay passed over.

        A backend's weight may replace ``weight_packed`` (the CPU kernels keep the codes in their own
        layout): the buffer is dropped and read back exactly on demand (state_dict, the reference),
        so memory stays proportional to bits. On GPU the Triton kernels' re-laid copy sits beside
        the checkpoint's buffers (a known follow-up: keep only the kernel copy)."""
        priority = linear_backends.PRIORITY if priority is None else priority
        case = self.case(dtype)
        off = backends.disabled() if off is None else frozenset(off)
        failed = [backends.Rejected(b.name, reason) for b in priority if (reason := self._failed.get(b.name))]
        left = [b for b in priority if b.name not in self._failed]
        choice = backends.choose(left, case, off, None if only in self._failed else only)  # raises: layer unchanged
        order = [b.name for b in priority]
        rejected = sorted([*failed, *choice.rejected], key=lambda r: order.index(r.name))
        self._release()
        self.choice = backends.Choice(choice.backend, tuple(rejected))
        self._asked, self._dtype = (off, only, priority), dtype
        self._weight = choice.backend.build(self, case)
        self._holds_codes = choice.backend.holds_codes(self._weight)
        if self._holds_codes and "weight_packed" in self._buffers:
            del self._buffers["weight_packed"]  # one packed copy: __getattr__ reads it back from the backend's
        self._warn_reference(case)

    def _warn_reference(self, case: LinearCase) -> None:
        """Where a layer ends on the reference though a backend serving its device exists, say why:
        once per process and message (it names the scheme and the reason, not the layer)."""
        if self.choice.name != "reference" or self._failed:
            return  # a fall_back was warned about by whoever called it (the self-check)
        reason = self.fallback_reason
        message = (f"{self.scheme.describe()} layers run the dense reference (a float copy of the weight) instead of "
                   f"the kernels on {case.device}: {reason}")
        if reason and message not in _REPORTED_REFERENCE:
            _REPORTED_REFERENCE.add(message)
            warnings.warn(message, stacklevel=3)

    def use_backend(self, name: str, dtype: torch.dtype | None = None) -> None:
        """Run this layer on the backend called ``name`` from now on (tests, benches; raises
        ``runtime.backend.NoBackend`` with its refusal when it cannot)."""
        # the dtype it was materialized for, else the float tensors' (a layer used on its own, e.g. .half())
        dtype = dtype or getattr(self, "_dtype", None) or (self.bias if self.bias is not None else self.weight_scale).dtype
        self.materialize(dtype, self._asked[0], name, self._asked[2])
        if self.choice.name != name:  # it refused, or this layer fell back from it before
            reason = next(r.reason for r in self.choice.rejected if r.name == name)
            raise backends.NoBackend(f"the {name} backend does not run this {self.scheme.describe()} layer: {reason}")

    def fall_back(self, reason: str) -> None:
        """Leave the current backend for good (the self-check's switch when a kernel fails or
        disagrees with the reference): the next one in the priority list that takes this layer
        runs it, usually the reference; ``reason`` is recorded in ``choice``. Whoever calls this
        has warned (the self-check: once per configuration), so nothing warns again."""
        if self.choice is None:  # not chosen yet: whatever is chosen will be the reference
            self._failed.update({b.name: reason for b in linear_backends.PRIORITY if b.name != "reference"})
        elif self.choice.name != "reference":  # (the reference has nothing to fall back to)
            self._failed[self.choice.name] = reason
            self.materialize(self._dtype, *self._asked)

    def _release(self) -> None:
        """Back to the checkpoint's buffers: ``weight_packed`` read back from the backend's weight."""
        packed = self._weight_packed() if self._holds_codes and "weight_packed" not in self._buffers else None
        self.choice, self._weight, self._holds_codes, self._dense = None, None, False, None
        if packed is not None:
            self.register_buffer("weight_packed", packed)

    def __getattr__(self, name: str):
        if name == "weight_packed" and self.__dict__.get("_holds_codes"):
            return self._weight_packed()
        return super().__getattr__(name)

    def _weight_packed(self) -> torch.Tensor:
        """The checkpoint's ``weight_packed``, rebuilt from the backend's copy (exact)."""
        return self.choice.backend.read_back(self._weight, self.scheme)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if "weight_packed" not in self._buffers:  # held by the backend's copy: saved as the checkpoint stores it
            destination[prefix + "weight_packed"] = self._weight_packed()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._release()  # new tensors: the backend's weight is stale (chosen again at the next materialize)
        self._failed = {}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ------------------------------------------------------------------ what others read

    @property
    def backend_name(self) -> str | None:
        """The chosen backend's name (None before ``materialize`` or the first call)."""
        return None if self.choice is None else self.choice.name

    @property
    def backend_weight(self):
        """The chosen backend's weight, for the tests and benches of that backend (nothing else in the
        runtime reads it: it goes back to the backend's ``run``)."""
        return self._weight

    @property
    def fallback_reason(self) -> str | None:
        """Why this layer does not run a kernel: what made it leave one (``fall_back``), or, on the
        reference, the refusals of the backends for its device (None: it runs one, or the fastest
        backend for its device was switched off or another one asked for by name)."""
        if self._failed:
            return next(reversed(self._failed.values()))
        if self.choice is None or self.choice.name != "reference":
            return None
        device = self.weight_scale.device.type
        serves = {b.name: b.serves() for b in self._asked[2] or linear_backends.PRIORITY if b.devices}
        serving = [r for r in self.choice.rejected if device in serves.get(r.name, ())]
        if not serving or linear_backends.passed_over_for(serving[0].reason):
            return None
        return "; ".join(f"{r.name}: {r.reason}" for r in serving if not linear_backends.passed_over_for(r.reason))

    @property
    def on_cpu_kernel(self) -> bool:
        """Whether this layer runs a CPU kernel backend (bf16 activations: the MLP converts once)."""
        return self.choice is not None and "cpu" in self.choice.backend.tags

    def kernel_weight(self) -> weight_layout.KernelWeight:
        """The packed weight re-laid for the Triton kernels: the one this layer runs where Triton
        is its backend, else built now (not stored)."""
        if self.backend_name == "triton":
            return self._weight
        return linear_backends.by_name("triton").build(self, self.case(torch.float16))

    def tune(self, buckets: tuple[int, ...], dtype: torch.dtype) -> int:
        """Tune the backend for these row buckets now (an Engine's start-up: ``execution.tuning_buckets``);
        how many were asked (0: the backend tunes nothing)."""
        tune = None if self.choice is None else self.choice.backend.tune
        return 0 if tune is None else tune(self._weight, buckets, dtype)

    @property
    def self_checks(self) -> bool:
        """Whether the chosen backend checks itself against the reference (``runtime/selfcheck.py``)."""
        return self.choice is not None and self.choice.backend.self_check is not None

    def self_check(self, dtype: torch.dtype, rows: tuple[int, ...], tuned: bool) -> str | None:
        """The chosen backend's check against the reference (raises on a failure; returns what
        failed in part)."""
        return self.choice.backend.self_check(self, self._weight, dtype, rows, tuned)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The dispatch point: the backend chosen at load, unless it does not take this input (another
        # device or dtype than it was built for, a row count its tuning found no configuration for):
        # then the reference, from a dense weight built for such inputs.
        if self.choice is None:
            self.materialize(x.dtype)  # never materialized (a layer used on its own): chosen at first use
        backend = self.choice.backend
        if backend.accepts(self._weight, x):
            try:
                return backend.run(self._weight, x, self.bias)
            except NotThese:
                pass
        if self._dense is None or self._dense.dtype != x.dtype or self._dense.device != x.device:
            self._dense = self.dequantized_weight(x.dtype).to(x.device)
        return reference.quant_linear(x, self._dense, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme.describe()}"


def use_backend(module: nn.Module, name: str) -> None:
    """Every QuantLinear in ``module`` on the backend called ``name`` (tests, benches)."""
    for m in module.modules():
        if isinstance(m, QuantLinear):
            m.use_backend(name)


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


def plan_keys(decoder: nn.Module):
    """(kind, outputs, inputs, group) of each CPU weight of ``decoder`` that ``cpu_plan`` plans for:
    quantized Linears on the CPU kernels and bf16 float leftovers (:class:`NarrowLinear`)."""
    for m in decoder.modules():
        if isinstance(m, QuantLinear) and m.on_cpu_kernel:
            eight = m.scheme.bits == 8
            yield ("int8" if eight else "int4", m.out_features, m.in_features,
                   0 if eight else cpu_linear.kernel_group(m.scheme.group_len(m.in_features)))
        elif isinstance(m, cpu_linear.NarrowLinear) and m.weight.dtype == torch.bfloat16:
            yield "narrow", m.out_features, m.in_features, 0
