"""Measuring what quantization loses (perplexity) and wins (bytes)."""
