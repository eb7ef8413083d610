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

from runtime.linear_backends.base import LinearBackend, LinearCase, NotThese  # noqa: F401 (the interface)


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
