"""The serving engine: continuous batching over a paged, quantized KV cache.

>>> engine = Engine(model, kv_memory="2GB")
>>> req = engine.submit(prompt_ids, SamplingParams(max_tokens=64, temperature=0.7, seed=1))
>>> for token in req:              # streams; drives the engine, so other requests advance too
...     print(token.text, end="")
>>> req.metrics.ttft_s, engine.stats()["throughput_tokens_per_s"]

Each :meth:`Engine.step`:

1. admits waiting requests (oldest first) while a cache slot is free and the pool has the
   blocks for their tokens so far;
2. prefills: up to ``prefill_chunk`` prompt tokens per step, one sequence per forward, a long
   prompt in several chunks over several steps (so running sequences keep decoding);
3. decodes: one forward for every sequence that was already decoding, each at its own
   position, then samples one token per sequence;

and requests leave as soon as they finish, freeing their blocks for the next ones.

The KV cache is allocated once from a byte budget: ``max_batch`` slots (each holds its
sequence's unquantized residual block) and as many pool blocks as the rest of the budget
buys, so how many tokens, and so how many concurrent sequences, fit follows from the KV
scheme (an INT4 block, groups of 64 over head_dim 128, costs 28% of an fp16 one). When a
decoding sequence needs a block and none is free, the newest running sequence is preempted:
its blocks are freed and it waits again; when readmitted it recomputes its cache from its
prompt and the tokens it already produced (its sampler state is kept, so its output is the
same). The cache never grows after start-up, so a full cache makes requests wait; it does
not run out of memory.

Attention: on CUDA the Triton kernels read and write the cache in place (decode over
sequences of different lengths in one launch); on CPU, or for a scheme the kernels do not
take, each sequence runs the reference path (store, read back dequantized, SDPA). Either way
a request gets the plain runtime's computation (``runtime.generate`` on that device: prefill
attends to its own tokens through the quantizer on the reference path, fresh on the
kernels), so its greedy output is the plain runtime's; the tests check it on CPU, and through
the kernels in the Triton interpreter. On CUDA the decode step is captured in a CUDA graph
per batch-size bucket (not run on a GPU yet).
"""

from __future__ import annotations

import collections
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvquant import KVScheme, parse_kv
from kvquant.memory import residual_bytes
from kvquant.quantize import block_bytes
from runtime.cache import KVCache
from runtime.generate import TextStream, Token
from runtime.kernels import kv_reference as ref
from runtime.model import attention_mask
from runtime.sampling import SamplingParams, sample_params


class EngineClosedError(RuntimeError):
    """The engine was shut down: it takes no requests and runs no steps."""


def parse_bytes(value) -> int:
    """``2GB``, ``512MiB``, ``1e9`` or an int, to bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip().upper().replace(" ", "")
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            text, scale = text[: -len(unit)], factor
            break
    else:
        scale = 1
    try:
        return int(float(text) * scale)
    except ValueError:
        raise ValueError(f"cannot read {value!r} as a size in bytes (e.g. 2GB, 512MiB, 1000000)") from None


# ------------------------------------------------------------------------------ requests


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
    "length": ``max_tokens`` or the context) and ``metrics`` fill in as it runs.
    """

    def __init__(self, engine: "Engine", request_id: int, prompt_ids: list[int], params: SamplingParams,
                 total: int):
        self.engine, self.id, self.prompt_ids, self.params = engine, request_id, prompt_ids, params
        self.total = total  # positions it may reach: prompt + max_tokens, within the context
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
        """What the model reads: the prompt, then every output token."""
        return self.prompt_ids + self.output_ids

    def __iter__(self):
        while True:
            while self._pending:
                yield self._pending.popleft()
            if self.finished:
                return
            self.engine.step()

    def result(self) -> "Request":
        """Run the engine until this request finishes; returns it."""
        for _ in self:
            pass
        return self

    def __repr__(self) -> str:
        state = self.finish_reason or ("running" if self.slot is not None else "waiting")
        return f"Request(id={self.id}, prompt={len(self.prompt_ids)} tokens, output={len(self.output_ids)}, {state})"


# -------------------------------------------------------------------- a forward's view of the cache


