"""The ``cpu-native`` backend: the folded algebra compiled (``runtime/native/kv_attention.cpp``,
through ``runtime.native.load``): one pass per (KV head x sequence) row over the pool's pages,
float32 models, the layouts ``runtime.cpu_attention.native_refusal`` accepts."""

from __future__ import annotations

from runtime import cpu_attention
from runtime.attention_backends.base import AttentionBackend


class CpuNative(AttentionBackend):
    name = "cpu-native"
    # lowbit's C++ kernels (LOWBIT_NATIVE=0) and the CPU kernels (LOWBIT_CPU_KERNELS=0,
    # LOWBIT_DISABLE=cpu): switched off, decode steps take cpu-folded, its PyTorch reference
    tags = frozenset({"native", "cpu"})
    on_codes = True

    def refuses(self, case) -> str | None:
        if case.device != "cpu":
            return f"a CPU kernel (this device is {case.device})"
        reason = cpu_attention.native_refusal(case.scheme, case.head_dim, case.dtype, case.data_dtype)
        if reason is not None:
            return f"runtime/native/kv_attention.cpp does not take {reason}"
        if self.kernel is None:  # built here, once per process (the reason was warned)
            return "runtime/native/kv_attention.cpp is not built here (no compiler or a failed build: see its warning)"
        return None

    _kernel = None

    @property
    def kernel(self):
        """The compiled module (``runtime.native.load``; None where it is off or does not build), kept
        once loaded: a decode step calls it 30 times, and ``native.load`` reads the environment each time."""
        if self._kernel is None:
            from runtime import native

            self._kernel = native.load("kv_attention")
        return self._kernel

    def decode(self, paged, q, lengths, window=None, softcap=None, step=None):
        return cpu_attention.native_attention(self.kernel, paged, q, lengths, window, softcap, step)
