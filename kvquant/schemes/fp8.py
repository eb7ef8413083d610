"""FP8 (float8 e4m3): keys and values cast, one float32 scale per head and block.

The block's largest magnitude lands on e4m3's largest value (448); no zero point. Stored:
data ``[T, D]`` float8_e4m3fn, scale ``[1, 1]`` float32; ``x = data * scale``.
"""

from __future__ import annotations

import functools

import torch

from kvquant.schemes.base import KERNELS, KVFamily, QuantizedKV

FP8_MAX = 448.0  # largest float8 e4m3 value
FP8_DTYPE = torch.float8_e4m3fn


def _to_float(data: torch.Tensor) -> torch.Tensor:
    """``data.float()``, as a gather from the 256 values e4m3 can hold: the same numbers, several
    times faster than PyTorch's elementwise float8 conversion on CPU."""
    return _values(data.device).index_select(0, data.view(torch.uint8).flatten().int()).view(data.shape)


@functools.cache
def _values(device: torch.device) -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float().to(device)


class Fp8(KVFamily):
    name = "fp8"
    summary = "keys and values float8 e4m3, one scale per head and block"
    pattern = r"fp8"
    listed = ("fp8",)
    order = 30
    kernels = KERNELS  # on GPUs of compute capability 8.9 and later (runtime.kernels.paged)

    def settings(self, match: dict) -> dict:
        return {"bits": 8, "type": "float"}

    def claims(self, bits, type_, value_bits) -> bool:
        return type_ == "float"

    def validate(self, scheme) -> None:
        if scheme.bits != 8 or scheme.value_bits != 8 or scheme.type != "float":
            raise ValueError(f"a float KV cache is FP8 (e4m3): bits must be 8, got {scheme.bits}"
                             + (f" (value_bits {scheme.value_bits})" if scheme.value_bits != scheme.bits else ""))

    def base_name(self, scheme) -> str:
        return "fp8"

    def layout(self, scheme, head_dim, dtype, keys):
        return {"data": ((scheme.block_size, head_dim), FP8_DTYPE), "scale": ((1, 1), torch.float32)}

    def quantize(self, x, scheme, keys) -> QuantizedKV:
        amax = x.abs().amax(dim=(-2, -1), keepdim=True).float()
        # over a tensor, not a Python number: CUDA divides by a number through its reciprocal
        # (amax * RN(1/448) misses RN(amax / 448) for about half of all float16 amax), CPU does not
        scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(torch.finfo(torch.float32).tiny)
        return QuantizedKV((x.float() / scale).to(FP8_DTYPE), scale)

    def dequantize(self, qx, scheme, keys, head_dim, out) -> torch.Tensor:
        return torch.mul(_to_float(qx.data), qx.scale, out=out)

    def kernel_constants(self, scheme) -> dict:
        return dict(BITS=8, FP8=True, KIVI=False, G=None)


FAMILY = Fp8()
