"""lowbit's runtime: load a checkpoint, get logits, stream tokens.

CPU uses the PyTorch reference kernels; the fused Triton kernels plug in on CUDA.
"""

from runtime.generate import Generation, Token
from runtime.load import Model, load, load_tokenizer
from runtime.model import SUPPORTED_MODEL_TYPES, UnsupportedModelError, check_supported

__all__ = [
    "Generation", "Model", "SUPPORTED_MODEL_TYPES", "Token", "UnsupportedModelError",
    "check_supported", "load", "load_tokenizer",
]
