"""Weight quantization: affine math, bit packing, methods and the checkpoint format."""

from quant.affine import QuantScheme, choose_qparams, dequantize, fake_quantize, quantize

__all__ = ["QuantScheme", "choose_qparams", "dequantize", "fake_quantize", "quantize"]
