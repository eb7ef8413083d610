"""2-, 3- and 4-bit layers on CPU in the int4 kernel's layout (``runtime.cpu_linear.Int4Slots``:
lowbit's native matmul for few rows where it is built, aten's tinygemm kernel otherwise, one dense
bf16 matmul on a scratch weight for a prefill's many rows)."""

from __future__ import annotations

from runtime.linear_backends.cpu_kernels import CpuKernels


class CpuInt4(CpuKernels):
    name = "cpu-int4"

    def takes_bits(self, bits: int) -> str | None:
        return None if bits <= 4 else f"{bits}-bit codes (this kernel takes 2 to 4 bits)"
