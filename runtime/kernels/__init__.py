"""Kernels for quantized layers. ``reference`` is plain PyTorch: the CPU implementation and
the ground truth every GPU kernel is tested against."""
