"""The engine's own thread, and how the event loop hands it work.

``runtime.Engine`` is stepped by one thread; its ``submit`` and ``abort`` are safe from any thread
(they queue, and the next ``step`` applies them), so the event loop submits each request there
with an ``on_token`` callback and aborts it when the client goes away, and the engine thread only
steps while there is work: all connections share one batch. ``on_token`` runs on the engine thread
and hands each token to the request's asyncio queue with ``call_soon_threadsafe``.

Admission control: at most ``max_batch`` requests run and ``max_queue`` more wait; beyond that
``submit`` refuses at once (503) rather than letting the queue grow without bound. After each step
the engine thread publishes a snapshot of the engine for ``/metrics``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from lowbit.serve.metrics import ServerMetrics
from lowbit.serve.protocol import APIError, Work, bad_param, usage
from runtime.engine import EngineClosedError
from runtime.generate import check_prompt
from runtime.sampling import SamplingParams

log = logging.getLogger("lowbit.serve")
IDLE_WAIT_S = 0.05  # how long the idle engine thread sleeps before looking for a stop again


@dataclass(eq=False)  # hashed by identity: the worker keeps a set of them
class Job:
    """One HTTP request's passage through the engine. ``events``, read by the event loop, gets
    ``("delta", text, n_tokens)`` per token, then ``("done", finish_reason, usage)``, or
    ``("error", APIError)`` if the engine failed."""

    work: Work
    loop: asyncio.AbstractEventLoop
    prompt_tokens: int
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: object = None  # the engine's Request
    ended: bool = False

    def post(self, *event) -> None:
        """From the engine thread: queue an event for the event loop (dropped if the loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass  # the loop closed: nobody listens


class EngineWorker:
    """Owns ``engine`` and the thread that steps it (see the module docstring)."""

    def __init__(self, engine, max_queue: int = 256):
        self.engine, self.max_queue = engine, max_queue
        cache = engine.cache
        # the longest sequence that can finish: the engine's max_len, and what the whole pool holds
        # (sliding layers' rings counted, as the engine's submit counts them)
        self.context = cache.longest_sequence(engine.prefill_chunk)
        self.capacity = cache.batch + max_queue
        self.metrics = ServerMetrics()
        self._lock = threading.Lock()
        self._jobs: set[Job] = set()  # submitted and not ended (guarded by _lock)
        self._closed = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lowbit-engine", daemon=True)
        self.publish()

    # ------------------------------------------------------------- event-loop side

    def start(self) -> None:
        self._thread.start()

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def submit(self, work: Work, ids: list[int] | None = None) -> Job:
        """Hand ``work`` (its prompt as ``ids`` when ``prompt_ids`` made them already) to the engine; a
        400/413 for a bad prompt, a 503 when closed or when ``max_batch`` requests run and ``max_queue``
        wait already."""
        ids = self.prompt_ids(work) if ids is None else ids
        params = self._params(work, len(ids))
        job = Job(work, asyncio.get_running_loop(), len(ids))
        with self._lock:
            if self._closed:
                raise APIError(503, "the server is shutting down: it takes no new requests",
                               code="server_shutting_down", kind="server_error")
            if len(self._jobs) >= self.capacity:
                self.metrics.refused += 1
                raise APIError(503, f"the server is at capacity ({len(self._jobs)} requests running or queued, "
                                    f"--max-queue {self.max_queue}): retry later", code="server_busy",
                               kind="server_error")
            try:
                job.request = self.engine.submit(ids, params, on_token=lambda token: self._on_token(job, token))
            except EngineClosedError as e:
                raise APIError(503, str(e), code="server_shutting_down", kind="server_error") from None
            except ValueError as e:  # what the engine refuses that the checks here did not catch
                raise bad_param("prompt", str(e)) from None
            self._jobs.add(job)
        return job

    def abort(self, job: Job) -> None:
        """The client went away: the engine drops its request and frees its blocks at its next step."""
        if not job.ended:
            self.engine.abort(job.request)
            log.info("request %s aborted: the client disconnected", job.work.id)

    def close(self, timeout: float | None = None) -> None:
        """Refuse new work, let running requests finish, stop the thread, release the cache."""
        with self._lock:
            self._closed = True
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self.engine.cache is not None:
            self.engine.shutdown()
        self.publish()

    # ------------------------------------------------------------- engine thread

    def _run(self) -> None:
        engine = self.engine
        while not (self._stopping.is_set() and not engine.has_work()):
            if engine.wait_for_work(IDLE_WAIT_S):
                try:
                    engine.step()
                except Exception as e:  # an engine bug must not take the server down: fail what ran
                    log.exception("engine step failed")
                    self._fail_all(e)
            self.publish()
        engine.shutdown()

    def _on_token(self, job: Job, token) -> None:
        if token is not None:
            job.post("delta", token.text, 1)
            return
        r = job.request
        with self._lock:
            self._jobs.discard(job)
        job.ended = True
        if r.finish_reason == "abort":
            self.metrics.aborted += 1
        else:
            self.metrics.finished(r)
        job.post("done", r.finish_reason, usage(len(r.prompt_ids), len(r.output_ids)))

    def prompt_ids(self, work: Work) -> list[int]:
        """The prompt as token ids, or a 400 (empty, unknown ids, no tokenizer) or 413 (too long).
        Text is tokenized as ``Model.generate`` does (chat prompts carry their special tokens)."""
        m, prompt = self.engine.model, work.prompt
        if isinstance(prompt, str):
            if m.tokenizer is None:
                raise bad_param("prompt", "this model has no tokenizer: send the prompt as token ids")
            prompt = m.tokenizer(prompt, add_special_tokens=not work.chat).input_ids
        param = "messages" if work.chat else "prompt"
        if len(prompt) >= self.context:
            raise APIError(413, f"the prompt has {len(prompt)} tokens; this server's context is {self.context} "
                                f"tokens and at least one must be left to generate", param=param,
                           code="context_length_exceeded")
        try:
            return check_prompt(prompt, None, m.decoder.cfg.vocab_size, self.context, m.path, "the context")
        except ValueError as e:
            raise bad_param(param, str(e)) from None

    def _params(self, work: Work, prompt_len: int) -> SamplingParams:
        room = self.context - prompt_len  # a larger max_tokens ends at the context ("length")
        sampling = work.sampling
        return SamplingParams(**{**sampling, "max_tokens": min(sampling["max_tokens"] or room, room)})

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.post("error", APIError(500, f"the engine failed: {error}", code="engine_error", kind="server_error"))
            self.engine.abort(job.request)

    def publish(self) -> None:
        """A snapshot of the engine for /metrics (read by the event loop; replaced whole, never mutated)."""
        e, cache = self.engine, self.engine.cache
        stats = e.stats()
        self.metrics.snapshot = dict(
            running=stats["running"], waiting=stats["waiting"], in_flight=len(self._jobs),
            blocks_total=cache.num_blocks if cache else 0, blocks_free=cache.free_blocks if cache else 0,
            preemptions=stats["preemptions"], output_tokens=stats["output_tokens"],
            prefill_tokens=stats["prefill_tokens"], at=time.monotonic())
