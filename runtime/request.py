"""A request to the serving engine: its tokens, its sampler state, its stream and its metrics."""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from runtime.generate import TextStream, Token
from runtime.sampling import SamplingParams


@dataclass
class RequestMetrics:
    """Times in seconds from the request's arrival (``submit``)."""

    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None  # arrival to first token
    itl_s: list[float] = field(default_factory=list)  # gaps between later tokens
    e2e_s: float | None = None  # arrival to finish
    preemptions: int = 0

    @property
    def mean_itl_s(self) -> float | None:
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else None

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens over the request's whole time in the engine (queueing included)."""
        return self.output_tokens / self.e2e_s if self.e2e_s else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time after the first: the rate this request streamed at."""
        span = sum(self.itl_s)
        return len(self.itl_s) / span if span > 0 else None

    def to_dict(self) -> dict:
        return dict(prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens, ttft_s=self.ttft_s,
                    mean_itl_s=self.mean_itl_s, e2e_s=self.e2e_s, tokens_per_s=self.tokens_per_s,
                    decode_tokens_per_s=self.decode_tokens_per_s, preemptions=self.preemptions)


class Request:
    """One request: iterate it to stream its :class:`Token` s (iterating drives the engine).

    ``output_ids``, ``text``, ``finish_reason`` ("stop": EOS, a stop id or a stop string;
    "length": ``max_tokens`` or the context; "abort": ``Engine.abort`` or ``shutdown``) and
    ``metrics`` fill in as it runs. Iterating steps the engine, so only the thread that drives
    the engine may iterate; another thread streams through ``submit``'s ``on_token``.
    """

    def __init__(self, engine: "Engine", request_id: int, prompt_ids: list[int], params: SamplingParams,
                 total: int, on_token=None):
        self.engine, self.id, self.prompt_ids, self.params = engine, request_id, prompt_ids, params
        self.total = total  # positions it may reach: prompt + max_tokens, within the context
        self.on_token = on_token  # called on the engine's thread: each Token, then None at the end
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self.metrics = RequestMetrics(prompt_tokens=len(prompt_ids))
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.stream = TextStream(engine.model.tokenizer, params.stop)
        self.arrival = time.perf_counter()
        self._last_token_at: float | None = None
        self._pending: collections.deque[Token] = collections.deque()
        self.slot: int | None = None  # its cache row while it runs
        self.computed = 0  # positions its cache holds

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.stream.text

    @property
    def tokens(self) -> list[int]:
        """What the model reads: the prompt, then every output token (a new list: the engine's
        per-step reads take :attr:`token_count` and :meth:`token_at`, which copy nothing)."""
        return self.prompt_ids + self.output_ids

    @property
    def token_count(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        """``tokens[i]`` (0 <= i < token_count)."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def __iter__(self):
        while True:
            while self._pending:
                yield self._pending.popleft()
            if self.finished:
                return
            self.engine.step()

    def record(self, token: int, eos_ids, now: float) -> str | None:
        """Take one sampled token (the engine's thread): time it, stream it, and return the
        finish reason it causes, if any. EOS and stop ids end the request without being output."""
        m = self.metrics
        if m.ttft_s is None:
            m.ttft_s = now - self.arrival
        else:
            m.itl_s.append(now - self._last_token_at)
        self._last_token_at = now
        if (token in eos_ids and not self.params.ignore_eos) or token in self.params.stop_token_ids:
            return "stop"
        self.output_ids.append(token)
        m.output_tokens += 1
        # as runtime.generate: the cache may fill up to ``total`` positions; the last token is not stored
        done = len(self.output_ids) >= self.params.max_tokens or self.computed >= self.total
        piece = self.stream.push(self.output_ids, done)
        self._pending.append(Token(token, piece, now - self.arrival))
        if self.on_token is not None:
            self.on_token(self._pending[-1])
        if self.stream.stopped:
            return "stop"
        return "length" if done else None

    def end(self, reason: str, now: float) -> None:
        """Close the stream (the engine's thread calls it): the reason, the end-to-end time, and
        ``on_token(None)``."""
        self.finish_reason = reason
        self.metrics.e2e_s = now - self.arrival
        if self.on_token is not None:
            self.on_token(None)

    def result(self) -> "Request":
        """Run the engine until this request finishes; returns it."""
        for _ in self:
            pass
        return self

    def __repr__(self) -> str:
        state = self.finish_reason or ("running" if self.slot is not None else "waiting")
        return f"Request(id={self.id}, prompt={len(self.prompt_ids)} tokens, output={len(self.output_ids)}, {state})"


class Inbox:
    """What other threads hand the engine (("submit", Request), ("abort", id)), kept in order
    for the engine's thread to apply at its next step; ``wait`` sleeps until something comes."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._arrived = threading.Event()

    def put(self, kind: str, item) -> None:
        self._queue.put((kind, item))
        self._arrived.set()

    def drain(self):
        """Yield everything queued so far, oldest first."""
        self._arrived.clear()  # before reading: a later put sets it again
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return

    def wait(self, timeout: float | None) -> None:
        self._arrived.wait(timeout)

    def __len__(self) -> int:
        return self._queue.qsize()
