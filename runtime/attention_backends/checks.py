"""The attention backends' self-check (``AttentionBackend.check``): decode steps over a small
cache of the case against the reference backend."""

from __future__ import annotations

import torch

from runtime.tolerances import compare

HEADS, KV_HEADS = 4, 2  # two query heads per KV head: the GQA grouping every backend must follow


def filled(case, lengths: list[int], seed: int = 0):
    """A one-layer engine cache of ``case`` whose rows hold ``lengths`` positions of random keys
    and values (a persistent offset per channel, as keys have)."""
    from runtime.cache import KVCache

    g = torch.Generator().manual_seed(seed)
    cache = KVCache(1, len(lengths), KV_HEADS, case.head_dim, max(lengths) + 8, case.dtype, case.device, case.scheme)
    for slot, n in enumerate(lengths):
        cache.add_sequence(slot)
        k, v = (torch.randn(KV_HEADS, n, case.head_dim, generator=g) * 2
                + torch.randn(1, 1, case.head_dim, generator=g) for _ in range(2))
        cache.write_sequence(0, slot, 0, k.to(case.device, case.dtype), v.to(case.device, case.dtype))
        cache.advance(slot, n)
    return cache


def check_against_reference(backend, case) -> None:
    """Rows at ragged lengths (inside the residual, at a block boundary, past one), with and
    without a sliding window, and soft-capped where the case has it: ``backend.decode`` against
    the reference backend's within ``runtime.tolerances`` (raises ``Mismatch``)."""
    from runtime.kernels.kv_reference import PagedKV

    B = case.scheme.block_size
    lengths = [3, B, 2 * B + 5]
    paged = PagedKV.from_cache(filled(case, lengths), 0)
    q = torch.randn(len(lengths), HEADS, 1, case.head_dim, generator=torch.Generator().manual_seed(1))
    q = q.to(case.device, case.dtype)
    for window, softcap in [(None, None), (B + 2, None)] + ([(None, 30.0)] if case.softcap else []):
        got = backend.decode(paged, q, lengths, window, softcap)
        want = reference_decode(paged, q, lengths, window, softcap)
        compare(got, want, case.dtype, f"decode attention ({backend.name}) over {lengths} positions"
                + (f", window {window}" if window else "") + (", soft-capped" if softcap else ""))


def reference_decode(paged, q: torch.Tensor, lengths: list[int], window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """The reference backend's decode (``reference.Reference``): each sequence's cache read back
    dequantized, then attention; what every other backend is checked against."""
    from runtime.kernels import kv_reference

    if softcap is None:  # the Triton kernels' reference
        seq_lens = torch.tensor(lengths, device=q.device)
        return kv_reference.decode_attention(q[:, :, 0], paged, seq_lens, window)[:, :, None]
    from runtime.attention_math import sdpa

    out = torch.empty_like(q)
    for s, n in enumerate(lengths):  # soft-capped: SDPA's eager path as transformers runs Gemma 2
        first = 0 if window is None else max(n - window, 0)
        keys, values = (kv_reference.read_sequence(paged, s, n, side, first) for side in (True, False))
        out[s:s + 1] = sdpa(q[s:s + 1], keys[None].to(q.dtype), values[None].to(q.dtype), None, softcap)
    return out
