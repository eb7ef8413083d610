"""The serving engine: continuous batching over a paged, quantized KV cache.

>>> engine = Engine(model, kv_memory="2GB")
>>> req = engine.submit(prompt_ids, SamplingParams(max_tokens=64, temperature=0.7, seed=1))
>>> for token in req:              # streams; drives the engine, so other requests advance too
...     print(token.text, end="")
>>> req.metrics.ttft_s, engine.stats()["throughput_tokens_per_s"]

Each :meth:`Engine.step`:

1. admits waiting requests (oldest first) while a cache slot is free and the pool has the
   blocks for their tokens so far;
2. prefills: up to ``prefill_chunk`` prompt tokens per step, the chunks of several sequences
   packed into one forward (``attention.PackedBatch``), a long prompt in several chunks over
   several steps (so running sequences keep decoding), cut at the multiples of
   ``prefill_chunk`` whatever else runs (``generate.prefill_chunks``); logits of each
   sequence's last token only;
3. decodes: one forward for every sequence that was already decoding, each at its own
   position, then samples one token per sequence. The scheduler decides on host mirrors
   (block table, lengths, free blocks), reserves a block only when a sequence crosses into
   one, and sends the step's inputs in one copy: no host-device sync but the read of the
   sampled tokens (``tests/test_engine.py`` counts them, ``lowbit_testing/counting.py``);

and requests leave as soon as they finish, freeing their blocks for the next ones.

The KV cache is allocated once from a byte budget: ``max_batch`` slots (each holds its
sequence's unquantized residual block) and as many pool blocks as the rest of the budget
buys, so how many tokens, and so how many concurrent sequences, fit follows from the KV
scheme (an INT4 block, groups of 64 over head_dim 128, costs 28% of an fp16 one). The cache
never grows after start-up: a full cache makes requests wait, or preempts the newest running one
(recomputed later with the same output, ``runtime/scheduler.py``); it does not run out of memory.

Attention goes through ``runtime/attention.py`` (backend chosen once at start-up, by default
the model's), so a request gets the plain runtime's computation and its greedy output is
``model.generate``'s with the same ``prefill_chunk`` (tested on CPU and through the kernels in
the Triton interpreter). The engine is a loop over three parts, a file each: requests
(``runtime/request.py``), scheduling on the host (``runtime/scheduler.py``: admission, prefill
chunks, block reservations, preemption) and execution (``runtime/execution.py``: the forwards,
their inputs, CUDA graphs, sampling).
"""

from __future__ import annotations

import collections
import itertools
import time

from kvquant import KVScheme, parse_kv
from runtime.attention import engine_attention
from runtime.cache import KVCache, cache_size
from runtime.execution import Executor, sample_tokens, tuning_buckets, warm_matmul_tuning
from runtime.generate import check_prompt
from runtime.request import Inbox, Request, RequestMetrics  # noqa: F401 (RequestMetrics: part of the API)
from runtime.sampling import SamplingParams
from runtime.scheduler import Scheduler
from runtime.selfcheck import check_engine, checked_capture


class EngineClosedError(RuntimeError):
    """The engine was shut down: it takes no requests and runs no steps."""


# --------------------------------------------------------------------------------- engine


