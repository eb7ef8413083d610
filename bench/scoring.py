"""Scoring shared by the calibrated-method benchmarks (lowbit's side and the peers').

Both sides score on the same tokens with the same protocols, so their numbers
sit in one table. Run from the repository root (``PYTHONPATH=.``).

Two protocols, every row scored on both: a method that only wins on the
protocol it was tuned on has not won (issue 17 §0).
- ``sliding``: windows of 1,024 tokens advancing by 512, no BOS (lowbit's own).
- ``bos``: disjoint windows of 512 positions, the tokenizer's BOS then 511 tokens,
  each begun as a prompt is (most GPTQ papers' and llm-compressor's examples'
  protocol; issue 17's independent harness, whose float SmolLM2 perplexity on
  64 such windows of Persuasion, 35.861, this reproduces).
"""

from __future__ import annotations

import resource
from pathlib import Path

from evals.perplexity import Protocol, bos_for, perplexity, tokenize_text
from evals.provenance import commit  # noqa: F401  (the benches' one definition)
from evals.texts import load_text

ROOT = Path(__file__).resolve().parent.parent

# (bundled text, tokens scored): Persuasion is the main text; Python source is a
# genre the Austen calibration text has nothing like.
TEXTS = {"persuasion": 16384, "code": 8192}
PROTOCOLS = {"sliding": {"window": 1024, "stride": 512}, "bos": {"window": 511, "stride": 511, "bos": True}}


def protocols(name: str, texts: dict[str, int] = TEXTS) -> dict[str, Protocol]:
    """The protocol ``name`` for each bundled text, scoring its first ``texts[text]`` tokens."""
    return {text: Protocol(tokens=tokens, **PROTOCOLS[name]) for text, tokens in texts.items()}


def parse_texts(specs: list[str]) -> dict[str, int]:
    """``["persuasion=8192", "code=4096"]`` -> {"persuasion": 8192, "code": 4096}: fewer tokens on a busy machine."""
    texts = {}
    for spec in specs:
        name, _, tokens = spec.partition("=")
        if name not in TEXTS or not tokens.isdigit():
            raise SystemExit(f"--texts {spec}: expected TEXT=TOKENS with TEXT one of {', '.join(TEXTS)}")
        texts[name] = int(tokens)
    return texts


def score_texts(logits_fn, tokenizer, texts: dict[str, int] = TEXTS) -> dict[str, dict[str, dict]]:
    """Perplexity on each bundled text under each protocol: {protocol: {text: {ppl, protocol}}}."""
    out = {}
    for name in PROTOCOLS:
        out[name] = {}
        for text, protocol in protocols(name, texts).items():
            bos_id = bos_for(tokenizer, "on" if protocol.bos else "off")  # the protocol's own choice
            ids = tokenize_text(tokenizer, load_text(text), protocol)
            result = perplexity(logits_fn, ids, protocol, bos_id=bos_id, progress=False)
            out[name][text] = {"ppl": result.ppl, "protocol": protocol.describe()}
    return out


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
