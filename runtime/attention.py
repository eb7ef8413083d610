"""The one attention path: what a forward reads and writes, on the backend chosen once.

Every forward hands each layer one *batch*, and ``runtime.model.Attention`` makes one call,
``batch.attend(layer, q, k, v, window)``. The batch knows the cache rows, the positions and
the attention backend (``runtime/attention_backends/``): the Triton kernels reading and writing
the quantized cache in place (``runtime/kernels/attention.py``; CUDA, or the interpreter in
tests), the CPU decode paths over the stored codes (``cpu-native``, ``cpu-folded``: one call per
layer of a decode step), or the PyTorch reference (store, read back dequantized, SDPA). The
backend is chosen once by ``runtime.backend.choose`` over ``attention_backends.PRIORITY``: per
model and cache scheme (:func:`model_attention`: at load for the model's own scheme, which is
``Decoder.attention``; a ``LockstepCache`` of another scheme at its first forward) and per Engine
(:func:`engine_attention`), which then hands the same backend to every forward.

* :class:`NoCache`: a plain forward from position 0 (perplexity): causal SDPA;
* :class:`WholeCache`: a ``LockstepCache``, whose rows advance together (evals, the speed bench);
* :class:`SequenceBatch`: the engine's decode rows, each sequence at its own position;
* :class:`PackedBatch`: the engine's prefill chunks of several sequences, packed end to end.

Causal attention without a window that binds goes to SDPA without a mask tensor
(``is_causal``, or the lower-right causal bias for a chunk after cached positions), so
PyTorch keeps its fused kernels; only a binding sliding window builds a boolean mask.
"""

from __future__ import annotations

import functools
import itertools
import warnings

import torch

from kvquant import KVScheme
from runtime.attention_backends import TRITON, AttentionBackend, backend_named, case_of, choose_attention
from runtime.attention_backends.triton import KERNELS_DO_NOT, SOFTCAP
from runtime.attention_math import attention_mask, sdpa, varlen_attention  # the math the batches share
from runtime.backend import Choice, disabled
from runtime.cache import KVCache
from runtime.cache_lockstep import LockstepCache
from runtime.kernels import kv_reference as ref


def no_softcap_kernels(softcap) -> None:
    if softcap is not None:
        raise ValueError(SOFTCAP)


def model_attention(decoder, scheme: KVScheme, dtype: torch.dtype, device) -> Choice:
    """The decoder's attention backend over a ``scheme`` cache of ``dtype`` floats on ``device``:
    chosen once per (scheme, dtype, device, ``LOWBIT_DISABLE``, what the decoder asked for and
    passed over: ``Decoder.attention_asked``, ``attention_off``) and kept on the decoder, so a
    forward's look-up is one dict read. A backend asked for by name that cannot run the cache is a
    ValueError saying why (e.g. the Triton kernels on Gemma 2's soft-capping)."""
    key = (scheme, dtype, torch.device(device).type, disabled(), decoder.attention_asked, decoder.attention_off)
    choices = decoder.__dict__.setdefault("_attention_choices", {})
    if key not in choices:
        choices[key] = choose_attention(_case(decoder, scheme, dtype, device, decoder.attention_asked == "triton"),
                                        decoder.attention_asked, dict(decoder.attention_off))
    return choices[key]


def _case(decoder, scheme, dtype, device, interpret: bool):
    cfg = decoder.cfg
    return case_of(scheme, cfg.head_dim, dtype, device, softcap=cfg.attn_softcap is not None,
                   sliding=any(w is not None for w in cfg.sliding_windows), interpret=interpret)


def pass_over(decoder, name: str, reason: str) -> None:
    """The decoder's attention no longer runs backend ``name`` (``reason``: e.g. its self-check
    failed over the model's own cache); its choices are made again without it."""
    if decoder.attention_asked == name:
        decoder.attention_asked = "auto"
    decoder.attention_off = (*((n, r) for n, r in decoder.attention_off if n != name), (name, reason))


