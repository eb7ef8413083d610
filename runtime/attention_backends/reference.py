"""The reference backend: each sequence's cache read back dequantized, then SDPA (what every other
backend is checked against; refuses nothing)."""

from __future__ import annotations

import torch

from runtime.attention_backends import AttentionBackend


class Reference(AttentionBackend):
    name = "reference"
    # on_codes False: a batch's decode step stores, reads back and runs SDPA per sequence itself
    # (runtime.attention.reference_attention, LockstepCache.update + SDPA)

    def refuses(self, case) -> str | None:
        return None

    def decode(self, paged, q: torch.Tensor, lengths: list[int], window: int | None = None,
               softcap: float | None = None, step: dict | None = None) -> torch.Tensor:
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
