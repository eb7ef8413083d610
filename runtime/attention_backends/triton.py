"""The ``triton`` backend: the paged-cache Triton kernels (``runtime/kernels/attention.py``:
flash-decoding, the folded integer algebra; quantize-on-write, dequantize for prefill chunks),
on CUDA, or in the Triton interpreter on CPU when asked for by name (tests)."""

from __future__ import annotations

import torch

from runtime.attention_backends.base import AttentionBackend

KERNELS_DO_NOT = "the Triton attention kernels do not support "  # a refusal for what of the cache they lack
SOFTCAP = ("the Triton attention kernels have no attention-logit soft-capping (Gemma 2): run this model on "
           "the PyTorch reference (attention='reference'; lowbit picks it by default)")


class Triton(AttentionBackend):
    name = "triton"
    tags = frozenset({"triton"})
    in_place = True  # writes, prefill chunks' read-back and decode: runtime.kernels.attention.KERNEL_OPS

    def refuses(self, case) -> str | None:
        if case.device != "cuda" and not case.interpret:
            return (f"the Triton kernels run on CUDA (this device is {case.device}; the interpreter only when "
                    "asked for by name, attention='triton')")
        if case.softcap:
            return SOFTCAP
        reason = self.unsupported(case)
        return None if reason is None else KERNELS_DO_NOT + reason

    def unsupported(self, case) -> str | None:
        """What of the cache the kernels do not take (``runtime.kernels.paged.unsupported_reason``)."""
        try:
            from runtime.kernels.paged import unsupported_reason
        except ImportError as error:  # no Triton installed
            return f"this install ({error})"
        return unsupported_reason(case.scheme, case.head_dim, case.dtype, torch.device(case.device))

    def decode(self, paged, q, lengths, window=None, softcap=None, step=None):
        from runtime.kernels.attention import KERNEL_OPS

        if softcap is not None:
            raise ValueError(SOFTCAP)
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
        return KERNEL_OPS.decode_attention(q[:, :, 0], paged, seq_lens, window=window)[:, :, None]

    def check(self, case) -> None:
        """The load-time check's steps (``runtime.selfcheck_cases.check_attention``: a prefill that
        fills a block, a chunk after cached positions, two decode steps; kernels against their
        references) for a small head layout, with and without a window."""
        from types import SimpleNamespace

        from runtime.attention_backends.checks import HEADS, KV_HEADS
        from runtime.kernel_checks import check_attention

        cfg = SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=case.head_dim)
        check_attention(cfg, case.scheme, case.dtype, torch.device(case.device), (None, case.scheme.block_size + 2))
