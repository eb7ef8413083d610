"""The engine's own thread, and the queue the HTTP side hands it work through.

``runtime.Engine`` is driven by one thread. The event loop never touches it: a request becomes a
``Job`` put on a command queue; the engine thread takes every queued command (submit, abort,
stop) between two steps, then steps while anything runs, so all connections share one batch.
After each step it hands each job the tokens and text it gained, through the job's asyncio
queue (``call_soon_threadsafe``), and a snapshot of its state for ``/metrics``.

Admission control: at most ``max_batch`` requests run and ``max_queue`` more wait; beyond that
``submit`` refuses at once (503) rather than letting the queue grow without bound.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from lowbit.serve.metrics import ServerMetrics
from lowbit.serve.protocol import APIError, Work, bad_param, usage
from runtime.generate import check_prompt
from runtime.sampling import SamplingParams

log = logging.getLogger("lowbit.serve")
IDLE_WAIT_S = 0.05  # how long the idle engine thread sleeps on the command queue before looking again


@dataclass
class Job:
    """One HTTP request's passage through the engine; ``events`` is read by the event loop:
    ``("accepted", prompt_tokens)`` or ``("error", APIError)`` first, then ``("delta", text, n_tokens)``
    as tokens come, and ``("done", finish_reason, usage)`` last."""

    work: Work
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: object = None  # the engine's Request once submitted
    sent_tokens: int = 0
    sent_text: int = 0
    aborted: bool = False

    def post(self, *event) -> None:
        """From the engine thread: queue an event for the event loop (dropped if the loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass  # the loop closed: the client is gone


def abort_request(engine, request) -> None:
    """Stop ``request`` and free its cache blocks. ``Engine.abort`` is issue 16's; until the engine
    has it, the same on the engine's own structures (safe here: this runs in the engine thread)."""
    if hasattr(engine, "abort"):
        engine.abort(request)
        return
    if request in engine.waiting:
        engine.waiting.remove(request)
    elif request in engine.running:
        engine._release(request)
    request.finish_reason = "aborted"


class EngineWorker:
    """Owns ``engine`` and the thread that drives it (see the module docstring)."""

    def __init__(self, engine, max_queue: int = 256):
        self.engine, self.max_queue = engine, max_queue
        cache = engine.cache
        # the longest sequence that can finish: the engine's max_len, and what the whole pool holds
        # (the last sampled token is never stored, so one position past the full blocks)
        self.context = min(engine.max_len, (cache.num_blocks + 1) * cache.block_size - 1)
        self.metrics = ServerMetrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: list[Job] = []  # the engine thread's own
        self._lock = threading.Lock()
        self._in_flight = 0  # accepted and not finished (guarded by _lock)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="lowbit-engine", daemon=True)
        self.publish()

    # ------------------------------------------------------------- event-loop side

    def start(self) -> None:
        self._thread.start()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, work: Work) -> Job:
        """Queue ``work``; its job's first event says whether the engine took it. Refuses (503) when
        closed or when ``max_batch`` run and ``max_queue`` wait already."""
        limit = self.engine.cache.batch + self.max_queue if self.engine.cache else 0
        with self._lock:
            if self._closed:
                raise APIError(503, "the server is shutting down: it takes no new requests",
                               code="server_shutting_down", kind="server_error")
            if self._in_flight >= limit:
                self.metrics.refused += 1
                raise APIError(503, f"the server is at capacity ({self._in_flight} requests running or queued, "
                                    f"--max-queue {self.max_queue}): retry later", code="server_busy",
                               kind="server_error")
            self._in_flight += 1
        job = Job(work, asyncio.get_running_loop())
        self._commands.put(("submit", job))
        return job

    def abort(self, job: Job) -> None:
        """The client went away: stop its request and free its blocks (at the next step)."""
        self._commands.put(("abort", job))

    def close(self, timeout: float | None = None) -> None:
        """Refuse new work, let running requests finish, stop the thread, release the cache."""
        with self._lock:
            self._closed = True
        self._commands.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self.engine.cache is not None:
            self.engine.shutdown()

    # ------------------------------------------------------------- engine thread

    def _run(self) -> None:
        stopping = False
        while not (stopping and not self._jobs):
            stopping |= self._take_commands(block=not self.engine.has_work())
            if self.engine.has_work():
                try:
                    self.engine.step()
                except Exception as e:  # an engine bug must not take the server down: fail what ran
                    log.exception("engine step failed")
                    self._fail_all(e)
                self._deliver()
            self.publish()
        self.engine.shutdown()
        self.publish()

    def _take_commands(self, block: bool) -> bool:
        """Apply every queued command; True once a stop was among them."""
        stop = False
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
            while True:
                kind, job = command
                if kind == "submit":
                    self._start(job)
                elif kind == "abort":
                    self._abort(job)
                else:
                    stop = True
                command = self._commands.get_nowait()
        except queue.Empty:
            return stop

    def _start(self, job: Job) -> None:
        try:
            ids = self.prompt_ids(job.work)
            params = self._params(job.work, len(ids))
            job.request = self.engine.submit(ids, params)
        except APIError as e:
            self._end(job)
            job.post("error", e)
            return
        except Exception as e:  # noqa: BLE001 (anything the engine refuses is the request's fault: say why)
            self._end(job)
            job.post("error", bad_param("prompt", str(e)))
            return
        self._jobs.append(job)
        job.post("accepted", len(ids))

    def prompt_ids(self, work: Work) -> list[int]:
        """The prompt as token ids, or a 400 (empty, unknown ids, no tokenizer) or 413 (too long).
        Text is tokenized as ``Model.generate`` does (chat prompts carry their special tokens)."""
        m, prompt = self.engine.model, work.prompt
        if isinstance(prompt, str):
            if m.tokenizer is None:
                raise bad_param("prompt", "this model has no tokenizer: send the prompt as token ids")
            prompt = m.tokenizer(prompt, add_special_tokens=not work.chat).input_ids
        if len(prompt) >= self.context:
            raise APIError(413, f"the prompt has {len(prompt)} tokens; this server's context is {self.context} "
                                f"tokens and at least one must be left to generate", param="prompt",
                           code="context_length_exceeded")
        try:
            return check_prompt(prompt, None, m.decoder.cfg.vocab_size, self.context, m.path, "the context")
        except ValueError as e:
            raise bad_param("messages" if work.chat else "prompt", str(e)) from None

    def _params(self, work: Work, prompt_len: int) -> SamplingParams:
        room = self.context - prompt_len  # a larger max_tokens ends at the context ("length")
        sampling = work.sampling
        return SamplingParams(**{**sampling, "max_tokens": min(sampling["max_tokens"] or room, room)})

    def _abort(self, job: Job) -> None:
        if job in self._jobs:
            job.aborted = True
            abort_request(self.engine, job.request)
            self._jobs.remove(job)
            self._end(job)
            self.metrics.aborted += 1
            log.info("request %s aborted: the client disconnected after %d tokens", job.work.id, job.sent_tokens)

    def _deliver(self) -> None:
        """Hand every job what its request gained this step; finish the finished ones."""
        for job in list(self._jobs):
            r = job.request
            tokens, text = len(r.output_ids) - job.sent_tokens, r.text[job.sent_text:]
            if tokens or text:
                job.sent_tokens += tokens
                job.sent_text += len(text)
                job.post("delta", text, tokens)
            if r.finished:
                self._jobs.remove(job)
                self._end(job)
                self.metrics.finished(r)
                job.post("done", r.finish_reason, usage(len(r.prompt_ids), len(r.output_ids)))

    def _fail_all(self, error: Exception) -> None:
        for job in list(self._jobs):
            abort_request(self.engine, job.request)
            self._jobs.remove(job)
            self._end(job)
            job.post("error", APIError(500, f"the engine failed: {error}", code="engine_error", kind="server_error"))

    def _end(self, job: Job) -> None:
        with self._lock:
            self._in_flight -= 1

    def publish(self) -> None:
        """A snapshot of the engine for /metrics (read by the event loop; replaced whole, never mutated)."""
        e, cache = self.engine, self.engine.cache
        stats = e.stats()
        self.metrics.snapshot = dict(
            running=len(e.running), waiting=len(e.waiting), in_flight=self._in_flight,
            blocks_total=cache.num_blocks if cache else 0, blocks_free=cache.free_blocks if cache else 0,
            preemptions=stats["preemptions"], output_tokens=stats["output_tokens"],
            prefill_tokens=stats["prefill_tokens"], at=time.monotonic())