def engine_attention(decoder, scheme: KVScheme, dtype: torch.dtype, device, attention: str = "auto",
                     failed: dict[str, str] | None = None) -> Choice:
    """An Engine's attention backend over its ``scheme`` cache: ``auto`` the priority list as the
    model chose (the Triton interpreter on CPU only when the model asked for it; the backends the
    model passed over stay passed over; a cache the Triton kernels do not take, where the model runs
    them, warns that another backend runs), or a backend's name (``triton``, ``cpu-native``,
    ``cpu-folded``, ``reference``): that one, a ValueError when it cannot. ``failed``: backends
    whose self-check failed over this cache (``runtime.selfcheck.check_engine``), with what failed.
    The Engine then checks the chosen Triton kernels over its cache against the reference once: a
    failure sends it to the next backend with a warning, or with ``triton`` is an error."""
    if attention != "auto":
        backend_named(attention)
        case = _case(decoder, scheme, dtype, device, interpret=attention == "triton")
        return choose_attention(case, attention, failed)
    passed = {**dict(decoder.attention_off), **(failed or {})}
    case = _case(decoder, scheme, dtype, device, interpret=decoder.attention_asked == "triton")
    choice = choose_attention(case, "auto", passed)
    refused = next((r.reason for r in choice.rejected if r.name == TRITON.name), "")
    if refused.startswith(KERNELS_DO_NOT):
        warnings.warn(f"KV cache {scheme.name}: no attention kernel for {refused.removeprefix(KERNELS_DO_NOT)} on "
                      f"{torch.device(device)}; {choice.name} runs instead (correct, slower)", stacklevel=2)
    return choice


def as_backend(kernels, cache) -> AttentionBackend:
    """A batch's backend: the one given, or from a bool as older callers pass it
    (``runtime.execution``'s CUDA-graph view, ``runtime.generate``): True the Triton kernels,
    False the cache's choice without them (made once per scheme, dtype, device and switches)."""
    if isinstance(kernels, AttentionBackend):
        return kernels
    if kernels:
        return TRITON
    return _without_triton(cache.scheme, cache.head_dim, cache.dtype, cache.device.type, disabled()).backend


@functools.cache
def _without_triton(scheme, head_dim, dtype, device, off) -> Choice:
    return choose_attention(case_of(scheme, head_dim, dtype, device), "auto", {TRITON.name: "not asked for"}, off)


def decode_attention(backend: AttentionBackend, paged, q, lengths, window, softcap, step) -> torch.Tensor:
    """A CPU decode step's attention for one layer: the backend's ``decode`` (one call, so
    ``bench/cpu_overhead_kinds.py`` times attention math by this name)."""
    return backend.decode(paged, q, lengths, window, softcap, step)


def as_batch(cache, start: int | torch.Tensor, length: int, decoder):
    """The batch a ``Decoder.forward`` hands its layers: ``cache`` itself when it is one, else a
    view of a ``LockstepCache`` (or of none) at ``start`` for ``length`` new tokens, on the
    decoder's attention backend for that cache (:func:`model_attention`)."""
    if cache is None:
        if isinstance(start, torch.Tensor) or start:
            raise ValueError("a forward from a position other than 0 needs the KV cache")
        return NoCache(length)
    if isinstance(cache, LockstepCache):
        if isinstance(start, torch.Tensor):
            raise ValueError("a LockstepCache advances all its rows together: per-sequence starts need a SequenceBatch")
        backend = model_attention(decoder, cache.scheme, cache.dtype, cache.device).backend
        return WholeCache(cache, start, length, backend)
    return cache


class Batch:
    """What every batch answers besides ``attend``."""

    def kv_store(self, layer: int, length: int):
        """``(residual_k, residual_v, starts)`` when the RoPE launch should write this layer's new
        keys and values into the cache itself (``small_ops.rope_qkv``), else None."""
        return None


class NoCache(Batch):
    """A plain forward from position 0: causal attention over the new tokens only."""

    def __init__(self, length: int):
        self.length = length

    def attend(self, layer: int, q, k, v, window, softcap=None):
        return sdpa(q, k, v, attention_mask(self.length, self.length, window, q.device), softcap)


