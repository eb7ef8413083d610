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
* :class:`WholeCache`: a ``KVCache`` whose rows advance together (``Model.generate``, evals);
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
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

from kvquant import KVScheme
from runtime.cache import KVCache
from runtime.kernels import kv_reference as ref


def attention_mask(queries: int, keys: int, window: int | None, device):
    """The mask for ``queries`` new tokens that follow ``keys - queries`` cached ones: causal, and
    within ``window`` positions when the layer slides. None for one new token that sees everything;
    a lower-right causal bias (no [T, S] tensor: SDPA keeps its fused kernels) where the window does
    not bind; else a boolean [queries, keys] tensor."""
    if window is None or keys <= window:
        return None if queries == 1 else causal_lower_right(queries, keys)
    q = torch.arange(keys - queries, keys, device=device).unsqueeze(1)
    k = torch.arange(keys, device=device).unsqueeze(0)
    return (k <= q) & (k > q - window)


def sdpa(q, k, v, mask, softcap: float | None = None):
    """SDPA with ``mask`` from :func:`attention_mask` (GQA: SDPA broadcasts the KV heads itself);
    ``softcap``: scores through ``softcap * tanh(s / softcap)`` first (Gemma 2), which SDPA lacks."""
    if softcap is not None:
        return softcapped_attention(q, k, v, mask, softcap)
    gqa = q.shape[1] != k.shape[1]
    if mask is not None and not isinstance(mask, torch.Tensor) and q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # square: plain causal
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def softcapped_attention(q, k, v, mask, softcap: float):
    """Attention as transformers' eager path computes it for Gemma 2: scores scaled by
    1/sqrt(head_dim) (the queries carry the model's own scale), soft-capped, masked, softmax in
    float32. Materializes the [Hq, T, S] scores: the reference path, not a fast one."""
    T, S = q.shape[2], k.shape[2]
    if q.shape[1] != k.shape[1]:  # grouped-query attention: each KV head serves a group of query heads
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = torch.tanh((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 / softcap) * softcap
    if isinstance(mask, CausalBias):  # the lower-right causal bias, as a boolean tensor
        mask = torch.arange(S, device=q.device)[None] <= torch.arange(S - T, S, device=q.device)[:, None]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def no_softcap_kernels(softcap) -> None:
    if softcap is not None:
        raise ValueError("the Triton attention kernels have no attention-logit soft-capping (Gemma 2): run this "
                         "model on the PyTorch reference (attention='reference'; lowbit picks it by default)")


def kernels_for(scheme: KVScheme, head_dim: int, dtype: torch.dtype, device: torch.device,
                attention: str = "auto", model_choice: bool | None = None) -> bool:
    """Whether the Triton attention kernels serve this cache: ``auto`` when the model chose them
    (``model_choice``; None: on CUDA) and they take this cache (else the reference, with a
    warning), ``triton`` always (an error if they cannot; on CPU it needs the interpreter),
    ``reference`` never."""
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
    view of a ``KVCache`` (or of none) at ``start`` for ``length`` new tokens."""
    if cache is None:
        if isinstance(start, torch.Tensor) or start:
            raise ValueError("a forward from a position other than 0 needs the KV cache")
        return NoCache(length)
    if isinstance(cache, KVCache):
        if isinstance(start, torch.Tensor):
            raise ValueError("a KVCache advances all its rows together: per-sequence starts need a SequenceBatch")
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
    """Every row of a ``KVCache`` at one ``start``: the kernels store and attend in place
    (``kv_reference.cache_attention`` on their ops), or ``KVCache.update`` + SDPA. The kernels
    serve the caches they support (dtype, head_dim, block and group sizes); others take the
    reference, decided here once per forward."""

    def __init__(self, cache: KVCache, start: int, length: int, kernels: bool):
        self.cache, self.start, self.length = cache, start, length
        if kernels:
            from runtime.kernels.attention import supported

            kernels = supported(cache.scheme, cache.head_dim, cache.dtype, cache.device)
        self.kernels = kernels

    def attend(self, layer: int, q, k, v, window, softcap=None):
        mask = attention_mask(self.length, self.start + self.length, window, q.device)
        if self.kernels and q.dtype == self.cache.dtype:
            from runtime.kernels.attention import KERNEL_OPS

            no_softcap_kernels(softcap)

            return ref.cache_attention(self.cache, layer, self.start, q, k, v, mask, window, ops=KERNEL_OPS)
        keys, values = self.cache.update(layer, self.start, k, v)
        return sdpa(q, keys, values, mask, softcap)


class SequenceBatch(Batch):
    """Rows ``first .. first+count`` of the cache, sequence ``i`` writing at ``starts[i]``: what
    one decode forward of the engine reads and writes.

    ``kernels``: the Triton ops over views of the cache tensors. Otherwise each sequence stores
    its keys and values, reads back all of its cache dequantized and runs SDPA, exactly as the
    plain runtime (``KVCache.update`` + SDPA) does. ``starts_tensor`` and ``lengths``: ``starts``
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

    def _rows(self) -> slice:
        return slice(self.first, self.first + self.count)

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
        return torch.cat([reference_attention(self.cache, layer, self.first + i, self.starts[i], q[i:i + 1], k[i],
                                              v[i], window, softcap) for i in range(self.count)])


class PackedBatch(Batch):
    """Prefill chunks of several sequences in one forward, packed end to end (no padding: every
    GEMM of the forward runs on exactly the prompt tokens, M = their sum, and each sequence's
    attention is causal from its own start, so no [T, S] mask has to hide padding).

    Sequence ``i`` (cache row ``slots[i]``) brings tokens ``token_ids[i]`` at positions
    ``starts[i] ..``. The token ids, their positions and the index of each sequence's last token
    (the only logits sampling needs) go to the device in one copy. ``attend`` stores each
    sequence's keys and values in its row and attends over its own cache, on the kernels or the
    reference: the computation a one-sequence forward does, so the same values.
    """

    def __init__(self, cache: KVCache, slots: list[int], starts: list[int], token_ids: list[list[int]],
                 kernels: bool):
        self.cache, self.slots, self.starts, self.kernels = cache, slots, starts, kernels
        ends = list(itertools.accumulate(len(t) for t in token_ids))
        self.bounds = list(zip([0] + ends[:-1], ends))
        n = ends[-1]
        positions = [s + j for s, ids in zip(starts, token_ids) for j in range(len(ids))]
        host = torch.tensor([i for ids in token_ids for i in ids] + positions + [e - 1 for e in ends],
                            dtype=torch.int32)
        packed = host.to(cache.device, non_blocking=True)
        self.input_ids, self.positions, self.logits_at = packed[:n], packed[n:2 * n], packed[2 * n:]

    def attend(self, layer: int, q, k, v, window, softcap=None):
        """``q`` [1, Hq, N, D], ``k``/``v`` [1, Hk, N, D] packed; the attention [1, Hq, N, D]."""
        if self.kernels:
            no_softcap_kernels(softcap)
        out = []
        for slot, start, (a, b) in zip(self.slots, self.starts, self.bounds):
            qi, ki, vi = q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]
            if self.kernels:
                rows = slice(slot, slot + 1)
                out.append(kernel_attention(self.cache, layer, rows, self.positions[a:a + 1], qi, ki, vi, window,
                                            start + b - a, start))
            else:
                out.append(reference_attention(self.cache, layer, slot, start, qi, ki[0], vi[0], window, softcap))
        return torch.cat(out, dim=2)


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


def reference_attention(cache: KVCache, layer: int, slot: int, start: int, q, k, v, window, softcap=None):
    """One sequence (``q`` [1, Hq, T, D], ``k``/``v`` [Hk, T, D]): store, read its cache back
    dequantized, SDPA, as the plain runtime (``KVCache.update`` + SDPA) does."""
    T = k.shape[1]
    keys, values = cache.write_sequence(layer, slot, start, k, v)
    return sdpa(q, keys[None], values[None], attention_mask(T, start + T, window, q.device), softcap)
