"""What every KV-cache family declares (:class:`KVFamily`), and the stored tensors' tuple.

A family is one way of storing keys and values: its names, the tensors of one block
(:meth:`KVFamily.layout`, from which bytes per token follow), the reference
quantize/dequantize every cache and kernel test compares with, and which Triton kernels
serve it (with the compile-time constants they take). Settings a family reads come from
the :class:`kvquant.KVScheme` it is handed: ``bits`` (keys; values too unless
``value_bits`` differs), ``type``, ``group_size``, ``residual``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SCALE_DTYPE = torch.float16  # scales and zero points of the integer grids
KERNELS = ("kv_write", "kv_dequantize", "decode_attention")  # runtime/kernels: all three or none serve a cache


class QuantizedKV(NamedTuple):
    data: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None

    def map(self, fn) -> "QuantizedKV":
        """Apply ``fn`` to every tensor (index, move, reshape the leading dimensions)."""
        return QuantizedKV(*(None if t is None else fn(t) for t in self))


Layout = dict  # part name ("data", "scale", "zero") -> (shape of one block of one head, dtype)


class KVFamily:
    """One family of KV-cache schemes. Subclasses set the class attributes and the methods
    marked *required*; a module of :mod:`kvquant.schemes` defines ``FAMILY = MyFamily()``."""

    name: str  # stored in KVScheme.family, checkpoints and recipes
    summary: str  # one line: what keys and values become (help texts, docs)
    pattern: str  # regex for its names (named groups for :meth:`settings`); -g<G>/-r<R> are added by the registry
    listed: tuple = ()  # names shown in help texts, the planner's defaults and diagnose's ratios
    order: int = 100  # where its names come in those lists (lower first)
    quantized: bool = True
    grouped: bool = False  # group_size changes what is stored (the name then carries -g and -r)
    kernels: tuple = ()  # the Triton kernels (KERNELS) that serve it; () -> the PyTorch reference path

    # ---- names and settings

    def settings(self, match: dict) -> dict:
        """KVScheme fields (bits, value_bits, type) a name's regex groups give. *Required*."""
        raise NotImplementedError

    def claims(self, bits: int, type_: str, value_bits: int) -> bool:
        """Whether a scheme written without ``family`` (an older checkpoint or recipe: bits, type,
        value_bits only) is this family's."""
        return False

    def validate(self, scheme) -> None:
        """Raise ValueError when the scheme's settings do not fit this family."""

    def name_of(self, scheme) -> str:
        base = self.base_name(scheme)
        return f"{base}-g{scheme.group_size}-r{scheme.residual}" if self.grouped else base

    def base_name(self, scheme) -> str:
        """The name without -g/-r. *Required*."""
        raise NotImplementedError

    def check_head_dim(self, scheme, head_dim: int) -> None:
        """Raise ValueError unless heads of ``head_dim`` channels can take the scheme."""

    def range_ratio(self, scheme, keys: bool) -> float:
        """Fraction of each group's min..max range the integer grid spans (1: all of it)."""
        return 1.0

    # ---- storage and the reference math

    def layout(self, scheme, head_dim: int, dtype: torch.dtype, keys: bool) -> Layout:
        """Shapes and dtypes of ``data``, ``scale``, ``zero`` for one block of one head. *Required*."""
        raise NotImplementedError

    def quantize(self, x: torch.Tensor, scheme, keys: bool) -> QuantizedKV:
        """Keys or values ``[..., T, D]`` to the stored tensors (leading dimensions kept). *Required*."""
        raise NotImplementedError

    def dequantize(self, qx: QuantizedKV, scheme, keys: bool, head_dim: int, out: torch.Tensor) -> torch.Tensor:
        """Back to ``[..., T, D]`` written into ``out`` (any strides). *Required*."""
        raise NotImplementedError

    # ---- kernels

    def kernel_constants(self, scheme) -> dict:
        """The constexprs the paged-cache kernels take (BITS, FP8, KIVI, G: None for a whole head),
        for a family whose ``kernels`` are not empty."""
        raise NotImplementedError(f"the {self.name} KV-cache family has no Triton kernel")
