"""The decode-attention backends' interface: the case a backend may refuse and the class every
backend subclasses (the package's ``__init__`` holds the priority list and the chooser; the backends
import this module, not the package, so no circle of imports)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvquant import KVScheme
from kvquant.quantize import layout


@dataclass(frozen=True)
class AttentionCase:
    """What a backend may refuse: the cache scheme and its layout, the model's shape and dtype
    (the queries' and the cache's floats), the device type, and what the model's attention does."""

    scheme: KVScheme
    head_dim: int
    dtype: torch.dtype
    device: str  # the device type: "cuda", "cpu"
    softcap: bool = False  # attention-logit soft-capping (Gemma 2)
    sliding: bool = False  # some layer attends over a sliding window
    interpret: bool = False  # on CPU: the Triton kernels in the interpreter were asked for (tests; never "auto")

    @functools.cached_property
    def data_dtype(self) -> torch.dtype:
        """How the pool stores a block's codes or floats (``kvquant.quantize.layout``)."""
        return layout(self.scheme, self.head_dim, self.dtype, True)["data"][1]


def case_of(scheme: KVScheme, head_dim: int, dtype: torch.dtype, device, softcap: bool = False,
            sliding: bool = False, interpret: bool = False) -> AttentionCase:
    return AttentionCase(scheme, head_dim, dtype, torch.device(device).type, softcap, sliding, interpret)


class AttentionBackend:
    """The interface (``runtime.backend.Backend`` plus decode attention's parts)."""

    name: str = ""
    tags: frozenset[str] = frozenset()  # group words of LOWBIT_DISABLE that also switch it off
    in_place = False  # the cache's writes and a prefill chunk's read-back run on its own ops too
    on_codes = False  # a decode step: one decode() per layer (else the batch's read-back + SDPA)

    def refuses(self, case: AttentionCase) -> str | None:
        raise NotImplementedError

    def __deepcopy__(self, memo):  # one object per backend (a copied model shares it; cpu-native holds a module)
        return self

    def decode(self, paged, q: torch.Tensor, lengths: list[int], window: int | None = None,
               softcap: float | None = None, step: dict | None = None) -> torch.Tensor:
        """Attention of one new token per sequence over one layer of the paged cache, the new
        token already stored: ``paged`` a ``runtime.kernels.kv_reference.PagedKV`` of the batch's
        rows, ``q`` [S, Hq, 1, D], ``lengths[i]`` the positions sequence ``i`` holds (the new one
        included), ``window`` the layer's sliding window, ``softcap`` Gemma 2's, ``step`` a dict
        that lives one decode step (what every layer of it shares). [S, Hq, 1, D] in q's dtype."""
        raise NotImplementedError

    def check(self, case: AttentionCase) -> None:
        """The self-check: decode steps over a small cache of ``case`` against the reference
        backend, within ``runtime.tolerances`` (raises ``Mismatch``)."""
        from runtime.attention_backends.checks import check_against_reference

        check_against_reference(self, case)


class Failed(AttentionBackend):
    """A backend that failed its self-check, passed over with what failed (the chooser keeps the
    reason in its place in the priority list)."""

    def __init__(self, backend: AttentionBackend, reason: str):
        self.backend, self.reason = backend, reason
        self.name, self.tags = backend.name, backend.tags

    def refuses(self, case: AttentionCase) -> str | None:
        return self.reason
