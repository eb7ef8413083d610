"""The one attention path: what a forward reads and writes, on the backend chosen once.

Every forward hands each layer one *batch*, and ``runtime.model.Attention`` makes one call,
``batch.attend(layer, q, k, v, window)``. The batch knows the cache rows, the positions and
the backend: the Triton kernels reading and writing the quantized cache in place
(``runtime/kernels/attention.py``; CUDA, or the interpreter in tests), or the PyTorch
reference (store, read back dequantized, SDPA). The backend is chosen once: at load for the
model (``Decoder.attention_kernels``: on where Triton runs, see ``runtime.load.prepare``) and
so for ``Model.generate``; at start-up for an Engine (:func:`kernels_for`, by default the
model's choice), which then hands the same choice to every forward.

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
from runtime.attention_math import attention_mask, sdpa, varlen_attention  # the math the batches share
from runtime.cache import KVCache
from runtime.cache_lockstep import LockstepCache
from runtime.cpu_attention import decode_attention
from runtime.kernels import kv_reference as ref


def no_softcap_kernels(softcap) -> None:
    if softcap is not None:
        raise ValueError("the Triton attention kernels have no attention-logit soft-capping (Gemma 2): run this "
                         "model on the PyTorch reference (attention='reference'; lowbit picks it by default)")


def kernels_for(scheme: KVScheme, head_dim: int, dtype: torch.dtype, device: torch.device,
                attention: str = "auto", model_choice: bool | None = None) -> bool:
    """Whether the Triton attention kernels serve this cache: ``auto`` when the model chose them
    (``model_choice``; None: on CUDA) and they take this cache (else the reference, with a
    warning), ``triton`` always (an error if they cannot; on CPU it needs the interpreter),
    ``reference`` never. An Engine then checks the chosen kernels over its cache against the
    reference once (``runtime.selfcheck.check_engine``): a failure sends it to the reference with
    a warning, or with ``triton`` is an error."""
    if attention not in ("auto", "triton", "reference"):
        raise ValueError(f"attention must be auto, triton or reference, got {attention!r}")
    wanted = device.type == "cuda" if model_choice is None else model_choice
    if attention == "reference" or (attention == "auto" and not wanted):
        return False
    from runtime.kernels.attention import unsupported_reason

    reason = unsupported_reason(scheme, head_dim, dtype, device)
    if reason is None:
        return True
    if attention == "triton":
        raise ValueError(f"KV cache {scheme.name}: the Triton attention kernels do not support {reason}")
    warnings.warn(f"KV cache {scheme.name}: no attention kernel for {reason} on {device}; the PyTorch reference "
                  "runs instead (correct, slow)")
    return False


def as_batch(cache, start: int | torch.Tensor, length: int, kernels: bool):
    """The batch a ``Decoder.forward`` hands its layers: ``cache`` itself when it is one, else a
    view of a ``LockstepCache`` (or of none) at ``start`` for ``length`` new tokens."""
    if cache is None:
        if isinstance(start, torch.Tensor) or start:
            raise ValueError("a forward from a position other than 0 needs the KV cache")
        return NoCache(length)
    if isinstance(cache, LockstepCache):
        if isinstance(start, torch.Tensor):
            raise ValueError("a LockstepCache advances all its rows together: per-sequence starts need a SequenceBatch")
        return WholeCache(cache, start, length, kernels)
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
    """Every row of a ``LockstepCache`` at one ``start``: the kernels store and attend in place
    (``kv_reference.cache_attention`` on their ops), or ``LockstepCache.update`` + SDPA. The kernels
    serve the caches they support (dtype, head_dim, block and group sizes); others take the
    reference, decided here once per forward."""

    def __init__(self, cache: LockstepCache, start: int, length: int, kernels: bool):
        self.cache, self.start, self.length = cache, start, length
        if kernels:
            from runtime.kernels.attention import supported

            kernels = supported(cache.scheme, cache.head_dim, cache.dtype, cache.device)
        self.kernels = kernels
        # what every layer of the step shares, worked out once per step (a CPU decode step is
        # dispatch-bound: per-layer host work is 30 times this): the lengths once the new
        # positions are stored, whether the step attends over the stored codes, each window's mask
        self.lengths = [start + length] * cache.batch
        self.folded = length == 1 and cache.folded_decode
        self.rows = range(cache.batch)
        self._masks: dict = {}
        self._step: dict = {}  # what decode_attention keeps for every layer of the step

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
            return decode_attention(ref.PagedKV.from_cache(cache, layer), q, self.lengths, window, softcap,
                                    step=self._step)
        keys, values = self.cache.update(layer, self.start, k, v)
        return sdpa(q, keys, values, self.mask(window, q.device), softcap)


class SequenceBatch(Batch):
    """Rows ``first .. first+count`` of the cache, sequence ``i`` writing at ``starts[i]``: what
    one decode forward of the engine reads and writes.

    ``kernels``: the Triton ops over views of the cache tensors. Otherwise each sequence stores
    its keys and values, reads back all of its cache dequantized and runs SDPA, exactly as the
    lockstep cache (``LockstepCache.update`` + SDPA) does. ``starts_tensor`` and ``lengths``: ``starts``
    on the device, and ``starts + T`` (decode: given by the caller, so no layer computes them).

    On the kernels a decode step writes its keys and values in the RoPE launch
    (:meth:`kv_store`), and ``fills`` (known on the host: does any sequence fill a block this
    step?) False skips the block-write launch; None: it runs, finding nothing to do or not.
    """

    def __init__(self, cache: KVCache, first: int, starts: list[int], kernels: bool,
                 starts_tensor: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
                 max_seq_len: int | None = None, fills: bool | None = None):
        self.cache, self.first, self.starts, self.kernels = cache, first, starts, kernels
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
        if k.shape[2] == 1 and self.cache.folded_decode:  # a decode step: every row over its stored codes
            step = self._decode_step()
            self.cache.store_decode(layer, self.first, self.starts, k, v, self.starts_tensor, at=step["at"])
            if in_residual(self.cache, step["lengths"], window, q):
                if "mask" not in step:
                    on_device = self.starts_tensor + 1 if self.lengths is None else self.lengths
                    step["mask"] = residual_mask(step["lengths"], q.device, on_device)
                return residual_attention(self.cache, layer, self._rows(), step["lengths"], q, softcap,
                                          mask=step["mask"])
            return decode_attention(ref.PagedKV.from_cache(self.cache, layer, self._rows()), q, step["lengths"],
                                    window, softcap, step=step)
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
                 kernels: bool):
        self.cache, self.slots, self.starts, self.kernels = cache, slots, starts, kernels
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


