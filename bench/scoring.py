"""Scoring shared by the calibrated-method benchmarks (lowbit's side and the peers').

Both sides score on the same tokens with the same protocol, so their numbers
sit in one table. Run from the repository root (``PYTHONPATH=.``).
"""

from __future__ import annotations

import resource
from pathlib import Path

from evals.perplexity import Protocol, perplexity, tokenize_text
from evals.provenance import commit  # noqa: F401  (the benches' one definition)
from evals.texts import load_text

ROOT = Path(__file__).resolve().parent.parent

# (bundled text, tokens scored): Persuasion is the main protocol; Python source is a
# genre the Austen calibration text has nothing like.
TEXTS = {"persuasion": 16384, "code": 8192}


def protocols() -> dict[str, Protocol]:
    return {name: Protocol(tokens=tokens) for name, tokens in TEXTS.items()}


def score_texts(logits_fn, tokenizer) -> dict[str, dict]:
    """Perplexity on each bundled text, with the protocol that produced it."""
    out = {}
    for name, protocol in protocols().items():
        ids = tokenize_text(tokenizer, load_text(name), protocol)
        out[name] = {"ppl": perplexity(logits_fn, ids, protocol, progress=False).ppl,
                     "protocol": protocol.describe()}
    return out


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
