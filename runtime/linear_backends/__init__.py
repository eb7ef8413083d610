"""Backends for quantized Linears: one interface, one priority list, chosen by ``runtime.backend.choose``.

A backend turns a ``QuantLinear``'s checkpoint buffers into the weight it multiplies with and runs
``x @ W.T + b`` on it. ``QuantLinear.materialize`` (at load) builds the layer's :class:`LinearCase`
and takes the first backend of :data:`PRIORITY` that is not switched off (``LOWBIT_DISABLE``) and
does not refuse the case; the choice, with every backend passed over and why, stays on the layer
(``QuantLinear.choice``) for ``lowbit doctor``, the self-check and the tests. Nothing outside
``runtime/linear.py`` and this package reads a backend's weight.

A new backend is one file here (a :class:`LinearBackend` subclass) and one line in :data:`PRIORITY`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quant.affine import QuantScheme


@dataclass(frozen=True)
class LinearCase:
    """What a backend may refuse a layer for: its scheme and shape, act-order, where it runs, and in
    which activation dtype."""

    scheme: QuantScheme
    in_features: int
    out_features: int
    device: str  # torch.device.type of the layer's buffers
    dtype: torch.dtype  # the activations'
    g_idx: torch.Tensor | None = field(default=None, compare=False, repr=False)  # act-order groups

    @property
    def act_order(self) -> bool:
        return self.g_idx is not None


class NotThese(Exception):
    """Raised by a backend's ``run`` for inputs it turns out not to take (the Triton GEMM tuning
    found no configuration for their row count): the layer runs the reference for them."""


class LinearBackend:
    """The interface. ``devices``: the device types it runs on (a refusal elsewhere; empty: all)."""

    name: str = ""
    tags: frozenset[str] = frozenset()  # the group words that also switch it off (runtime.backend)
    devices: tuple[str, ...] = ()

    def refuses(self, case: LinearCase) -> str | None:
        """Why this backend cannot run ``case`` (None: it can). Subclasses add to the device check."""
        if self.devices and case.device not in self.serves():
            return f"runs on {' and '.join(self.serves())} only (this layer is on {case.device})"
        return None

    def serves(self) -> tuple[str, ...]:
        """The device types it runs on now (``devices``; the Triton backend adds CPU in tests)."""
        return self.devices

    def build(self, layer, case: LinearCase):
        """The weight this backend multiplies with, from ``layer``'s checkpoint buffers."""
        raise NotImplementedError

    def run(self, weight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` (may raise :class:`NotThese`)."""
        raise NotImplementedError

    def accepts(self, weight, x: torch.Tensor) -> bool:
        """Whether ``x`` (its device, its dtype) can go through ``weight`` (else: the reference)."""
        return True

    def holds_codes(self, weight) -> bool:
        """Whether ``weight`` keeps the codes exactly, so the layer drops its ``weight_packed``
        buffer (one packed copy in memory) and reads it back through :meth:`read_back`."""
        return False

    def read_back(self, weight, scheme: QuantScheme) -> torch.Tensor:
        """The checkpoint's ``weight_packed``, exactly, from ``weight`` (only where ``holds_codes``)."""
        raise NotImplementedError(f"the {self.name} backend's weight does not hold the codes")

    # Optional hooks, None where a backend has none:
    # self_check(layer, weight, dtype, rows, tuned) -> str | None: run against the reference, raise on a
    #   failure (runtime/selfcheck.py calls it; what failed in part is returned)
    # tune(weight, buckets, dtype) -> int: tune these row buckets now (an Engine's start-up); how many were asked
    self_check = None
    tune = None

    def __repr__(self) -> str:
        return f"<linear backend {self.name}>"


def passed_over_for(reason: str) -> bool:
    """Whether a ``Rejected`` reason is a switch (disabled, or another backend asked for by name)
    rather than a refusal of the case."""
    return reason.startswith(("disabled (", "not asked for"))


def switched_off(cpu_kernels: bool | None = None) -> frozenset[str]:
    """``runtime.backend.disabled()`` with the older ``cpu_kernels=`` argument applied: False adds
    ``cpu`` (the reference on CPU), True takes it out (the CPU kernels whatever the environment)."""
    from runtime.backend import disabled

    off = disabled()
    if cpu_kernels is None:
        return off
    return off | {"cpu"} if not cpu_kernels else off - {"cpu"}


def may_choose(tag: str, off: frozenset[str], only: str | None = None) -> bool:
    """Whether some backend carrying ``tag`` may be chosen under ``off`` and ``only`` (before any
    case is seen: ``runtime.load`` decides from it which float weights to keep in bf16)."""
    return any(tag in b.tags and not ({b.name, *b.tags} & off) and only in (None, b.name) for b in PRIORITY)


def by_name(name: str) -> LinearBackend:
    for backend in PRIORITY:
        if backend.name == name:
            return backend
    raise ValueError(f"no Linear backend named {name!r}; the backends are {', '.join(b.name for b in PRIORITY)}")


# The backends, fastest first; the reference refuses nothing. Imported here, after the interface
# they subclass.
from runtime.linear_backends.cpu_int4 import CpuInt4  # noqa: E402
from runtime.linear_backends.cpu_int8 import CpuInt8  # noqa: E402
from runtime.linear_backends.reference import Reference  # noqa: E402
from runtime.linear_backends.triton import Triton  # noqa: E402

PRIORITY: list[LinearBackend] = [
    Triton(),
    CpuInt4(),
    CpuInt8(),
    Reference(),
]
