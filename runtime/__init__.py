"""lowbit's runtime: load a checkpoint, get logits, stream tokens, serve many requests (``Engine``).

CPU uses the PyTorch reference kernels; the fused Triton kernels plug in on CUDA.
"""

from runtime.engine import Engine, EngineClosedError, Request
from runtime.generate import Generation, Token
from runtime.load import Model, load, load_tokenizer
from runtime.model import SUPPORTED_MODEL_TYPES, UnsupportedModelError, check_supported
from runtime.sampling import SamplingParams

__all__ = [
    "Engine", "EngineClosedError", "Generation", "Model", "Request", "SUPPORTED_MODEL_TYPES", "SamplingParams", "Token",
    "UnsupportedModelError", "check_supported", "load", "load_tokenizer",
]
