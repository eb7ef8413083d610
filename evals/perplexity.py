"""Perplexity with a fixed, stated protocol, the same for baseline and quantized models.

Sliding windows of ``window`` tokens advance by ``stride``; each window scores
only the tokens the previous one did not, so every token after the first is
scored exactly once, with at least ``window - stride`` tokens of context once
the first window is passed.

With ``bos`` the tokenizer's BOS is prepended to each window and every token is
scored, the first of a window predicted from the BOS alone. That also allows
``stride == window``: disjoint windows that each begin as a prompt does, the
protocol of most GPTQ papers and of llm-compressor's examples. :func:`bos_for`
decides it from the tokenizer (``lowbit eval --bos auto|on|off``): ``auto``
prepends the BOS when the tokenizer adds one to what it encodes, as the model is
used (Llama, Gemma), and none when it does not (SmolLM2).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

from quant.calibration import adds_bos

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Protocol:
    window: int = 1024
    stride: int = 512
    tokens: int = 16384
    bos: bool = False

    def __post_init__(self):
        # Each window needs context before the first token it scores: the previous window's
        # tail (stride < window) or, with bos, the BOS (stride == window: disjoint windows).
        widest = self.window if self.bos else self.window - 1
        if not 0 < self.stride <= widest:
            hint = "; disjoint windows (stride = window) need the BOS first" if self.stride == self.window else ""
            raise ValueError(f"stride must be in 1..{widest} ({'at most' if self.bos else 'below'} the window), "
                             f"got {self.stride}{hint}")
        if self.tokens < 2:
            raise ValueError(f"tokens must be at least 2, got {self.tokens}")

    def describe(self) -> str:
        if self.bos and self.stride == self.window:
            return (f"disjoint windows of BOS + {self.window} tokens, first {self.tokens} tokens, "
                    f"each token scored once")
        return (
            f"sliding window {self.window}, stride {self.stride}, first {self.tokens} tokens, "
            f"{'BOS prepended to each window' if self.bos else 'no BOS'}, each token scored once"
        )

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token, in nats
    tokens_scored: int
    protocol: Protocol


BOS_MODES = ("auto", "on", "off")


def bos_for(tokenizer, mode: str = "auto") -> int | None:
    """The BOS id each window begins with, or None for no BOS: ``on``, the tokenizer's BOS; ``off``,
    none; ``auto``, the BOS when the tokenizer adds one to a prompt (``quant.calibration.adds_bos``,
    as calibration decides it)."""
    if mode not in BOS_MODES:
        raise ValueError(f"bos must be one of {', '.join(BOS_MODES)}, got {mode!r}")
    if mode == "on" and tokenizer.bos_token_id is None:
        raise ValueError("BOS 'on' needs a BOS token and this tokenizer has none; use BOS 'off' (or 'auto')")
    return tokenizer.bos_token_id if mode == "on" or (mode == "auto" and adds_bos(tokenizer)) else None


def tokenize_text(tokenizer, text: str, protocol: Protocol) -> torch.Tensor:
    """The first ``protocol.tokens`` token ids of ``text``, no special tokens added."""
    ids = tokenizer(text, add_special_tokens=False).input_ids[: protocol.tokens]
    if len(ids) < 2:
        raise ValueError("the evaluation text has fewer than 2 tokens")
    return torch.tensor(ids, dtype=torch.long)


def windows(n: int, protocol: Protocol):
    """(begin, end, first scored position) of each window over ``n`` tokens."""
    end = min(protocol.window, n)
    yield 0, end, 0 if protocol.bos else 1  # without BOS the first token has no context and is never scored
    while end < n:
        new_end = min(end + protocol.stride, n)
        disjoint = protocol.stride == protocol.window  # a short last window gets no earlier tokens either
        yield end if disjoint else max(0, new_end - protocol.window), new_end, end
        end = new_end


def perplexity(
    logits_fn: LogitsFn, token_ids: torch.Tensor, protocol: Protocol, bos_id: int | None = None, progress: bool = True
) -> PerplexityResult:
    """Perplexity of ``logits_fn`` (input_ids[1, T] -> logits[1, T, V]) on the first ``protocol.tokens`` ids.

    ``bos_id`` is needed only when ``protocol.bos`` is set (the tokenizer's BOS id, prepended to each window
    and never scored). NLL is accumulated in float64; ``tokens_scored`` is the true count (n - 1, or n with BOS).
    """
    if protocol.bos and bos_id is None:
        raise ValueError("protocol.bos is set but the tokenizer has no BOS token")
    # The protocol states how many tokens were read: longer inputs are cut here too, not only in tokenize_text.
    token_ids = token_ids.reshape(-1)[: protocol.tokens]
    n = int(token_ids.numel())
    if n < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {n}")
    spans = list(windows(n, protocol))
    nll, count = 0.0, 0
    for begin, end, first in tqdm(spans, desc="perplexity", unit="window", disable=not progress):
        ids = token_ids[begin:end]
        prefix = 1 if protocol.bos else 0
        if prefix:
            ids = torch.cat([torch.tensor([bos_id]), ids])
        logits = logits_fn(ids.unsqueeze(0))[0].double()
        # logits at position p predict token p+1; score targets first..end-1
        targets = token_ids[first:end].to(logits.device)
        preds = logits[prefix + first - begin - 1 : prefix + end - begin - 1]
        nll += float(torch.nn.functional.cross_entropy(preds, targets, reduction="sum"))
        count += int(targets.numel())
    mean = nll / count
    return PerplexityResult(math.exp(mean), mean, count, protocol)


def hf_logits_fn(model) -> LogitsFn:
    """Adapter for a transformers causal LM."""
    model.eval()

    @torch.inference_mode()
    def fn(input_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids.to(model.device)).logits.float()

    return fn
