"""Sampling and streaming generation with per-request timing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class Token:
    id: int
    text: str  # the new piece of decoded text this token completes (may be empty)
    t: float  # seconds since the request started


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """One token id from the last position's logits [V]."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        outside = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p[outside] = 0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    # Sample on the CPU with a CPU generator: the same seed gives the same tokens on any device.
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@dataclass
class Generation:
    """An iterable over generated tokens; timing fields fill in as it runs.

    ``ttft_s``: from the start of iteration (the prompt is submitted) to the first
    token; ``itl_s``: the gaps between later tokens. Iterating again starts over.
    """

    model: object
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_at_eos: bool = True
    ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)

    @property
    def mean_itl_s(self) -> float:
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else 0.0

    @property
    def text(self) -> str:
        return self._decode(self.ids)

    def _decode(self, ids: list[int]) -> str:
        tok = self.model.tokenizer
        return "" if tok is None else tok.decode(ids, skip_special_tokens=True)

    def __iter__(self):
        m = self.model
        self.ids, self.ttft_s, self.itl_s = [], None, []
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(self.seed) if self.seed is not None else None
        total = min(len(self.prompt_ids) + self.max_new_tokens, m.max_positions)
        cache = m.new_cache(total)  # quantized as the model's kv_scheme says
        eos = set(m.eos_token_ids) if self.stop_at_eos else set()

        # Prefill: the whole prompt in one forward; then one token per step through the cache.
        inputs = torch.tensor([self.prompt_ids], device=m.device)
        pos, text, last = 0, "", start
        while True:
            with torch.inference_mode():
                logits = m.decoder(inputs, cache, pos)[0, -1]
            pos += inputs.shape[1]
            token = sample(logits, self.temperature, self.top_p, generator)
            now = time.perf_counter()
            if self.ttft_s is None:
                self.ttft_s = now - start
            else:
                self.itl_s.append(now - last)
            last = now
            self.ids.append(token)
            if token in eos:
                return
            done = len(self.ids) >= self.max_new_tokens or pos >= total
            # Decode the whole sequence and diff: a token can end mid-character (byte-level BPE),
            # so hold an incomplete multi-byte character back until a later token completes it.
            full = self._decode(self.ids)
            piece = "" if full.endswith("\ufffd") and not done else full[len(text):]
            text += piece
            yield Token(token, piece, now - start)
            if done:
                return
            inputs = torch.tensor([[token]], device=m.device)