class Engine:
    """Continuous batching over one loaded :class:`runtime.Model` (see the module docstring).

    ``kv_memory``: bytes for the KV cache (int or ``"2GB"``); default: room for ``max_batch``
    sequences of ``max_len`` tokens. ``max_batch``: the most sequences running at once (cache
    slots). ``max_len``: the longest sequence, prompt and output (default and upper bound: the
    model's context). ``kv``: the cache scheme (default: the model's). ``prefill_chunk``: prompt
    tokens prefilled per step. ``attention``: ``auto`` or a backend's name (``runtime.attention.engine_attention``;
    ``stats()["attention_backend"]`` names the one chosen). ``cuda_graphs``: capture
    the decode step per batch-size bucket (CUDA with the attention kernels only; default on there).
    ``tune_rows``: the row counts the steps will take (decode batch sizes, packed prefill lengths),
    whose GEMM buckets alone are tuned and self-checked at start-up (CUDA); default: every bucket up
    to ``max(max_batch, prefill_chunk)`` (24 a Linear shape at 4096). A step with other rows tunes
    its bucket when it first meets it (a stall in that step): ``execution.tuning_buckets``.

    Threads: one thread drives it (``step``, ``run``, iterating a request, ``shutdown``).
    ``submit`` and ``abort`` are safe from any thread: they only queue, and the driving thread
    applies them, in order, at the start of its next ``step``. A server runs
    ``while ...: engine.wait_for_work(0.1) and engine.step()`` in its engine thread, submits with
    ``on_token`` (called on the engine thread with each :class:`Token`, then ``None`` when the
    request ends) and calls ``abort`` when a client goes away.
    """

    def __init__(self, model, kv_memory=None, max_batch: int = 32, max_len: int | None = None,
                 kv: KVScheme | str | None = None, prefill_chunk: int = 512, attention: str = "auto",
                 cuda_graphs: bool | None = None, tune_rows=None):
        cfg = model.decoder.cfg
        for name, value in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        max_len = model.max_positions if max_len is None else max_len
        if not 1 <= max_len <= model.max_positions:
            raise ValueError(f"max_len must be in 1..{model.max_positions} (the model's context), got {max_len}")
        scheme = parse_kv(kv, default=model.kv_scheme) if isinstance(kv, str) else (kv or model.kv_scheme)
        scheme.check_head_dim(cfg.head_dim)
        self.model, self.max_len, self.prefill_chunk = model, max_len, prefill_chunk
        # the attention backend over this cache, chosen once (runtime/attention_backends/; stats() names it)
        self.attention = engine_attention(model.decoder, scheme, model.dtype, model.device, attention)
        self.kernels = self.attention.backend.in_place

        self.kv_budget, num_blocks = cache_size(model, scheme, kv_memory, max_batch, max_len)
        self.cache = KVCache(cfg.num_layers, max_batch, cfg.num_kv_heads, cfg.head_dim, max_len, model.dtype,
                             model.device, scheme=scheme, num_blocks=num_blocks, windows=cfg.sliding_windows)
        self.scheduler = Scheduler(self.cache, prefill_chunk)
        self.closed = False
        self._ids = itertools.count()  # next() is atomic: submit may run on any thread
        self._inbox = Inbox()  # submits and aborts from any thread, applied by step
        self._counters = collections.Counter()
        self._busy_s = 0.0
        self._first_arrival: float | None = None
        self._last_finish: float | None = None
        self.tuned_buckets = tuning_buckets(max(max_batch, prefill_chunk), tune_rows)
        if model.device.type == "cuda":  # tune every GEMM shape the steps will take before the first request
            warm_matmul_tuning(model.decoder, max(max_batch, prefill_chunk), tune_rows)
        # before the graphs capture them: the tuned GEMMs and this cache's attention against the reference
        kept = check_engine(model, scheme, self.kernels, attention == "triton", self.tuned_buckets)
        if self.kernels and not kept:  # the Triton kernels failed over this cache (warned): the next backend
            self.attention = engine_attention(model.decoder, scheme, model.dtype, model.device, attention,
                                              failed={"triton": "over this cache (see its warning)"})
            self.kernels = False
        use_graphs = cuda_graphs if cuda_graphs is not None else model.device.type == "cuda" and self.kernels
        if use_graphs and (model.device.type != "cuda" or not self.kernels):
            raise ValueError("cuda_graphs needs a CUDA model and the Triton attention kernels")
        self.executor = checked_capture(lambda graphs: Executor(model.decoder, self.cache, self.attention.backend,
                                                                graphs),
                                        bool(use_graphs), model.decoder)

    # ------------------------------------------------------------------ public

    @property
    def scheme(self) -> KVScheme:
        return self.cache.scheme

    @property
    def capacity_tokens(self) -> int:
        """Positions the cache can hold at once over all sequences (pool blocks plus residuals)."""
        return self.cache.num_blocks * self.cache.block_size + self.cache.batch * (self.cache.block_size - 1)

    def sequences_at(self, length: int) -> int:
        """How many sequences of ``length`` tokens the cache holds at once (what the KV scheme buys)."""
        return min(self.cache.batch, self.cache.num_blocks // max(self.cache.pages_for(length), 1))

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, on_token=None,
               **sampling) -> Request:
        """Queue a request (its prompt as text or token ids; ``SamplingParams`` or their fields as
        keywords); it joins the running batch at a coming step. Bad input raises here, in the
        caller's thread. ``on_token(token)``: called on the engine's thread with each streamed
        :class:`Token` and then with ``None`` once the request has ended (whatever the reason); it
        must be quick and must not raise (a server hands the token to its event loop)."""
        if self.closed:
            raise EngineClosedError("the engine has been shut down: it takes no new requests")
        if params is None:
            params = SamplingParams(**sampling)
        elif sampling:
            raise ValueError("pass SamplingParams or sampling keywords, not both")
        ids = self._prompt_ids(prompt)
        total = min(len(ids) + params.max_tokens, self.max_len)
        blocks = self.cache.pages_for(total, self.prefill_chunk)  # the last sampled token is never stored
        if blocks > self.cache.num_blocks:
            raise ValueError(
                f"this request may reach {total} tokens ({blocks} cache blocks of {self.cache.block_size}); the "
                f"whole cache has {self.cache.num_blocks}: raise kv_memory or lower max_tokens")
        request = Request(self, next(self._ids), ids, params, total, on_token)
        self._inbox.put("submit", request)
        return request

    def abort(self, request: Request | int) -> None:
        """End ``request`` (or the request with that id) with finish_reason "abort": at the start of
        the next ``step`` it leaves the queue or the batch, its cache blocks and slot are freed
        (before that step admits anyone), and its stream ends (iteration stops after the tokens it
        already had; ``on_token(None)``). Safe from any thread; a finished or unknown request is
        left alone. The other requests' outputs do not change."""
        self._inbox.put("abort", request.id if isinstance(request, Request) else int(request))

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until a request is queued, waiting or running, or ``timeout`` seconds pass;
        return whether there is work (for an engine thread that steps only when there is)."""
        if not self.has_work():
            self._inbox.wait(timeout)
        return self.has_work()

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None) -> list[Request]:
        """Submit every prompt, run until all finish, return the requests (in order)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        requests = [self.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
        self.run()
        return requests

    def run(self) -> None:
        """Step until no request is waiting or running."""
        while self.has_work():
            self.step()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or len(self._inbox))

    @property
    def waiting(self):
        """Requests queued for a cache row (the scheduler's queue; preempted ones first)."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        """Requests holding a cache row, in admission order."""
        return self.scheduler.running

    @property
    def decoding(self) -> int:
        """How many running requests are past their prompt (they sit in cache rows 0 .. decoding-1)."""
        return self.scheduler.decoding

    @property
    def all_decoding(self) -> bool:
        """No request is queued or waiting, and every running one is past its prompt."""
        return not len(self._inbox) and self.scheduler.all_decoding

    def step(self) -> None:
        """Admit, prefill up to ``prefill_chunk`` prompt tokens, decode every decoding sequence once."""
        if self.closed:
            raise EngineClosedError("the engine has been shut down")
        t0 = time.perf_counter()
        self._apply_inbox()
        self.scheduler.admit()
        self._prefill()
        self._decode()
        self.scheduler.promote()  # sequences whose prefill ended this step decode from the next one
        self._counters["steps"] += 1
        self._busy_s += time.perf_counter() - t0

    def shutdown(self) -> None:
        """End every request, queued ones included, as "abort"; release the cache; later calls
        are refused. Call it from the thread that steps (or once that thread has stopped)."""
        self._apply_inbox()
        now = time.perf_counter()
        for r in list(self.running) + list(self.waiting):
            r.end("abort", now)
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        self.executor = None
        self.cache = None
        self.closed = True

    def stats(self) -> dict:
        """Engine totals: steps, tokens, preemptions, throughput over the span from the first
        arrival to the last finish, and the cache's size."""
        span = (self._last_finish - self._first_arrival) if self._last_finish and self._first_arrival else None
        c = self._counters
        cache = self.cache
        return dict(
            steps=c["steps"], prefill_tokens=c["prefill_tokens"], prefill_forwards=c["prefill_forwards"],
            decode_steps=c["decode_steps"],
            output_tokens=c["output_tokens"], finished=c["finished"], aborted=c["aborted"],
            preemptions=self.scheduler.preemptions, running=len(self.running),
            waiting=len(self.waiting) + len(self._inbox),
            free_blocks=cache.free_blocks if cache else None,
            busy_s=self._busy_s, span_s=span,
            throughput_tokens_per_s=c["output_tokens"] / span if span else None,
            kv_scheme=self.scheme.name if cache else None, kv_budget_bytes=self.kv_budget,
            num_blocks=cache.num_blocks if cache else None, block_size=cache.block_size if cache else None,
            max_batch=cache.batch if cache else None, capacity_tokens=self.capacity_tokens if cache else None,
            sequences_at_max_len=self.sequences_at(self.max_len) if cache else None,
            attention="triton" if self.kernels else "reference", attention_backend=self.attention.name,
            cuda_graph_buckets=self.executor.graphs.buckets if self.executor and self.executor.graphs else [],
        )

    # ------------------------------------------------------------ the step

    def _prompt_ids(self, prompt) -> list[int]:
        m = self.model
        return check_prompt(prompt, m.tokenizer, m.decoder.cfg.vocab_size, self.max_len, m.path,
                            "the engine's context (max_len)")

    def _apply_inbox(self) -> None:
        """Apply what other threads queued (``submit``, ``abort``), in the order they queued it."""
        for kind, item in self._inbox.drain():
            if kind == "submit":
                self._first_arrival = self._first_arrival or item.arrival
                self.scheduler.enqueue(item)
            elif (r := self.scheduler.remove(item)) is not None:  # else finished already, or unknown
                self._counters["aborted"] += 1
                r.end("abort", time.perf_counter())

    def _prefill(self) -> None:
        """The step's prompt chunks (``Scheduler.prefill_batch``) in one packed forward; a request
        whose prompt is in samples its first token."""
        chunks = self.scheduler.prefill_batch()
        if not chunks:
            return
        logits = self.executor.prefill([c.request.slot for c in chunks], [c.start for c in chunks],
                                       [c.token_ids for c in chunks])
        self._counters["prefill_forwards"] += 1
        self._counters["prefill_tokens"] += sum(c.end - c.start for c in chunks)
        rows = self.scheduler.prefilled(chunks)
        self._sample(logits, [chunks[i].request for i in rows], rows)

    def _decode(self) -> None:
        """One forward for every decoding sequence: each reads the token at its position (the
        last sampled one, or, replaying after a preemption, one it already output) and the ones
        that reach their end sample the next. No host-device sync but the read of the tokens."""
        decoders = self.scheduler.decode_batch()
        if not decoders:
            return
        logits = self.executor.decode([r.token_at(r.computed) for r in decoders], [r.computed for r in decoders],
                                      [r.slot for r in self.running])
        self._counters["decode_steps"] += 1
        rows = self.scheduler.decoded(decoders)
        self._sample(logits, [decoders[i] for i in rows], rows)

    def _sample(self, logits, requests: list[Request], rows: list[int]) -> None:
        for r, token in zip(requests, sample_tokens(logits, requests, rows)):
            self._emit(r, token)

    def _emit(self, r: Request, token: int) -> None:
        """Record a sampled token: stream it, or finish the request."""
        now, before = time.perf_counter(), len(r.output_ids)
        reason = r.record(token, self.model.eos_token_ids, now)
        self._counters["output_tokens"] += len(r.output_ids) - before
        if reason is not None:
            self._finish(r, reason, now)

    def _finish(self, r: Request, reason: str, now: float) -> None:
        self._last_finish = now
        self._counters["finished"] += 1
        self.scheduler.release(r)
        r.end(reason, now)
