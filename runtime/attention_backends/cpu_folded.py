"""The ``cpu-folded`` backend: decode attention over the stored codes by PyTorch ops, scales folded
into the query and the softmax weights (``runtime.cpu_attention.folded_attention``; every dtype;
the integer families and the unquantized cache)."""

from __future__ import annotations

from runtime import cpu_attention
from runtime.attention_backends.base import AttentionBackend


class CpuFolded(AttentionBackend):
    name = "cpu-folded"
    on_codes = True

    def refuses(self, case) -> str | None:
        if case.device != "cpu":
            return f"a CPU path (this device is {case.device})"
        if not cpu_attention.decodes(case.scheme, case.head_dim):
            return (f"the {case.scheme.definition.name} cache (it folds the integer families' codes "
                    "and reads unquantized floats as stored)")
        return None

    def decode(self, paged, q, lengths, window=None, softcap=None, step=None):
        return cpu_attention.folded_attention(paged, q, lengths, window, softcap)