class WholeCache(Batch):
    """Every row of a ``LockstepCache`` at one ``start``, on ``backend`` (an ``AttentionBackend``, or
    a bool: :func:`as_backend`): the Triton kernels store and attend in place
    (``kv_reference.cache_attention`` on their ops); a CPU backend's decode step stores the new
    token and attends over the stored codes; otherwise ``LockstepCache.update`` + SDPA."""

    def __init__(self, cache: LockstepCache, start: int, length: int, backend):
        self.cache, self.start, self.length = cache, start, length
        self.backend = as_backend(backend, cache)
        self.kernels = self.backend.in_place
        # what every layer of the step shares, worked out once per step (a CPU decode step is
        # dispatch-bound: per-layer host work is 30 times this): the lengths once the new
        # positions are stored, whether the step attends over the stored codes (the backend's
        # way, unless the cache was set to read back: PagedCache.folded_decode), each window's mask
        self.lengths = [start + length] * cache.batch
        self.folded = length == 1 and self.backend.on_codes and cache.folded_decode
        self.rows = range(cache.batch)
        self._masks: dict = {}
        self._step: dict = {}  # what the backend's decode keeps for every layer of the step

    def mask(self, window, device):
        """:func:`attention_mask` of this step for a layer of ``window`` (the same for every such layer)."""
        if window not in self._masks:
            self._masks[window] = attention_mask(self.length, self.start + self.length, window, device)
        return self._masks[window]

    def attend(self, layer: int, q, k, v, window, softcap=None):
        if self.kernels and q.dtype == self.cache.dtype:
            from runtime.kernels.attention import KERNEL_OPS

            no_softcap_kernels(softcap)
            return ref.cache_attention(self.cache, layer, self.start, q, k, v, self.mask(window, q.device), window,
                                       ops=KERNEL_OPS)
        if self.folded:  # a decode step: attend over the stored codes
            cache = self.cache
            end = cache.prepare_write(layer, self.start, k, v)
            cache.store(layer, self.rows, self.start, k, v)
            cache.finish_write(layer, end)
            if in_residual(cache, self.lengths, window, q):
                return residual_attention(cache, layer, slice(None), self.lengths, q, softcap)
            return decode_attention(self.backend, ref.PagedKV.from_cache(cache, layer), q, self.lengths, window,
                                    softcap, self._step)
        keys, values = self.cache.update(layer, self.start, k, v)
        return sdpa(q, keys, values, self.mask(window, q.device), softcap)


class SequenceBatch(Batch):
    """Rows ``first .. first+count`` of the cache, sequence ``i`` writing at ``starts[i]``: what
    one decode forward of the engine reads and writes.

    ``kernels``: an ``AttentionBackend`` (or a bool, :func:`as_backend`). The Triton ops run over
    views of the cache tensors; a CPU backend's decode step stores every row's token and attends
    over the stored codes in one call per layer. Otherwise (and for a prefill chunk off the
    kernels) each sequence stores its keys and values, reads back all of its cache dequantized and
    runs SDPA, exactly as the lockstep cache (``LockstepCache.update`` + SDPA) does. ``starts_tensor`` and ``lengths``: ``starts``
    on the device, and ``starts + T`` (decode: given by the caller, so no layer computes them).

    On the kernels a decode step writes its keys and values in the RoPE launch
    (:meth:`kv_store`), and ``fills`` (known on the host: does any sequence fill a block this
    step?) False skips the block-write launch; None: it runs, finding nothing to do or not.
    """

    def __init__(self, cache: KVCache, first: int, starts: list[int], kernels,
                 starts_tensor: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
                 max_seq_len: int | None = None, fills: bool | None = None):
        self.cache, self.first, self.starts = cache, first, starts
        self.backend = as_backend(kernels, cache)
        self.kernels = self.backend.in_place
        self.count = len(starts)
        self.starts_tensor = starts_tensor if starts_tensor is not None else torch.tensor(
            starts, dtype=torch.int32, device=cache.device)
        self.lengths = lengths
        self.max_seq_len = max_seq_len
        self.fills = fills
        self._stored: set[int] = set()  # layers whose new keys and values the RoPE launch wrote
        self._step: dict | None = None  # a CPU decode step's shared work (_decode_step)

    def _rows(self) -> slice:
        return slice(self.first, self.first + self.count)

    def _decode_step(self) -> dict:
        """What every layer of a CPU decode step shares, worked out at the first layer: where the new
        tokens go (``KVCache.decode_writes``), the lengths after them, the residual's mask."""
        if self._step is None:
            self._step = {"at": self.cache.decode_writes(self.first, self.starts, self.starts_tensor),
                          "lengths": [start + 1 for start in self.starts]}
        return self._step

    def kv_store(self, layer: int, length: int):
        if not self.kernels or length != 1:
            return None
        self._stored.add(layer)
        c, rows = self.cache, self._rows()
        return c.residual_k[layer][rows], c.residual_v[layer][rows], self.starts_tensor

    def attend(self, layer: int, q, k, v, window, softcap=None):
        if self.kernels:
            no_softcap_kernels(softcap)
            start = self.starts[0] if k.shape[2] > 1 else None  # prefill: one sequence, start known on the host
            write = dict(blocks=self.fills is not False, residual=layer not in self._stored)
            return kernel_attention(self.cache, layer, self._rows(), self.starts_tensor, q, k, v, window,
                                    self.max_seq_len, start, self.lengths, write)
        if k.shape[2] == 1 and self.backend.on_codes and self.cache.folded_decode:  # every row over its codes
            step = self._decode_step()
            self.cache.store_decode(layer, self.first, self.starts, k, v, self.starts_tensor, at=step["at"])
            if in_residual(self.cache, step["lengths"], window, q):
                if "mask" not in step:
                    on_device = self.starts_tensor + 1 if self.lengths is None else self.lengths
                    step["mask"] = residual_mask(step["lengths"], q.device, on_device)
                return residual_attention(self.cache, layer, self._rows(), step["lengths"], q, softcap,
                                          mask=step["mask"])
            return decode_attention(self.backend, ref.PagedKV.from_cache(self.cache, layer, self._rows()), q,
                                    step["lengths"], window, softcap, step)
        return torch.cat([reference_attention(self.cache, layer, self.first + i, self.starts[i], q[i:i + 1], k[i],
                                              v[i], window, softcap) for i in range(self.count)])


