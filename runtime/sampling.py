"""Sampling: the parameters a request carries, checked once, and the one sampling function.

``sample`` turns the last position's logits into a token id: greedy at temperature 0,
otherwise temperature, then top-k, then top-p (nucleus), then a draw from a CPU
generator, so a seed gives the same tokens on any device and in any batch.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_temperature(temperature) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not (
            math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")


def _check_top_p(top_p) -> None:
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int = 0) -> None:
    """ValueError naming the first bad argument (the plain runtime's ``generate`` arguments)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens!r}")
    _check_temperature(temperature)
    _check_top_p(top_p)
    _check_int("top_k", top_k, 0)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. Checked on construction: a bad value is a ValueError naming it.

    ``top_k`` 0 and ``top_p`` 1 switch those filters off; ``temperature`` 0 is greedy.
    ``stop`` strings end the output before them (the text never shows them);
    ``stop_token_ids`` and, unless ``ignore_eos``, the model's EOS ids end it without being output.
    ``seed`` makes sampled output reproducible, whatever else runs in the batch.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        _check_int("max_tokens", self.max_tokens, 1)
        _check_temperature(self.temperature)
        _check_int("top_k", self.top_k, 0)
        _check_top_p(self.top_p)
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
            if self.seed >= 2 ** 64:  # what a torch.Generator takes
                raise ValueError(f"seed must be below 2**64, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        ids = tuple(self.stop_token_ids)
        for i in ids:
            _check_int("stop_token_ids entries", i, 0)
        object.__setattr__(self, "stop", stop)  # frozen: lists given by the caller become tuples
        object.__setattr__(self, "stop_token_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None,
           top_k: int = 0) -> int:
    """One token id from the last position's logits [V]."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        outside = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p[outside] = 0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    # Sample on the CPU with a CPU generator: the same seed gives the same tokens on any device.
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def sample_params(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    return sample(logits, params.temperature, params.top_p, generator, params.top_k)
