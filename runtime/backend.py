"""The one seam for kernel backends: a priority list and one chooser that says why each candidate
was refused (as vLLM chooses its kernels).

A backend is an object with a ``name`` and ``refuses(case) -> str | None``: why it cannot run the
case (a layer's scheme and shape, the device, the activation dtype, what this CPU has), None when
it can. Each domain (quantized Linears: ``runtime/linear_backends/``, decode attention:
``runtime/attention_backends/``) defines its case, the rest of its backends' interface (build the
weight from the checkpoint's buffers, call, exact read-back, self-check, optional tuning) and its
priority list, fastest first, ending in a reference that refuses nothing. :func:`choose` walks the
list: the first backend that is neither disabled nor refuses the case is chosen, and every one
passed over is kept with its reason, which ``lowbit doctor``, the self-check and the tests read.

Backends are switched off by name in one list, ``LOWBIT_DISABLE`` (comma-separated; ``native``
stands for every backend built on lowbit's C++ CPU kernels, ``cpu`` for every CPU kernel backend:
the older switches ``LOWBIT_NATIVE=0`` and ``LOWBIT_CPU_KERNELS=0`` read as those two words).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

DISABLE_ENV = "LOWBIT_DISABLE"
# the older switches, each the same as a word in LOWBIT_DISABLE
LEGACY_SWITCHES = {"LOWBIT_NATIVE": "native", "LOWBIT_CPU_KERNELS": "cpu"}


class Backend(Protocol):
    name: str
    tags: frozenset[str]  # the group words that also disable it ("native", "cpu", "triton")

    def refuses(self, case: Any) -> str | None:
        """Why this backend cannot run ``case``, or None when it can."""


@dataclass(frozen=True)
class Rejected:
    name: str
    reason: str


@dataclass(frozen=True)
class Choice:
    """The chosen backend and every one passed over before it, with its reason."""

    backend: Any
    rejected: tuple[Rejected, ...] = ()

    @property
    def name(self) -> str:
        return self.backend.name

    def explain(self) -> str:
        """One line: the chosen backend, then each refused one and why."""
        refused = "; ".join(f"{r.name}: {r.reason}" for r in self.rejected)
        return self.name + (f" (passed over: {refused})" if refused else "")


class NoBackend(RuntimeError):
    """No backend of a priority list runs a case (only when the reference was disabled or refused)."""


def disabled(environ: dict | None = None) -> frozenset[str]:
    """The backend names and group words switched off by ``LOWBIT_DISABLE`` and the older switches."""
    env = os.environ if environ is None else environ
    words = {w.strip() for w in env.get(DISABLE_ENV, "").split(",") if w.strip()}
    words |= {word for var, word in LEGACY_SWITCHES.items() if env.get(var) == "0"}
    return frozenset(words)


def disabled_reason(backend: Backend, off: Iterable[str]) -> str | None:
    """Why ``backend`` is switched off (its name or one of its group words in ``off``), or None."""
    hit = sorted({backend.name, *getattr(backend, "tags", ())} & set(off))
    return f"disabled ({DISABLE_ENV} names {', '.join(hit)})" if hit else None


def choose(priority: Sequence[Backend], case: Any, off: Iterable[str] | None = None,
           only: str | None = None) -> Choice:
    """The first backend of ``priority`` that is not switched off and does not refuse ``case``.

    ``off``: names and group words switched off (default: :func:`disabled`). ``only``: a backend's
    name; every other is passed over ("not asked for"), as tests and benches pick one by name.
    Raises :class:`NoBackend`, naming every reason, when none runs the case."""
    off = disabled() if off is None else frozenset(off)
    known = [b.name for b in priority]
    if only is not None and only not in known:
        raise ValueError(f"no backend named {only!r}; the backends are {', '.join(known)}")
    rejected = []
    for backend in priority:
        if only is not None and backend.name != only:
            reason = f"not asked for (only {only!r})"
        else:
            reason = disabled_reason(backend, off) or backend.refuses(case)
        if reason is None:
            return Choice(backend, tuple(rejected))
        rejected.append(Rejected(backend.name, reason))
    raise NoBackend("no backend runs this case: " + "; ".join(f"{r.name}: {r.reason}" for r in rejected))
