"""Scheduling: which requests run in a step, which prompt chunks it prefills, who is preempted.

Everything here is decided on the host: the cache's host mirror of its block tables, lengths
and free blocks (``KVCache.reserve``, ``free_blocks``, ``free_slots``), the requests' own
counters. Nothing reads the device, so scheduling adds no host-device sync to a step.

The rows of the cache are kept in two groups: the decoding sequences in rows
``0 .. decoding-1`` (so a decode forward of ``n`` sequences is the views ``[:n]``, and a CUDA
graph captured for a bucket of rows can run it), the prefilling ones above, admitted into the
highest free rows. A sequence whose prompt is in moves down into the decoder rows
(:meth:`Scheduler.promote`); one that leaves hands its row to the last decoder.

Preemption is by recompute: when a sequence needs a block and none is free, the newest running
request gives its blocks back and waits again, first in line. Readmitted, it prefills its prompt
and replays the tokens it already produced through decode steps, so its output does not change.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from runtime.cache import KVCache
from runtime.generate import prefill_chunks


@dataclass(frozen=True)
class Chunk:
    """Prompt positions ``start .. end`` of ``request``, prefilled this step."""

    request: object  # runtime.request.Request
    start: int
    end: int

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt_ids[self.start:self.end]


class Scheduler:
    """The waiting queue, the running requests and their cache rows (see the module docstring).

    ``prefill_chunk``: prompt tokens a step may prefill, over all sequences; a prompt is cut at
    its multiples whatever else runs (``generate.prefill_chunks``), so the chunks, and with a
    quantized cache the output, do not depend on the schedule."""

    def __init__(self, cache: KVCache, prefill_chunk: int):
        self.cache, self.prefill_chunk = cache, prefill_chunk
        self.waiting: collections.deque = collections.deque()
        self.running: list = []  # admission order: the last is the first preempted
        self.decoding = 0  # the decoding sequences sit in cache rows 0 .. decoding-1
        self.preemptions = 0

    # ------------------------------------------------------------------ queue

    def enqueue(self, request) -> None:
        self.waiting.append(request)

    def remove(self, request_id: int):
        """Take the request with this id out of the queue or the batch (its cache freed); the
        request, or None when it is not here (finished, or never submitted)."""
        for r in self.running:
            if r.id == request_id:
                self.release(r)
                return r
        for r in self.waiting:
            if r.id == request_id:
                self.waiting.remove(r)
                return r
        return None

    def admit(self) -> None:
        """Give waiting requests (oldest first) a row and the blocks their tokens so far fill."""
        cache = self.cache
        while self.waiting and cache.free_slots:
            r = self.waiting[0]
            need = cache.pages_for(r.token_count)
            # keep a block spare for the running sequences to grow (else it waits); alone, it fits (Engine.submit)
            if self.running and need + 1 > cache.free_blocks:
                return
            self.waiting.popleft()
            r.slot = cache.add_sequence(cache.free_slot_ids[-1])  # high rows: decoders fill from row 0
            r.computed = 0
            cache.reserve(r.slot, r.token_count)
            self.running.append(r)

    # ---------------------------------------------------------------- prefill

    def prefill_batch(self) -> list[Chunk]:
        """The next chunk of each prefilling request, oldest first, while the step's
        ``prefill_chunk`` tokens last; their blocks are reserved (preempting newer requests
        where the pool is short: never one already chosen, they are older)."""
        budget, chunks = self.prefill_chunk, []
        for r in [r for r in self.running if r.slot >= self.decoding]:  # admission order: oldest first
            if r not in self.running:  # preempted by an earlier reservation of this step
                continue
            a, b = prefill_chunks(r.computed, len(r.prompt_ids), self.prefill_chunk)[0]
            if b - a > budget:
                break
            if self._reserve(r, b):
                chunks.append(Chunk(r, a, b))
                budget -= b - a
        return chunks

    def prefilled(self, chunks: list[Chunk]) -> list[int]:
        """The chunks are in the cache; the indices of those whose request now samples (its
        prompt is in; a recomputed one after a preemption replays its outputs instead)."""
        for c in chunks:
            self.cache.advance(c.request.slot, c.end - c.start)
            c.request.computed = c.end
        return [i for i, c in enumerate(chunks) if c.request.computed == c.request.token_count]

    # ----------------------------------------------------------------- decode

    def decoders(self) -> list:
        """The requests in cache rows 0 .. decoding-1, by row."""
        return sorted((r for r in self.running if r.slot < self.decoding), key=lambda r: r.slot)

    def decode_batch(self) -> list:
        """The decoding requests, by row, each with the block its next token goes to: a block is
        reserved only where a sequence crosses into one (preempting where the pool is short)."""
        block = self.cache.block_size
        for r in self.decoders():
            if r in self.running and (r.computed + 1) % block == 0:
                self._reserve(r, r.computed + 1)
        return self.decoders()

    def decoded(self, decoders: list) -> list[int]:
        """Each decoder's token is in the cache; the indices of those that sample (the rest replay)."""
        for r in decoders:
            self.cache.advance(r.slot, 1)
            r.computed += 1
        return [i for i, r in enumerate(decoders) if r.computed == r.token_count]

    def promote(self) -> None:
        """Move requests whose prompt is in the cache into the decoder rows."""
        for r in sorted(self.running, key=lambda r: r.slot):
            if r.slot >= self.decoding and r.computed == len(r.prompt_ids):  # the next forward takes one token
                self._swap_rows(r.slot, self.decoding)
                self.decoding += 1

    @property
    def all_decoding(self) -> bool:
        return not self.waiting and all(r.slot < self.decoding for r in self.running)

    # ------------------------------------------------------- blocks and rows

    def release(self, r) -> None:
        """Take ``r`` out of the cache, keeping the decoders in rows 0 .. decoding-1."""
        if r.slot < self.decoding:  # a decoder: the last decoder fills its row
            self._swap_rows(r.slot, self.decoding - 1)
            self.decoding -= 1
        self.cache.free_sequence(r.slot)
        self.running.remove(r)
        r.slot, r.computed = None, 0

    def _reserve(self, r, end: int) -> bool:
        """Blocks for ``r`` up to ``end``, preempting the newest running requests while the pool is
        short; False when ``r`` itself had to go."""
        while not self.cache.reserve(r.slot, end):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is r:
                return False
        return True

    def _preempt(self, r) -> None:
        """Free ``r``'s cache and queue it first; readmitted, it recomputes its cache."""
        self.release(r)
        r.metrics.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(r)

    def _swap_rows(self, a: int, b: int) -> None:
        self.cache.swap_sequences(a, b)
        for r in self.running:
            if r.slot in (a, b):
                r.slot = b if r.slot == a else a
