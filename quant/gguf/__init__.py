"""GGUF for llama.cpp: the types lowbit writes (``types``), their byte layouts (``layout``)."""

from quant.gguf.layout import pack, unpack
from quant.gguf.types import TYPES, GGUFFields, GGUFType, dequantize, fallback, fit_rtn, gguf_type

__all__ = ["TYPES", "GGUFFields", "GGUFType", "dequantize", "fallback", "fit_rtn", "gguf_type", "pack", "unpack"]