class PackedBatch(Batch):
    """Prefill chunks of several sequences in one forward, packed end to end (no padding: every
    GEMM of the forward runs on exactly the prompt tokens, M = their sum), and their attention in
    one call (:func:`varlen_attention`: each sequence causal over its own keys, no mask tensor).

    Sequence ``i`` (cache row ``slots[i]``) brings tokens ``token_ids[i]`` at positions
    ``starts[i] ..``. The token ids, their positions, each sequence's last token (the only logits
    sampling needs) and the cumulative query and key lengths go to the device in one copy.
    ``attend`` stores each sequence's keys and values in its row (on the kernels or the
    reference) and reads back the positions before its chunk as the cache holds them; its own
    tokens it reads fresh, as a one-sequence forward does, so the values are the same.
    """

    def __init__(self, cache: KVCache, slots: list[int], starts: list[int], token_ids: list[list[int]],
                 kernels):
        self.cache, self.slots, self.starts = cache, slots, starts
        self.kernels = as_backend(kernels, cache).in_place
        self.query_lengths = [len(t) for t in token_ids]
        self.key_lengths = [s + n for s, n in zip(starts, self.query_lengths)]  # earlier positions + the chunk
        ends = list(itertools.accumulate(self.query_lengths))
        self.bounds = list(zip([0] + ends[:-1], ends))
        n, count = ends[-1], len(token_ids)
        positions = [s + j for s, ids in zip(starts, token_ids) for j in range(len(ids))]
        host = torch.tensor([i for ids in token_ids for i in ids] + positions + [e - 1 for e in ends]
                            + [0, *ends] + [0, *itertools.accumulate(self.key_lengths)], dtype=torch.int32)
        packed = host.to(cache.device, non_blocking=True)
        self.input_ids, self.positions, self.logits_at = packed[:n], packed[n:2 * n], packed[2 * n:2 * n + count]
        self.cu_queries = packed[2 * n + count:2 * n + 2 * count + 1]
        self.cu_keys = packed[2 * n + 2 * count + 1:]

    def attend(self, layer: int, q, k, v, window, softcap=None):
        """``q`` [1, Hq, N, D], ``k``/``v`` [1, Hk, N, D] packed; the attention [1, Hq, N, D]."""
        if self.kernels:
            no_softcap_kernels(softcap)
        pieces = [self._store(layer, slot, start, a, b, k, v)
                  for slot, start, (a, b) in zip(self.slots, self.starts, self.bounds)]
        if any(self.starts):  # a chunk after cached positions: those come back from the cache
            keys = torch.cat([pk.transpose(0, 1) for pk, _ in pieces])  # [sum of key lengths, Hk, D]
            values = torch.cat([pv.transpose(0, 1) for _, pv in pieces])
        else:  # every sequence from position 0: its keys are its own fresh ones, packed already
            keys, values = k[0].transpose(0, 1), v[0].transpose(0, 1)
        out = varlen_attention(q[0].transpose(0, 1), keys.to(q.dtype), values.to(q.dtype), self.cu_queries,
                               self.cu_keys, self.query_lengths, self.key_lengths, window, softcap)
        return out.transpose(0, 1)[None]

    def _store(self, layer: int, slot: int, start: int, a: int, b: int, k, v):
        """Store packed tokens ``a .. b`` (sequence ``slot`` from ``start``); its keys and values
        [Hk, start + b - a, D] as attention reads them: the cache's earlier positions, then its own."""
        ki, vi = k[0, :, a:b], v[0, :, a:b]
        if not self.kernels:
            return self.cache.write_sequence(layer, slot, start, ki, vi)
        from runtime.kernels.attention import KERNEL_OPS as ops

        paged, starts = ref.PagedKV.from_cache(self.cache, layer, slice(slot, slot + 1)), self.positions[a:a + 1]
        ops.write_kv(paged, starts, ki[None], vi[None])
        if not start:
            return ki, vi
        old_k, old_v = ops.dequantize_cache(paged, starts, length=start)
        return torch.cat([old_k[0], ki.to(old_k.dtype)], dim=1), torch.cat([old_v[0], vi.to(old_v.dtype)], dim=1)


