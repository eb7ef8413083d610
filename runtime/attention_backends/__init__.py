"""Decode attention's backends behind one seam (issue 42, item 1): a backend is one file here and
one entry in :data:`PRIORITY`, chosen by ``runtime.backend.choose``.

A backend answers for an :class:`AttentionCase` (the KV scheme and its layout, head_dim, the model
dtype, the device, soft-capping, sliding windows): ``refuses(case)`` says why it cannot run it
(None: it can), ``decode(paged, q, lengths, ...)`` attends one new token per sequence over one
layer of the paged cache, and ``check(case)`` is its self-check against the reference. Two flags
say how the batches (``runtime/attention.py``) use it: ``in_place`` (it writes the cache and reads
it back for prefill chunks through its own ops too: the Triton kernels), ``on_codes`` (a decode
step is one ``decode`` call per layer over what the cache stores; otherwise the batch stores,
reads back dequantized and runs SDPA per sequence, the reference path).

The choice is made once: per model and cache scheme (``runtime.attention.model_attention``: at
load by ``runtime.load.prepare``, and for a ``LockstepCache`` of another scheme at its first
forward) and per Engine whose scheme or request differs (``runtime.attention.engine_attention``).
What reads it: the batches, the self-check (``runtime/selfcheck_cases.attention_config``),
``lowbit doctor`` and the tests, which pick a backend by name (:func:`backend_named`, or
``choose_attention(case, asked=name)``). ``LOWBIT_DISABLE`` switches backends off by name or group
word (``LOWBIT_NATIVE=0``: ``native``, the ``cpu-native`` backend).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvquant import KVScheme
from kvquant.quantize import layout
from runtime.backend import Choice, choose, disabled, disabled_reason


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


from runtime.attention_backends.cpu_folded import CpuFolded  # noqa: E402 (the backends subclass the above)
from runtime.attention_backends.cpu_native import CpuNative  # noqa: E402
from runtime.attention_backends.reference import Reference  # noqa: E402
from runtime.attention_backends.triton import Triton  # noqa: E402

TRITON, CPU_NATIVE, CPU_FOLDED, REFERENCE = Triton(), CpuNative(), CpuFolded(), Reference()
# fastest first, ending in the reference, which refuses nothing
PRIORITY: list[AttentionBackend] = [TRITON, CPU_NATIVE, CPU_FOLDED, REFERENCE]


def backend_named(name: str) -> AttentionBackend:
    """The backend of :data:`PRIORITY` called ``name`` (a ValueError naming them all otherwise)."""
    for backend in PRIORITY:
        if backend.name == name:
            return backend
    raise ValueError(f"no attention backend named {name!r}; the backends are "
                     f"{', '.join(b.name for b in PRIORITY)} (or 'auto')")


def choose_attention(case: AttentionCase, asked: str = "auto", failed: dict[str, str] | None = None,
                     off=None) -> Choice:
    """The backend for ``case``: the first of :data:`PRIORITY` that is not switched off
    (``off``, default ``LOWBIT_DISABLE``), has not failed its self-check (``failed``: name ->
    what failed) and does not refuse the case, with every one passed over and why. ``asked``: a
    backend's name runs only that one, and a reason it cannot is a ValueError naming it."""
    if asked != "auto":
        backend_named(asked)
    priority = [Failed(b, f"self-check failed: {failed[b.name]}") if failed and b.name in failed else b
                for b in PRIORITY]
    if asked == "auto":
        return choose(priority, case, off)
    off = disabled() if off is None else frozenset(off)
    backend = next(b for b in priority if b.name == asked)
    reason = disabled_reason(backend, off) or backend.refuses(case)
    if reason is not None:  # asked for by name: no fallback
        raise ValueError(f"KV cache {case.scheme.name}: {reason}")
    return choose(priority, case, off, only=asked)
