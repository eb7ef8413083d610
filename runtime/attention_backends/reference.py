"""The reference backend: each sequence's cache read back dequantized, then SDPA (what every other
backend is checked against; refuses nothing)."""

from __future__ import annotations

import torch

from runtime.attention_backends.base import AttentionBackend
from runtime.attention_backends.checks import reference_decode


class Reference(AttentionBackend):
    name = "reference"
    # on_codes False: a batch's decode step stores, reads back and runs SDPA per sequence itself
    # (runtime.attention.reference_attention, LockstepCache.update + SDPA)

    def refuses(self, case) -> str | None:
        return None

    def decode(self, paged, q: torch.Tensor, lengths: list[int], window: int | None = None,
               softcap: float | None = None, step: dict | None = None) -> torch.Tensor:
        return reference_decode(paged, q, lengths, window, softcap)
