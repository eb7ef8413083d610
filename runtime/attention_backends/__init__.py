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

from runtime.attention_backends.base import AttentionBackend, AttentionCase, Failed, case_of  # noqa: F401 (the interface)
from runtime.attention_backends.cpu_folded import CpuFolded
from runtime.attention_backends.cpu_native import CpuNative
from runtime.attention_backends.reference import Reference
from runtime.attention_backends.triton import Triton
from runtime.backend import Choice, choose, disabled, disabled_reason

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
