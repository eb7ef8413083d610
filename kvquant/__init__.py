"""KV-cache quantization: schemes, the one quantize/dequantize entry point, a transformers Cache.

The families (fp16, int8, kivi, fp8, kv-split) are one file each in :mod:`kvquant.schemes`;
a :class:`KVScheme` is a family and its settings.

``kvquant`` depends on torch and ``quant`` (affine math, packing) only; the
transformers cache lives in :mod:`kvquant.hf` so importing this package stays light.
"""

from kvquant.quantize import (
    QuantizedKV, bytes_per_token, dequantize_blocks, dequantize_kv, fake_quantize_kv, layout, quantize_blocks,
    quantize_kv,
)
from kvquant.scheme import SUPPORTED_KV_BITS, KVScheme, kv_scheme_from_dict, parse_kv

__all__ = [
    "KVScheme", "QuantizedKV", "SUPPORTED_KV_BITS", "bytes_per_token", "dequantize_blocks", "dequantize_kv",
    "fake_quantize_kv", "kv_scheme_from_dict", "layout", "parse_kv", "quantize_blocks", "quantize_kv",
]
