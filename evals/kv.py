"""KV-cache quality and memory: KV-perplexity through a real cache, bytes per token, capacity.

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
from kvquant import KVScheme, bytes_per_token

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


def hf_session(model, make_cache: Callable[[], object]) -> NewSession:
    """Sessions of a transformers causal LM with the cache ``make_cache()`` returns."""

    def new_session(length: int) -> Step:
        cache = make_cache()

        @torch.inference_mode()
        def step(ids: torch.Tensor) -> torch.Tensor:
            return model(ids.to(model.device), past_key_values=cache, use_cache=True).logits

        return step

    return new_session


# -------------------------------------------------------------------- memory


@dataclass(frozen=True)
class ModelShape:
    """What a KV cache's size depends on."""

    num_layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, decoder_cfg) -> "ModelShape":
        return cls(decoder_cfg.num_layers, decoder_cfg.num_kv_heads, decoder_cfg.head_dim)


def allocated_bytes(scheme: KVScheme, shape: ModelShape, sequences: int, context: int,
                    dtype: torch.dtype = torch.float16) -> int:
    """Bytes a runtime cache for ``sequences`` x ``context`` tokens really allocates (built on the
    CPU and counted: pool, residual blocks, block table)."""
    from runtime.cache import KVCache

    cache = KVCache(shape.num_layers, sequences, shape.kv_heads, shape.head_dim, context, dtype, "cpu", scheme=scheme)
    return cache.nbytes()


def memory_row(scheme: KVScheme, shape: ModelShape, context: int, dtype: torch.dtype = torch.float16) -> dict:
    """Bytes per token of one scheme: computed from the layout, and measured on an allocated cache."""
    computed = bytes_per_token(scheme, shape.num_layers, shape.kv_heads, shape.head_dim, dtype)
    fp16 = bytes_per_token(KVScheme(), shape.num_layers, shape.kv_heads, shape.head_dim, dtype)
    measured = allocated_bytes(scheme, shape, 1, context, dtype) / context
    return {
        "scheme": scheme.name,
        "bytes_per_token": computed,
        "vs_fp16": computed / fp16,
        "measured_bytes_per_token": measured,  # includes the per-sequence residual block at this context
        "measured_context": context,
    }


def capacity(scheme: KVScheme, shape: ModelShape, budget_bytes: int, context: int,
             dtype: torch.dtype = torch.float16, measure: bool = True) -> dict:
    """How many sequences of ``context`` tokens fit in ``budget_bytes`` of KV cache.

    The count comes from one sequence's allocated bytes; with ``measure`` a cache for that many
    sequences is then allocated and counted (``measured_bytes``), to show that it fits.
    """
    per_sequence = allocated_bytes(scheme, shape, 1, context, dtype)
    sequences = budget_bytes // per_sequence
    row = {"scheme": scheme.name, "budget_bytes": budget_bytes, "context": context,
           "bytes_per_sequence": per_sequence, "sequences": int(sequences)}
    if measure and sequences:
        row["measured_bytes"] = allocated_bytes(scheme, shape, int(sequences), context, dtype)
    return row


def capacity_table(schemes: list[KVScheme], shape: ModelShape, budget_bytes: int, contexts: list[int],
                   dtype: torch.dtype = torch.float16, measure: bool = True) -> list[dict]:
    return [capacity(s, shape, budget_bytes, c, dtype, measure) for c in contexts for s in schemes]


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n} B"
