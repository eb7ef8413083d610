"""8-bit per-channel layers on CPU (``runtime.cpu_linear.Int8Channels``: aten's int8 weight-only kernel,
lowbit's AMX int8 matmul where built, a bf16 scratch copy of the codes for a prefill's many rows)."""

from __future__ import annotations

from runtime.linear_backends.cpu_kernels import CpuKernels


class CpuInt8(CpuKernels):
    name = "cpu-int8"

    def takes_bits(self, bits: int) -> str | None:
        return None if bits == 8 else f"{bits}-bit codes (this kernel takes 8 bits)"
