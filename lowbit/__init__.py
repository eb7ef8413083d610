"""lowbit: quantize LLMs into compressed-tensors checkpoints, run them, measure them."""

__version__ = "0.1.0"
