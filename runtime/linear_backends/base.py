"""The quantized-Linear backends' interface: the case a backend may refuse and the class every
backend subclasses (the package's ``__init__`` holds the priority list; the backends import this
module, not the package, so no circle of imports)."""

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