class SequenceBatch:
    """Rows ``first .. first+count`` of the cache, sequence ``i`` writing at ``starts[i]``: what
    one forward of the engine reads and writes. ``runtime.model.Attention`` hands it each
    layer's new keys and values (``attend``).

    ``kernels``: the Triton ops over views of the cache tensors (GPU; the interpreter in tests).
    Otherwise each sequence stores its keys and values, reads back all of its cache dequantized
    and runs SDPA, exactly as the plain runtime (``KVCache.update`` + SDPA) does.
    """

    def __init__(self, cache: KVCache, first: int, starts: list[int], kernels: bool,
                 starts_tensor: torch.Tensor | None = None, max_seq_len: int | None = None):
        self.cache, self.first, self.starts, self.kernels = cache, first, starts, kernels
        self.count = len(starts)
        self.starts_tensor = starts_tensor if starts_tensor is not None else torch.tensor(
            starts, dtype=torch.int32, device=cache.device)
        self.max_seq_len = max_seq_len

    def attend(self, layer: int, q, k, v, mask, window):
        if self.kernels:
            from runtime.kernels.attention import KERNEL_OPS

            rows = slice(self.first, self.first + self.count)
            c = self.cache
            paged = ref.PagedKV(c.pool[layer]["k"], c.pool[layer]["v"], c.residual_k[layer][rows],
                                c.residual_v[layer][rows], c.block_table[rows], c.scheme)
            start = self.starts[0] if k.shape[2] > 1 else None  # prefill: one sequence, start known on the host
            return ref.paged_attention(paged, self.starts_tensor, q, k, v, mask, window, KERNEL_OPS,
                                       max_seq_len=self.max_seq_len, start=start)
        return torch.cat([self._attend_one(layer, i, q[i:i + 1], k[i], v[i], window) for i in range(self.count)])

    def _attend_one(self, layer, i, q, k, v, window):
        slot, start, T = self.first + i, self.starts[i], k.shape[1]
        keys, values = self.cache.write_sequence(layer, slot, start, k, v)
        mask = attention_mask(T, start + T, window, q.device)
        return F.scaled_dot_product_attention(q, keys[None], values[None], attn_mask=mask,
                                              enable_gqa=q.shape[1] != keys.shape[0])


# --------------------------------------------------------------------------------- engine


def kernels_for(scheme: KVScheme, head_dim: int, dtype: torch.dtype, device: torch.device,
                attention: str = "auto") -> bool:
    """Whether the engine runs the Triton attention kernels: ``auto`` on CUDA when they take this
    cache (else the reference, with a warning), ``triton`` always (an error if they cannot;
    on CPU it needs the interpreter), ``reference`` never."""
    if attention not in ("auto", "triton", "reference"):
        raise ValueError(f"attention must be auto, triton or reference, got {attention!r}")
    if attention == "reference" or (attention == "auto" and device.type != "cuda"):
        return False
    from runtime.kernels.attention import unsupported_reason

    reason = unsupported_reason(scheme, head_dim, dtype, device)
    if reason is None:
        return True
    if attention == "triton":
        raise ValueError(f"KV cache {scheme.name}: the Triton attention kernels do not support {reason}")
    warnings.warn(f"KV cache {scheme.name}: no attention kernel for {reason} on {device}; the engine runs the "
                  "PyTorch reference per sequence (correct, slow)")
    return False