def kernel_attention(cache: KVCache, layer: int, rows: slice, starts, q, k, v, window, max_seq_len, start,
                     lengths=None, write: dict | None = None):
    """The Triton kernels over cache ``rows`` in place (``kv_reference.paged_attention``);
    ``write``: what the cache write may skip (``kv_write.write_kv``'s ``blocks``, ``residual``)."""
    from runtime.kernels.attention import KERNEL_OPS

    ops = KERNEL_OPS
    if write and not all(write.values()):
        ops = ops._replace(write_kv=functools.partial(ops.write_kv, **write))
    paged = ref.PagedKV.from_cache(cache, layer, rows)
    mask = None if start is None else attention_mask(k.shape[2], start + k.shape[2], window, q.device)
    return ref.paged_attention(paged, starts, q, k, v, mask, window, ops, max_seq_len=max_seq_len,
                               start=start, lengths=lengths)


def in_residual(cache, lengths: list[int], window: int | None, q) -> bool:
    """Whether a CPU decode step over sequences of ``lengths`` positions (the new one stored) can
    attend over the residual block alone: every position still there (fewer than a block: no block
    quantized yet, the first ``block_size - 1`` tokens of every sequence), none out of the window,
    float32 queries (the stored floats as ``decode_attention`` reads them, in its precision)."""
    return (q.dtype == torch.float32 and max(lengths) < cache.block_size
            and (window is None or max(lengths) <= window))


def residual_attention(cache, layer: int, rows: slice, lengths: list[int], q, softcap=None,
                       lengths_tensor: torch.Tensor | None = None, mask=...):
    """:func:`in_residual`'s attention: one SDPA over views of the residual block (no gather, no
    copy), the positions past a shorter sequence's length masked. ``decode_attention`` computes
    the same from the same floats in some 40 small ops per layer against SDPA's one: a short
    context's decode step is dispatch-bound (bench/results/cpu/NOTES.md). ``lengths_tensor``:
    ``lengths`` on the device (the step's input copy), for the mask of rows of different lengths;
    ``mask``: :func:`residual_mask`'s, when the caller has it (the same for every layer of a step)."""
    end = max(lengths)
    if mask is ...:
        mask = residual_mask(lengths, q.device, lengths_tensor)
    if rows == slice(None):  # every row: one narrow (an index with slices is several ops)
        keys, values = cache.residual_k[layer].narrow(2, 0, end), cache.residual_v[layer].narrow(2, 0, end)
    else:
        keys, values = cache.residual_k[layer][rows, :, :end], cache.residual_v[layer][rows, :, :end]
    return sdpa(q, keys, values, mask, softcap)


def residual_mask(lengths: list[int], device, lengths_tensor: torch.Tensor | None = None) -> torch.Tensor | None:
    """[S, 1, 1, max(lengths)], True where a sequence holds the position; None when all are as long."""
    end = max(lengths)
    if min(lengths) == end:
        return None
    on_device = torch.tensor(lengths, device=device) if lengths_tensor is None else lengths_tensor
    return (torch.arange(end, device=device) < on_device[:, None])[:, None, None]


def reference_attention(cache: KVCache, layer: int, slot: int, start: int, q, k, v, window, softcap=None):
    """One sequence (``q`` [1, Hq, T, D], ``k``/``v`` [Hk, T, D]): store, read its cache back
    dequantized, SDPA, as the lockstep cache (``LockstepCache.update`` + SDPA) does."""
    T = k.shape[1]
    keys, values = cache.write_sequence(layer, slot, start, k, v)
    return sdpa(q, keys[None], values[None], attention_mask(T, start + T, window, q.device), softcap)


