"""The closest known names to a mistyped one: the "did you mean" of every registry and checker
(quantization methods, KV-cache families, recipe keys, lm-eval tasks). A leaf module: the rooms
above (kvquant, runtime, evals, lowbit) may all read it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def close_names(name, known: Iterable[str], n: int = 1) -> list[str]:
    """Up to ``n`` of ``known`` close to ``name`` (difflib's ratio of at least 0.6), closest first."""
    return difflib.get_close_matches(str(name), list(known), n=n)


def did_you_mean(name, known: Iterable[str], otherwise: str = "") -> str:
    """`` (did you mean 'x'?)`` for the closest of ``known`` to ``name``; ``otherwise`` when none is close."""
    close = close_names(name, known)
    return f" (did you mean {close[0]!r}?)" if close else otherwise