def cache_size(model, scheme: KVScheme, kv_memory, max_batch: int, max_len: int) -> tuple[int, int]:
    """``(budget, pool blocks)``: the slots' residual blocks come first, blocks take the rest.
    Default budget: every slot at ``max_len``, capped on CUDA at 80% of the free memory (activations
    and CUDA graphs need the rest)."""
    cfg = model.decoder.cfg
    per_block = cfg.num_layers * cfg.num_kv_heads * block_bytes(scheme, cfg.head_dim, model.dtype)
    per_slot = residual_bytes(scheme, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    if kv_memory is not None:
        budget = parse_bytes(kv_memory)
    else:
        budget = max_batch * (per_slot + -(-max_len // scheme.block_size) * per_block)
        if model.device.type == "cuda":
            budget = min(budget, int(0.8 * torch.cuda.mem_get_info(model.device)[0]))
    blocks = (budget - max_batch * per_slot) // per_block
    if blocks < 1:
        raise ValueError(
            f"a KV budget of {budget:,} bytes holds no cache block beside {max_batch} slots' residual blocks "
            f"({per_slot:,} bytes each, {scheme.name}); raise kv_memory or lower max_batch")
    return budget, int(blocks)


class Engine:
    """Continuous batching over one loaded :class:`runtime.Model` (see the module docstring).

    ``kv_memory``: bytes for the KV cache (int or ``"2GB"``); default: room for ``max_batch``
    sequences of ``max_len`` tokens. ``max_batch``: the most sequences running at once (cache
    slots). ``max_len``: the longest sequence, prompt and output (default and upper bound: the
    model's context). ``kv``: the cache scheme (default: the model's). ``prefill_chunk``: prompt
    tokens prefilled per step. ``attention``: see :func:`kernels_for`. ``cuda_graphs``: capture
    the decode step per batch-size bucket (CUDA with the attention kernels only; default on there).

    One thread drives it: ``step`` (or iterating a request, which steps) is not thread-safe.
    """

    def __init__(self, model, kv_memory=None, max_batch: int = 32, max_len: int | None = None,
                 kv: KVScheme | str | None = None, prefill_chunk: int = 512, attention: str = "auto",
                 cuda_graphs: bool | None = None):
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
        self.kernels = kernels_for(scheme, cfg.head_dim, model.dtype, model.device, attention)

        self.kv_budget, num_blocks = cache_size(model, scheme, kv_memory, max_batch, max_len)
        self.cache = KVCache(cfg.num_layers, max_batch, cfg.num_kv_heads, cfg.head_dim, max_len, model.dtype,
                             model.device, scheme=scheme, num_blocks=num_blocks)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order: the last is the first preempted
        self.decoding = 0  # the decoding sequences sit in cache rows 0 .. decoding-1
        self.closed = False
        self._next_id = 0
        self._counters = collections.Counter()
        self._busy_s = 0.0
        self._first_arrival: float | None = None
        self._last_finish: float | None = None
        self._graphs: dict[int, _DecodeGraph] = {}
        use_graphs = cuda_graphs if cuda_graphs is not None else model.device.type == "cuda" and self.kernels
        if use_graphs:
            if model.device.type != "cuda" or not self.kernels:
                raise ValueError("cuda_graphs needs a CUDA model and the Triton attention kernels")
            self._capture_graphs()

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
        return min(self.cache.batch, self.cache.num_blocks // max(length // self.cache.block_size, 1))

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, **sampling) -> Request:
        """Queue a request (its prompt as text or token ids; ``SamplingParams`` or their fields as
        keywords). It joins the running batch at a coming step."""
        if self.closed:
            raise EngineClosedError("the engine has been shut down: it takes no new requests")
        if params is None:
            params = SamplingParams(**sampling)
        elif sampling:
            raise ValueError("pass SamplingParams or sampling keywords, not both")
        ids = self._prompt_ids(prompt)
        total = min(len(ids) + params.max_tokens, self.max_len)
        blocks = total // self.cache.block_size  # the last sampled token is never stored
        if blocks > self.cache.num_blocks:
            raise ValueError(
                f"this request may reach {total} tokens ({blocks} cache blocks of {self.cache.block_size}); the "
                f"whole cache has {self.cache.num_blocks}: raise kv_memory or lower max_tokens")
        request = Request(self, self._next_id, ids, params, total)
        self._next_id += 1
        self._first_arrival = self._first_arrival or request.arrival
        self.waiting.append(request)
        return request

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
        return bool(self.waiting or self.running)

    def step(self) -> None:
        """Admit, prefill up to ``prefill_chunk`` prompt tokens, decode every decoding sequence once."""
        if self.closed:
            raise EngineClosedError("the engine has been shut down")
        t0 = time.perf_counter()
        self._admit()
        self._prefill()
        self._decode()
        self._promote()  # sequences whose prefill ended this step decode from the next one
        self._counters["steps"] += 1
        self._busy_s += time.perf_counter() - t0

    def shutdown(self) -> None:
        """Finish every request as "aborted", release the cache; later calls are refused."""
        for r in list(self.running) + list(self.waiting):
            r.finish_reason = "aborted"
        self.running, self.waiting = [], collections.deque()
        self._graphs.clear()
        self.cache = None
        self.closed = True

    def stats(self) -> dict:
        """Engine totals: steps, tokens, preemptions, throughput over the span from the first
        arrival to the last finish, and the cache's size."""
        span = (self._last_finish - self._first_arrival) if self._last_finish and self._first_arrival else None
        c = self._counters
        cache = self.cache
        return dict(
            steps=c["steps"], prefill_tokens=c["prefill_tokens"], decode_steps=c["decode_steps"],
            output_tokens=c["output_tokens"], finished=c["finished"], preemptions=c["preemptions"],
            busy_s=self._busy_s, span_s=span,
            throughput_tokens_per_s=c["output_tokens"] / span if span else None,
            kv_scheme=self.scheme.name if cache else None, kv_budget_bytes=self.kv_budget,
            num_blocks=cache.num_blocks if cache else None, block_size=cache.block_size if cache else None,
            max_batch=cache.batch if cache else None, capacity_tokens=self.capacity_tokens if cache else None,
            sequences_at_max_len=self.sequences_at(self.max_len) if cache else None,
            attention="triton" if self.kernels else "reference", cuda_graph_buckets=sorted(self._graphs),
        )

    # ------------------------------------------------------------ scheduling

    def _prompt_ids(self, prompt) -> list[int]:
        tok = self.model.tokenizer
        if isinstance(prompt, str):
            if tok is None:
                raise ValueError(f"{self.model.path} has no tokenizer: pass the prompt as a list of token ids")
            ids = tok(prompt).input_ids
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > self.max_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, longer than the engine's context ({self.max_len})")
        vocab = self.model.decoder.cfg.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (size {vocab})")
        return ids

    def _admit(self) -> None:
        """Give waiting requests (oldest first) a slot and the blocks their tokens so far fill."""
        cache = self.cache
        while self.waiting and cache.free_slots:
            r = self.waiting[0]
            need = len(r.tokens) // cache.block_size
            # keep a block spare for the running sequences to grow (else it waits); alone, it fits (see submit)
            if self.running and need + 1 > cache.free_blocks:
                return
            self.waiting.popleft()
            r.slot = cache.add_sequence(cache.free_slot_ids[-1])  # high rows: decoders fill from row 0
            r.computed = 0
            cache.reserve(r.slot, len(r.tokens))
            self.running.append(r)

    def _prefill(self) -> None:
        budget = self.prefill_chunk
        for r in [r for r in self.running if r.slot >= self.decoding]:  # admission order: oldest first
            if budget <= 0:
                return
            if r not in self.running:  # preempted by an earlier prefill of this step
                continue
            n = min(len(r.tokens) - r.computed, budget)
            if not self._reserve(r, r.computed + n):
                continue  # r itself was preempted
            ids = torch.tensor([r.tokens[r.computed: r.computed + n]], device=self.model.device)
            batch = SequenceBatch(self.cache, r.slot, [r.computed], self.kernels, max_seq_len=r.computed + n)
            with torch.inference_mode():
                logits = self.model.decoder(ids, batch, r.computed)[0, -1]
            self.cache.advance(r.slot, n)
            r.computed += n
            budget -= n
            self._counters["prefill_tokens"] += n
            if r.computed == len(r.tokens):  # the whole prompt (and any recomputed output) is in
                self._emit(r, sample_params(logits, r.params, r.generator))

    def _decoders(self) -> list[Request]:
        """The requests in cache rows 0 .. decoding-1, by row."""
        return sorted((r for r in self.running if r.slot < self.decoding), key=lambda r: r.slot)

    def _decode(self) -> None:
        # every decoder needs the block its next position may fill; the newest go while none is left
        for r in self._decoders():
            if r in self.running:
                self._reserve(r, r.computed + 1)
        decoders = self._decoders()
        if not decoders:
            return
        starts = [r.computed for r in decoders]
        ids = torch.tensor([[r.tokens[-1]] for r in decoders], device=self.model.device)
        graph = self._graph_for(len(decoders))
        with torch.inference_mode():
            if graph is not None:
                logits = graph.run(ids, starts)
            else:
                batch = SequenceBatch(self.cache, 0, starts, self.kernels, max_seq_len=max(starts) + 1)
                logits = self.model.decoder(ids, batch, batch.starts_tensor)
        logits = logits[:, -1]
        self._counters["decode_steps"] += 1
        if all(r.params.greedy for r in decoders):
            tokens = logits.argmax(-1).tolist()
        else:
            logits = logits.float().cpu()  # one copy for every sampler
            tokens = [sample_params(logits[i], r.params, r.generator) for i, r in enumerate(decoders)]
        for r in decoders:
            self.cache.advance(r.slot, 1)
            r.computed += 1
        for r, token in zip(decoders, tokens):
            self._emit(r, token)

    def _promote(self) -> None:
        """Move requests whose cache now holds all but their last token into the decoder rows."""
        for r in sorted(self.running, key=lambda r: r.slot):
            if r.slot >= self.decoding and r.computed == len(r.tokens) - 1:  # the next forward takes one token
                self.cache.swap_sequences(r.slot, self.decoding)
                self._swap_owner(r.slot, self.decoding)
                self.decoding += 1

    def _reserve(self, r: Request, end: int) -> bool:
        """Blocks for ``r`` up to ``end``, preempting the newest running requests while the pool is
        short; False when ``r`` itself had to go."""
        while not self.cache.reserve(r.slot, end):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is r:
                return False
        return True

    def _preempt(self, r: Request) -> None:
        """Free ``r``'s cache and queue it first; readmitted, it recomputes its cache."""
        self._release(r)
        r.metrics.preemptions += 1
        self._counters["preemptions"] += 1
        self.waiting.appendleft(r)

    def _release(self, r: Request) -> None:
        """Take ``r`` out of the cache, keeping the decoders in rows 0 .. decoding-1."""
        if r.slot < self.decoding:  # a decoder: the last decoder fills its row
            last = self.decoding - 1
            self.cache.swap_sequences(r.slot, last)
            self._swap_owner(r.slot, last)
            self.decoding -= 1
        self.cache.free_sequence(r.slot)
        self.running.remove(r)
        r.slot, r.computed = None, 0

    def _swap_owner(self, a: int, b: int) -> None:
        for r in self.running:
            if r.slot in (a, b):
                r.slot = b if r.slot == a else a

    def _emit(self, r: Request, token: int) -> None:
        """Record a sampled token: stream it, or finish the request."""
        now = time.perf_counter()
        m = r.metrics
        if m.ttft_s is None:
            m.ttft_s = now - r.arrival
        else:
            m.itl_s.append(now - r._last_token_at)
        r._last_token_at = now
        eos = () if r.params.ignore_eos else self.model.eos_token_ids
        if token in eos or token in r.params.stop_token_ids:
            return self._finish(r, "stop", now)
        r.output_ids.append(token)
        m.output_tokens += 1
        self._counters["output_tokens"] += 1
        # as runtime.generate: the cache may fill up to ``total`` positions; the last token is not stored
        done = len(r.output_ids) >= r.params.max_tokens or r.computed >= r.total
        piece = r.stream.push(r.output_ids, done)
        r._pending.append(Token(token, piece, now - r.arrival))
        if r.stream.stopped:
            self._finish(r, "stop", now)
        elif done:
            self._finish(r, "length", now)

    def _finish(self, r: Request, reason: str, now: float) -> None:
        r.finish_reason = reason
        r.metrics.e2e_s = now - r.arrival
        self._last_finish = now
        self._counters["finished"] += 1
        self._release(r)

    # ------------------------------------------------------------ CUDA graphs

    def _graph_for(self, n: int) -> "_DecodeGraph | None":
        """The captured decode step of the smallest bucket that holds ``n`` sequences, when its
        padding rows are free slots (a prefilling sequence must not be written by padding)."""
        bucket = next((b for b in sorted(self._graphs) if b >= n), None)
        if bucket is None or any(r.slot < bucket for r in self.running if r.slot >= n):
            return None
        return self._graphs[bucket]

    def _capture_graphs(self) -> None:
        buckets = sorted({min(b, self.cache.batch) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)})
        for b in buckets:  # at start-up: the warm-up writes into free slots only
            self._graphs[b] = _DecodeGraph(self, b)


class _DecodeGraph:
    """One decode step for ``batch`` rows captured in a CUDA graph: static token and position
    inputs, the attention kernels over views of the cache (no host sync, no allocation at replay).
    Rows past the live sequences are padding: free slots written at position 0 and ignored.

    ``capture=False`` runs the same padded step eagerly on the static inputs: what the tests run
    (in the Triton interpreter) to check everything but the capture itself."""

    def __init__(self, engine: Engine, batch: int, capture: bool = True):
        device = engine.model.device
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.starts = torch.zeros(batch, dtype=torch.int32, device=device)
        view = SequenceBatch(engine.cache, 0, [0] * batch, kernels=True, starts_tensor=self.starts)
        self.step = lambda: engine.model.decoder(self.ids, view, self.starts)
        self.graph = None
        if capture:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side), torch.inference_mode():  # warm-up: Triton autotuning and compilation
                for _ in range(2):
                    self.step()
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), torch.inference_mode():
                self.logits = self.step()

    def run(self, ids: torch.Tensor, starts: list[int]) -> torch.Tensor:
        n = len(starts)
        self.ids.zero_()
        self.starts.zero_()
        self.ids[:n] = ids
        self.starts[:n] = torch.tensor(starts, dtype=torch.int32)
        if self.graph is None:
            return self.step()[:n]
        self.graph.replay()
        return self.logits[:n]
