"""KV-cache quality: KV-perplexity through a real cache.

KV-perplexity scores the same windows and tokens as :func:`evals.perplexity.perplexity`
(same scoring code), but each window's logits come from a model that reads a
cache: the first ``prefill`` tokens of the window go in one forward, the rest in
chunks of ``chunk`` tokens, each chunk attending to the cached (quantized) keys
and values of everything before it. With an unquantized cache this reproduces the
ordinary perplexity; with a quantized one the difference is what the cache costs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch

from evals.perplexity import LogitsFn, PerplexityResult, Protocol, perplexity
from kvquant import KVScheme

# new_session(length) -> step: a fresh cache for a sequence of ``length`` tokens, and the
# function that feeds it the next chunk of ids [1, t] and returns that chunk's logits [1, t, V].
Step = Callable[[torch.Tensor], torch.Tensor]
NewSession = Callable[[int], Step]


@dataclass(frozen=True)
class ChunkProtocol:
    chunk: int = 32  # tokens per forward after the prefill
    prefill: int | None = None  # tokens of each window in the first forward (default: window - stride)

    def __post_init__(self):
        if self.chunk < 1:
            raise ValueError(f"chunk must be at least 1, got {self.chunk}")
        if self.prefill is not None and self.prefill < 1:
            raise ValueError(f"prefill must be at least 1, got {self.prefill}")

    def prefill_for(self, protocol: Protocol) -> int:
        return self.prefill or protocol.window - protocol.stride

    def describe(self, protocol: Protocol) -> str:
        return (f"each window through the KV cache: {self.prefill_for(protocol)} tokens prefilled, "
                f"then chunks of {self.chunk}")

    def to_dict(self) -> dict:
        return asdict(self)


def chunked_logits_fn(new_session: NewSession, prefill: int, chunk: int) -> LogitsFn:
    """A logits function that runs its input through a fresh cache: ``prefill`` tokens, then chunks."""

    def fn(input_ids: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        step = new_session(n)
        bounds = [0, *range(min(prefill, n), n, chunk), n]
        return torch.cat([step(input_ids[:, a:b]).float() for a, b in zip(bounds, bounds[1:]) if b > a], dim=1)

    return fn


def kv_perplexity(new_session: NewSession, token_ids: torch.Tensor, protocol: Protocol,
                  chunks: ChunkProtocol = ChunkProtocol(), bos_id: int | None = None,
                  progress: bool = True) -> PerplexityResult:
    """Perplexity with logits from a model reading its KV cache, on the windows ``protocol`` defines."""
    fn = chunked_logits_fn(new_session, chunks.prefill_for(protocol), chunks.chunk)
    return perplexity(fn, token_ids, protocol, bos_id=bos_id, progress=progress)


def runtime_session(model, scheme: KVScheme) -> NewSession:
    """Sessions of a :class:`runtime.Model` with a ``scheme`` cache."""

    def new_session(length: int) -> Step:
        cache = model.new_cache(length, scheme=scheme)
        position = 0

        @torch.inference_mode()
        def step(ids: torch.Tensor) -> torch.Tensor:
            nonlocal position
            logits = model.decoder(ids.to(model.device), cache, position)
            position += ids.shape[1]
            return logits

        return step

    return new_session
