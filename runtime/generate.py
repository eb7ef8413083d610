"""Sampling and streaming generation with per-request timing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from runtime.sampling import sample


def check_prompt(prompt, tokenizer, vocab_size: int, max_len: int, source, context: str) -> list[int]:
    """A prompt (text, or token ids) as token ids, or a ValueError naming what is wrong with it.
    ``source`` names the model (for a missing tokenizer), ``context`` the length limit."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{source} has no tokenizer: pass the prompt as a list of token ids")
        ids = tokenizer(prompt).input_ids
    else:
        ids = [int(i) for i in prompt]
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) > max_len:
        raise ValueError(f"the prompt has {len(ids)} tokens, longer than {context} ({max_len})")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (size {vocab_size})")
    return ids


def prefill_chunks(start: int, end: int, chunk: int | None) -> list[tuple[int, int]]:
    """Positions ``start .. end`` cut at the multiples of ``chunk`` (None: one piece). The cuts
    depend on the positions alone, never on what else runs: a quantized cache makes a later chunk
    read earlier ones through the quantizer, so where the cuts fall is part of the result."""
    if chunk is None:
        return [(start, end)] if end > start else []
    cuts = [start, *range((start // chunk + 1) * chunk, end, chunk), end]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


@dataclass
class Token:
    id: int
    text: str  # the new piece of decoded text this token completes (may be empty)
    t: float  # seconds since the request started


class TextStream:
    """Incremental detokenization: the new text each token completes, for streaming.

    Diffs the decoded output against what was already given out: a token can end mid-character
    (byte-level BPE), so an incomplete multi-byte character is held back until a later token
    completes it. With ``stop`` strings, text that could be the start of one is held back too, and
    the output ends before the first one that appears (``stopped``).

    The output's text is the decoded text of the ids up to a settled point (where it ended on a
    whole character) plus a short window of ids decoded with the ids before it as context (as
    vLLM's detokenizer does), not the whole output decoded again for every token: that cost
    grows with the output (SmolLM2's tokenizer: 0.25 ms at 512 tokens, 1.2 ms at 2,048, per
    sequence and step). Where the window's text does not extend its context's, the whole output
    is decoded.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.text = ""  # given out so far
        self.stopped = False
        self._settled, self._context, self._read = "", 0, 0  # decode(ids[:_read]); the window's first id

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def full_text(self, ids: list[int]) -> str:
        """``decode(ids)``, from the settled text and the window ``ids[_context:]``."""
        context, window = self.decode(ids[self._context:self._read]), self.decode(ids[self._context:])
        # the context must give text (special tokens alone give none: a SentencePiece decode would
        # then drop the window's first space) that the window's text extends
        trusted = not self._context or (context and window.startswith(context))
        full = self._settled + window[len(context):] if trusted else self.decode(ids)
        if not full.endswith("\ufffd"):  # a whole character: the next window starts after these ids
            self._settled, self._context, self._read = full, self._read, len(ids)
        return full

    def push(self, ids: list[int], done: bool) -> str:
        """The next piece of text, given all output ``ids`` so far (``done``: no more will come)."""
        full = self.full_text(ids)
        cut = self._stop_at(full)
        if cut is not None:
            self.stopped = True
            full, done = full[:cut], True
        end = len(full)
        if not done:
            if full.endswith("\ufffd"):
                end = len(self.text)
            end = min(end, len(full) - self._partial_stop(full))
        piece = full[len(self.text):max(end, len(self.text))]
        self.text += piece
        return piece

    def _stop_at(self, full: str) -> int | None:
        # a stop string cannot start in text already given out (it was held back), so search the rest
        found = [i for i in (full.find(s, len(self.text)) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _partial_stop(self, full: str) -> int:
        """Length of the longest end of ``full`` that begins some stop string."""
        return max((n for s in self.stop for n in range(min(len(s) - 1, len(full)), 0, -1)
                    if full.endswith(s[:n])), default=0)


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
    prefill_chunk: int | None = None  # prompt tokens per prefill forward (None: the whole prompt in one)
    ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)

    @property
    def mean_itl_s(self) -> float:
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else 0.0

    @property
    def text(self) -> str:
        return TextStream(self.model.tokenizer).decode(self.ids)

    def __iter__(self):
        m = self.model
        self.ids, self.ttft_s, self.itl_s = [], None, []
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(self.seed) if self.seed is not None else None
        total = min(len(self.prompt_ids) + self.max_new_tokens, m.max_positions)
        eos = set(m.eos_token_ids) if self.stop_at_eos else set()
        stream = TextStream(m.tokenizer)
        steps = SequenceSteps(m, total)

        # Prefill: the whole prompt in one forward (or chunks); then one token per step through the cache.
        for a, b in prefill_chunks(0, len(self.prompt_ids), self.prefill_chunk):
            logits = steps.prefill(self.prompt_ids[a:b])
        last = start
        while True:
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
            done = len(self.ids) >= self.max_new_tokens or steps.position >= total
            yield Token(token, stream.push(self.ids, done), now - start)
            if done:
                return
            logits = steps.decode(token)


class SequenceSteps:
    """One sequence's forwards through the engine's step code (``runtime.execution.Executor``):
    its prefill chunks as a packed batch of one, its decode steps as a decode batch of one, so
    ``Model.generate`` launches what the engine launches and computes what it computes. Blocks
    are reserved on the host as positions fill them; no host sync but the sampler's read."""

    def __init__(self, model, total: int):
        from runtime.attention import engine_attention
        from runtime.execution import Executor

        self.cache = model.new_cache(total, lockstep=False)  # quantized as the model's kv_scheme says
        self.slot = self.cache.add_sequence()
        # the attention backend as an Engine over this cache chooses it (runtime.attention's one seam)
        # (the model's own request, e.g. "triton": an error now where that backend cannot run this cache)
        attention = engine_attention(model.decoder, self.cache.scheme, self.cache.dtype, self.cache.device,
                                     model.decoder.attention_asked)
        self.executor = Executor(model.decoder, self.cache, attention.backend)
        self.position = 0

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [V] of the last of ``token_ids``, placed at the next positions."""
        self.cache.reserve(self.slot, self.position + len(token_ids))
        logits = self.executor.prefill([self.slot], [self.position], [token_ids])[0]
        self._advance(len(token_ids))
        return logits

    def decode(self, token: int) -> torch.Tensor:
        """Logits [V] after ``token`` at the next position."""
        if (self.position + 1) % self.cache.block_size == 0:  # a block fills: its id, decided on the host
            self.cache.reserve(self.slot, self.position + 1)
        logits = self.executor.decode([token], [self.position])[0]
        self._advance(1)
        return logits

    def _advance(self, count: int) -> None:
        self.cache.advance(self.slot, count)
        self.position += count
