"""The math every attention batch (``runtime.attention``) shares: the causal and sliding-window
masks, SDPA (soft-capped where Gemma 2 asks), attention of sequences packed end to end
(FlashAttention-2's variable-length kernel where it runs, per sequence through SDPA elsewhere),
and the per-head views of a joined projection that attention reads (:func:`heads`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right


def heads(x: torch.Tensor, sizes: tuple[int, ...], head_dim: int) -> list[torch.Tensor]:
    """Consecutive groups of ``sizes`` heads of ``x`` [B, T, heads * head_dim] or [B, T, heads,
    head_dim] as attention reads them, [B, size, T, head_dim] each: one view per group where a
    slice, a view and a transpose were three ops (a decode step is dispatch-bound; the strides are
    read once); those three where the heads are not packed."""
    shape, stride, at = x.shape, x.stride(), x.storage_offset()
    if stride[-1] != 1 or (len(stride) == 4 and stride[2] != head_dim):
        x, first, views = x.flatten(2).unflatten(-1, (-1, head_dim)).transpose(1, 2), 0, []
        for size in sizes:
            views.append(x.narrow(1, first, size))
            first += size
        return views
    views = []
    for size in sizes:
        views.append(x.as_strided((shape[0], size, shape[1], head_dim), (stride[0], head_dim, stride[1], 1), at))
        at += size * head_dim
    return views


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


def varlen_attention(q, k, v, cu_queries, cu_keys, query_lengths: list[int], key_lengths: list[int],
                     window: int | None, softcap: float | None = None):
    """Attention of sequences packed end to end: ``q`` [Nq, Hq, D] (sequence ``i``'s queries are
    rows ``cu_queries[i] .. cu_queries[i+1]``), ``k``/``v`` [Nk, Hk, D] likewise by ``cu_keys``;
    a sequence's queries are its last ``query_lengths[i]`` positions of ``key_lengths[i]``
    (causal, aligned at the end), within ``window`` positions when the layer slides. [Nq, Hq, D].

    One call for the whole batch where FlashAttention-2 runs (CUDA, fp16/bf16): its variable-length
    kernel, the one SDPA uses, takes the packed layout as is, aligns causality at each sequence's
    end, and reads GQA and the window natively: no mask, no padding, and ``max`` lengths come from
    the host, so no sync (nested tensors reach the same kernel but refuse a window and compute the
    maxima on the device). Elsewhere (and with Gemma 2's soft-capping, which that kernel
    lacks) the same function per sequence through SDPA."""
    if softcap is None and flash_varlen_ok(q, window):
        return flash_varlen(q, k, v, cu_queries, cu_keys, max(query_lengths), max(key_lengths), window)
    return varlen_reference(q, k, v, query_lengths, key_lengths, window, softcap)


def flash_varlen(q, k, v, cu_queries, cu_keys, max_query: int, max_key: int, window: int | None):
    """FlashAttention-2's variable-length forward (causal: aligned at each sequence's end)."""
    window_args = {} if window is None else dict(window_size_left=window - 1, window_size_right=0)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_queries, cu_keys, max_query, max_key, 0.0, True,
                                                   False, **window_args)[0]


def varlen_reference(q, k, v, query_lengths: list[int], key_lengths: list[int], window: int | None,
                     softcap: float | None = None):
    """:func:`varlen_attention` one sequence at a time through SDPA (CPU, fp32, other GPUs)."""
    out, qa, ka = [], 0, 0
    for tq, tk in zip(query_lengths, key_lengths):
        qi, ki, vi = (t.transpose(0, 1)[None] for t in (q[qa:qa + tq], k[ka:ka + tk], v[ka:ka + tk]))
        out.append(sdpa(qi, ki, vi, attention_mask(tq, tk, window, q.device), softcap)[0].transpose(0, 1))
        qa, ka = qa + tq, ka + tk
    return torch.cat(out)


def flash_varlen_ok(q, window: int | None = None) -> bool:
    """Whether FlashAttention-2's variable-length kernel takes these queries (CUDA sm80+, fp16/bf16,
    head_dim a multiple of 8 up to 256, flash SDPA enabled; a window where this PyTorch's op takes one)."""
    if window is not None and not _flash_takes_a_window():
        return False
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and torch.backends.cuda.flash_sdp_enabled()
            and torch.cuda.get_device_capability(q.device)[0] >= 8)


@functools.cache
def _flash_takes_a_window() -> bool:
    return "window_size_left" in str(torch.ops.aten._flash_attention_forward.default._schema)
