"""The unquantized cache: keys and values in the model's dtype (``fp16``; ``bf16``, ``none`` ... read the same)."""

from __future__ import annotations

import torch

from kvquant.schemes.base import KERNELS, KVFamily, QuantizedKV


class Unquantized(KVFamily):
    name = "fp16"
    summary = "keys and values unquantized, in the model's dtype"
    pattern = r"fp16|bf16|float16|bfloat16|none"
    listed = ("fp16",)
    order = 0
    quantized = False
    kernels = KERNELS

    def settings(self, match: dict) -> dict:
        return {"bits": 16}

    def claims(self, bits, type_, value_bits) -> bool:
        return bits == 16

    def validate(self, scheme) -> None:
        if scheme.bits != 16 or scheme.value_bits != 16 or scheme.type != "int":
            raise ValueError(f"an unquantized KV cache has bits 16 for keys and values (type int), got bits "
                             f"{scheme.bits}, value_bits {scheme.value_bits}, type {scheme.type!r}")

    def base_name(self, scheme) -> str:
        return "fp16"

    def layout(self, scheme, head_dim, dtype, keys):
        return {"data": ((scheme.block_size, head_dim), dtype)}

    def quantize(self, x, scheme, keys) -> QuantizedKV:
        return QuantizedKV(x)

    def dequantize(self, qx, scheme, keys, head_dim, out) -> torch.Tensor:
        return out.copy_(qx.data)

    def kernel_constants(self, scheme) -> dict:
        return dict(BITS=16, FP8=False, KIVI=False, G=None)


FAMILY = Unquantized()
