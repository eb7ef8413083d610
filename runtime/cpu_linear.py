"""Quantized Linears on CPU from packed weights: PyTorch's built-in weight-only kernels, chosen once
per layer at load (as the Triton kernels are on CUDA).

* ``Int4Slots``: 2-, 3- and 4-bit layers through ``aten._weight_int4pack_mm_for_cpu`` (tinygemm's
  CPU kernel: ``w = (u - 8) * scale + zero`` per group, ``u`` an unsigned nibble, ``scale`` and
  ``zero`` floats). A signed code ``q`` of ours (``x = (q - z) * s``) is stored as ``u = q + 8``
  with ``zero = -z * s``, so 2- and 3-bit codes sit in 4-bit slots and dequantize to the same
  values (4 bits per weight in memory until a narrower kernel exists). Groups the kernel does not
  take (above 256, per channel) are cut into kernel groups that repeat the scale. Where it is built
  (AVX512-BF16 or AMX), lowbit's own matmul for few rows runs on the same bytes instead
  (runtime/cpu_int4_gemm.py: scales applied per group on the sums; 1-2x aten's kernel at one row,
  up to 4x at eight, bench/results/cpu/cpu-int4-gemm.json).
* ``Int8Channels``: 8-bit per-channel layers through ``aten._weight_int8pack_mm`` (symmetric
  ``x @ (q * s).T``); an asymmetric zero point is one correction per row, ``- s z * sum(x)``. With
  AMX, 4 to 128 rows run lowbit's int8 matmul on the same codes (runtime/cpu_int8_gemm.py: 1.2-2.6x
  aten's at 8 rows, bench/results/cpu/cpu-int8-gemm.json).

A prefill's many rows may run neither kernel: the layer writes its weight into one reused scratch
(:func:`scratch`; int4 through runtime/native/int4_weights.cpp, or the PyTorch ops where that is not
built) for one dense matmul, whose time grows with the rows far slower than theirs. Which of the
kernel, a **bf16** scratch (fast only with AVX512-BF16 or AMX) and a **float32** scratch (the float
model's own sgemm) serves a prefill's rows is chosen per shape and rows bucket by measurement on the
machine (runtime/cpu_plan.py, issue 42: a bf16 GEMM without bf16 hardware made an AVX2-only EPYC
prefill 48x slower than the float model); decode's few rows (``cpu_plan.DECODE_ROWS``) always run the
kernels. ``LOWBIT_CPU_PLAN=rule`` keeps the thresholds below (``NATIVE_DEQUANTIZE_ROWS``,
``INT8_DEQUANTIZE_ROWS``, ...) with the scratch in bf16 where the CPU has a bf16 GEMM, else float32.

Both kernels run bf16 activations: with float32 activations the int4 kernel is 5-100x slower than a
dense float32 matmul (measured, bench/cpu_decode.py), so a layer converts its input to bf16 and its
output back (the float32 scratch path takes the activations as they come). Layers neither kernel
takes keep the dense reference path (``QuantLinear``), with the reason from :func:`unsupported_reason`.

A quantized model's float leftovers (the embedding, lm_head, Linears a recipe left unquantized) are
kept in bf16 on CPU too (``runtime.load.narrow_float_weights``) where their product is no slower than
float32's there (``cpu_plan.keeps_narrow``): lm_head runs as :class:`NarrowLinear` (bf16 activations,
as the kernels', or widened into a float32 scratch where the plan says so); SmolLM2's tied float32 embedding/lm_head was 113 MB read per
token, a third of the W4 model's memory.

The checkpoint's ``weight_packed`` is not kept beside the kernel's copy (memory at load stays
proportional to bits): :meth:`Int4Slots.codes` reads the codes back from the kernel layout, whose
order is found once per process (:func:`int4_layout`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quant.affine import QuantScheme
from quant.packing import unpack
from runtime import cpu_int4_gemm, cpu_int8_gemm, cpu_plan, native
from runtime.cpu_plan import BF16, FP32, KERNEL
from runtime.cpu_int4_layout import Int4Layout, int4_layout, unpack_int4
from runtime.kernels.weight_layout import act_order_permutation

ACTIVATIONS = torch.bfloat16  # what both kernels are fast with (see the module docstring)
FLOAT_WEIGHTS = torch.bfloat16  # a quantized model's float leftovers on CPU (NarrowLinear)
INT4_GROUPS = (256, 128, 64, 32)  # the group sizes _weight_int4pack_mm_for_cpu takes
INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu refuses other output counts
INT8_K_MULTIPLE = 16  # _weight_int8pack_mm reads past the row (wrong values, crashes) otherwise
# From this many activation rows (prefill) a layer runs one dense bf16 matmul on its weight written
# into a bf16 scratch (:func:`scratch`): the weight-only kernels' time grows with the rows, that of
# writing the weight does not (bench/cpu_prefill.py, 1 thread, SmolLM2 and 1B shapes)
NATIVE_DEQUANTIZE_ROWS = 32  # int4, runtime/native/int4_weights.cpp dequantizing (0.2-0.6 ns/weight):
# level with the kernel at 16 rows, ahead from 32 on every shape (SmolLM2's 192x576 k/v: level)
AMX_DEQUANTIZE_ROWS = 64  # int4 where runtime/cpu_int4_gemm.py runs on AMX below: 1.2-5.4x the scratch
# path at 32 rows on every shape, level or behind at 64 on the small ones (bench/cpu_int4_gemm.py)
DEQUANTIZE_ROWS = 256  # int4, the PyTorch ops dequantizing (LOWBIT_NATIVE=0, 8 ns/weight)
INT8_DEQUANTIZE_ROWS = 32  # int8, a copy of the codes into the scratch (exact; 0.2-0.4 ns/weight): ahead
# of _weight_int8pack_mm from 32 rows on every shape (from 16 on most)


def kernel_group(group: int) -> int | None:
    """The int4 kernel's group size for a checkpoint group of ``group`` inputs (the largest it takes
    that divides ``group``; the scale repeats), or None."""
    return next((g for g in INT4_GROUPS if group % g == 0), None)


def unsupported_reason(scheme: QuantScheme, in_features: int, out_features: int,
                       g_idx: torch.Tensor | None = None) -> str | None:
    """Why no CPU kernel takes this layer (it then keeps the dense reference path), or None. The
    reasons name no layer, so each is reported once per process, not once per layer."""
    group = scheme.group_len(in_features)
    if scheme.bits == 8:
        if group != in_features:
            return "8-bit groups (the CPU int8 kernel takes per-channel scales only)"
        if in_features % INT8_K_MULTIPLE:
            return f"8-bit layers with inputs not a multiple of {INT8_K_MULTIPLE} (the CPU int8 kernel's rows)"
        return None
    if kernel_group(group) is None:
        return f"groups of {group} inputs (the CPU int4 kernel takes multiples of {INT4_GROUPS[-1]})"
    if out_features % INT4_N_MULTIPLE:
        return f"outputs not a multiple of {INT4_N_MULTIPLE} (the CPU int4 kernel's blocks)"
    if g_idx is not None and act_order_permutation(g_idx, group) is None:
        return "weight_g_idx that does not split the inputs into equal groups"
    return None


def _linear_out(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])  # view, not unflatten: a decode step makes 120 of these
    return y if bias is None else y + bias


@dataclass
class Int4Slots:
    """A 2/3/4-bit layer in the int4 kernel's layout (see the module docstring)."""

    packed: torch.Tensor  # uint8 [N, K / 2], _convert_weight_to_int4pack_for_cpu's layout
    scale_zeros: torch.Tensor  # bf16 [K / group, N, 2]: (scale, zero) per kernel group
    group: int  # the kernel's group size
    perm: torch.Tensor | None  # act-order: input columns sorted by group (weight_layout)
    bits: int

    @classmethod
    def build(cls, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, k: int, scheme: QuantScheme,
              g_idx: torch.Tensor | None) -> "Int4Slots":
        """From a checkpoint's ``weight_packed`` [N, words] of ``k`` inputs, scales [N, groups] and
        zero points int8 [N, groups] (unpacked)."""
        group = scheme.group_len(k)
        perm = None if g_idx is None else act_order_permutation(g_idx, group)
        if perm is not None and torch.equal(perm, torch.arange(k)):
            perm = None
        s = scale.float()
        z = torch.zeros_like(s) if zero is None else -zero.float() * s
        repeat = group // kernel_group(group)
        scale_zeros = torch.stack([s.repeat_interleave(repeat, 1), z.repeat_interleave(repeat, 1)], -1)
        return cls(_int4_slots(packed, scheme.bits, k, perm), scale_zeros.transpose(0, 1).to(ACTIVATIONS).contiguous(),
                   kernel_group(group), perm, scheme.bits)

    paths = (KERNEL, BF16, FP32)  # what cpu_plan times

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= cpu_plan.DECODE_ROWS:  # decode: the kernel, no look-up
            path = KERNEL
        else:
            path = self.path(rows)
        if path == KERNEL and self.perm is None and rows < NATIVE_DEQUANTIZE_ROWS:  # one native call
            y = cpu_int4_gemm.linear(x, self.packed, self.group, self.scale_zeros, int4_layout())
            if y is not None:
                return y if bias is None else y + bias
        return _linear_out(self.product(x.reshape(-1, x.shape[-1]), path), x, bias)

    def path(self, rows: int) -> str:
        """The plan's path for a prefill of ``rows`` rows (the kernel where the scratch cannot be read)."""
        if not self.scratch_ok:
            return KERNEL
        n, k = self.packed.shape[0], self.packed.shape[1] * 2
        reached = rows >= min(NATIVE_DEQUANTIZE_ROWS, DEQUANTIZE_ROWS) and rows >= self.dequantize_rows()
        return cpu_plan.path("int4", n, k, self.group, rows, reached)

    def product(self, a: torch.Tensor, path: str) -> torch.Tensor:
        """``a @ w.T`` for ``a`` [M, K] (the checkpoint's column order) by ``path``: the kernel (bf16 out) or
        the weight dequantized into the scratch for a bf16 or float32 matmul (that dtype out)."""
        dtype = torch.float32 if path == FP32 else ACTIVATIONS
        a = a.to(dtype)
        if self.perm is not None:
            a = a.index_select(1, self.perm)
        if path != KERNEL:
            return F.linear(a, self.dequantized(scratch(self.packed.shape[1] * 2, self.packed.shape[0], dtype)))
        y = cpu_int4_gemm.matmul(a, self.packed, self.group, self.scale_zeros, int4_layout())
        if y is None:  # a case lowbit's kernel does not take here: PyTorch's
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(a, self.packed, self.group, self.scale_zeros)
        return y

    @staticmethod
    def dequantize_rows() -> int:
        """Activation rows from which a prefill runs the scratch weight (native dequantizer or not):
        later where lowbit's AMX matmul serves the rows below (ahead of the scratch to ~64 rows)."""
        if _native_weights() is None:
            return DEQUANTIZE_ROWS
        return AMX_DEQUANTIZE_ROWS if cpu_int4_gemm.best_path() == "amx" else NATIVE_DEQUANTIZE_ROWS

    @property
    def scratch_ok(self) -> bool:
        """Whether :meth:`dequantized` reads this layout (known; whole blocks of outputs for the
        PyTorch path, the native one reads a partial last block too)."""
        layout = int4_layout()
        return layout is not None and (self.packed.shape[0] % layout.block_n == 0 or _native_weights() is not None)

    def dequantized(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The kernel's weight in bf16, [N, K] (its column order) as the transpose of a [K, N] buffer
        (``out``, e.g. :func:`scratch`, or a new one): ``u * scale + (zero - 8 scale)`` per group
        computed in float32 and rounded once to bf16 on store (equal to the kernel's weight,
        tests/test_cpu_linear.py); a float32 ``out`` gets that value unrounded. runtime/native/
        int4_weights.cpp does it in one pass where it builds; the PyTorch ops below are the reference
        and fallback."""
        layout, (n, half_k) = int4_layout(), self.packed.shape
        out = torch.empty(2 * half_k, n, dtype=ACTIVATIONS) if out is None else out
        kernel = _native_weights()
        if kernel is not None and (out.dtype == ACTIVATIONS or _native_writes_float32(kernel)):
            kernel.dequantize_int4(self.packed, self.scale_zeros, self.group, layout.block_n, layout.halves, out)
            return out.t()
        if kernel is not None and self.packed.shape[0] % layout.block_n:  # an older build, bf16 only
            out.copy_(self.dequantized().t())
            return out.t()
        return self._dequantized_by_torch(layout, out)

    def _dequantized_by_torch(self, layout: "Int4Layout", out: torch.Tensor) -> torch.Tensor:
        """Works in the layout's block order (each block of outputs is [K, block_n] nibbles), so no
        [N, K] transpose and no float [N, K] temporary: reading the [N, K] nibbles first was 2-5x
        slower. Whole blocks of outputs only."""
        n, half_k = self.packed.shape
        k, blocks, bn = 2 * half_k, n // layout.block_n, layout.block_n
        b = self.packed.view(blocks, k, bn // 2)
        lo, hi = b & 15, b >> 4
        u = torch.cat([lo, hi], 2) if layout.halves else torch.stack([lo, hi], 3).flatten(2)  # [blocks, K, bn]
        sz = self.scale_zeros.float()  # [K / group, N, 2]
        scale = sz[..., 0].view(k // self.group, 1, blocks, bn)
        zero = (sz[..., 1] - 8 * sz[..., 0]).view(k // self.group, 1, blocks, bn)
        torch.addcmul(zero, u.view(blocks, k // self.group, self.group, bn).permute(1, 2, 0, 3), scale,
                      out=out.view(k // self.group, self.group, blocks, bn))
        return out.t()

    @property
    def codes_readable(self) -> bool:
        return int4_layout() is not None

    def codes(self) -> torch.Tensor:
        """The signed codes int8 [N, K] in the checkpoint's column order (read back from the layout)."""
        n, k = self.packed.shape[0], self.packed.shape[1] * 2
        q = (unpack_int4(self.packed, n, k).to(torch.int16) - 8).to(torch.int8)
        if self.perm is not None:
            q = q[:, torch.argsort(self.perm)]
        return q

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_zeros.nbytes


@dataclass
class Int8Channels:
    """An 8-bit per-channel layer for ``_weight_int8pack_mm``."""

    q: torch.Tensor  # int8 [N, K], the signed codes
    scales: torch.Tensor  # bf16 [N]
    zero_scales: torch.Tensor | None  # bf16 [N]: s * z, subtracted times sum(x) (asymmetric)

    @classmethod
    def build(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> "Int8Channels":
        s = scale.float().flatten()
        zs = None if zero is None else (s * zero.float().flatten()).to(ACTIVATIONS)
        return cls(q.contiguous(), s.to(ACTIVATIONS), zs)

    paths = (KERNEL, BF16, FP32)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        a = x.reshape(-1, x.shape[-1])
        return _linear_out(self.product(a, KERNEL if a.shape[0] <= cpu_plan.DECODE_ROWS else self.path(a.shape[0])),
                           x, bias)

    def path(self, rows: int) -> str:
        """The plan's path for a prefill of ``rows`` rows; the rule keeps lowbit's AMX matmul where it
        takes the rows (ahead of both others up to its MAX_ROWS on almost every shape), else the scratch
        from INT8_DEQUANTIZE_ROWS."""
        amx = cpu_int8_gemm.AMX_MIN_ROWS <= rows <= cpu_int8_gemm.MAX_ROWS and cpu_int8_gemm.best_path() == "amx"
        return cpu_plan.path("int8", *self.q.shape, 0, rows, rows >= INT8_DEQUANTIZE_ROWS and not amx)

    def product(self, a: torch.Tensor, path: str) -> torch.Tensor:
        """``a @ (q * s).T`` for ``a`` [M, K], the zero point's correction included, by ``path``: bf16 for
        the kernel and the bf16 scratch (codes up to 128 are exact in bf16), float32 for its scratch."""
        a = a.to(torch.float32 if path == FP32 else ACTIVATIONS)
        if path == KERNEL:
            y = cpu_int8_gemm.matmul(a, self.q, self.scales) if a.shape[0] >= cpu_int8_gemm.AMX_MIN_ROWS else None
            if y is None:
                y = torch.ops.aten._weight_int8pack_mm(a, self.q, self.scales)
        else:
            y = F.linear(a, scratch(*self.q.shape, a.dtype).copy_(self.q)) * self.scales.to(a.dtype)
        if self.zero_scales is not None:
            y = y.float() - a.float().sum(-1, keepdim=True) * self.zero_scales.float()
        return y

    codes_readable = True

    def codes(self) -> torch.Tensor:
        return self.q

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes + (0 if self.zero_scales is None else self.zero_scales.nbytes)


CpuWeight = Int4Slots | Int8Channels


def _native_weights():
    """runtime/native/int4_weights.cpp's module, or None (LOWBIT_NATIVE=0, or it cannot be built here)."""
    return native.load("int4_weights")


_WRITES_FLOAT32: dict[int, bool] = {}


def _native_writes_float32(kernel) -> bool:
    """Whether this build of int4_weights.cpp writes a float32 ``out`` (builds before it did refuse it),
    asked once per module on one block of zeros."""
    known = _WRITES_FLOAT32.get(id(kernel))
    if known is None:
        bn = int4_layout().block_n
        try:
            kernel.dequantize_int4(torch.zeros(bn, 16, dtype=torch.uint8), torch.zeros(1, bn, 2, dtype=ACTIVATIONS),
                                   32, bn, int4_layout().halves, torch.empty(32, bn))
            known = True
        except RuntimeError:
            known = False
        _WRITES_FLOAT32[id(kernel)] = known
    return known


class _Scratch(threading.local):
    weight: torch.Tensor | None = None


_SCRATCH = _Scratch()


def scratch(rows: int, cols: int, dtype: torch.dtype = ACTIVATIONS) -> torch.Tensor:
    """A ``dtype`` [rows, cols] view of this thread's one prefill scratch weight (bytes, bf16 or
    float32 views of it), grown to the largest layer that has asked (at most one layer's weight,
    allocated at the first prefill, not at load). Reused, so a layer's weight does not fault in fresh
    pages on every call: a fresh 32 MB buffer (a 1B model's 8192x2048 layer) cost ~13 ms of page
    faults, more than dequantizing it. The matmul that reads it returns before the next layer writes it."""
    size = rows * cols * dtype.itemsize
    if _SCRATCH.weight is None or _SCRATCH.weight.numel() < size:
        _SCRATCH.weight = None  # the smaller one goes first: never two at once
        with torch.inference_mode(False):  # made in a prefill under inference_mode, written outside too
            _SCRATCH.weight = torch.empty(size, dtype=torch.uint8)
    return _SCRATCH.weight[:size].view(dtype).view(rows, cols)


class NarrowLinear(nn.Module):
    """A float Linear whose weight is stored narrower than the activations (bf16 beside float32):
    the product runs in the weight's dtype (oneDNN's bf16 GEMM, half the bytes of float32 and
    faster at every M measured, bench/cpu_decode.py), the output back in the activations'. Same
    parameter names as ``nn.Linear``, so a tied lm_head still shares the embedding's tensor."""

    GEMV_ROWS = 4  # rows runtime/native/decode_ops.cpp's bf16 product takes (1.3-2.5x torch.mv on
    # SmolLM2's lm_head at one row, level on the 1B model's, whose 263 MB stream from memory)
    native = None  # that module where it runs (AVX512-BF16; runtime.load.use_native_ops), else PyTorch

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    paths = (BF16, FP32)  # what cpu_plan times: the product in the weight's dtype, or widened to float32
    WIDEN_WEIGHTS = 1 << 24  # weights widened into the float32 scratch at a time (64 MB; lm_head in pieces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.reshape(-1, x.shape[-1])
        if self.native is not None and a.shape[0] <= self.GEMV_ROWS and self.weight.dtype == torch.bfloat16:
            # the rows rounded to bf16 as below, float32 sums not rounded to bf16 (within its rounding)
            y = self.native.bf16_gemv(self.weight, a).to(x.dtype).view(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias
        path = BF16
        if a.shape[0] > cpu_plan.DECODE_ROWS and self.weight.dtype == torch.bfloat16:
            path = cpu_plan.path("narrow", self.out_features, self.in_features, 0, a.shape[0], True)
        y = self.product(a, path).to(x.dtype, memory_format=torch.contiguous_format).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def product(self, a: torch.Tensor, path: str) -> torch.Tensor:
        """``a @ weight.T`` for ``a`` [M, K]: in the weight's dtype (``BF16``), or (``FP32``) with the
        weight widened into the float32 scratch, :data:`WIDEN_WEIGHTS` at a time, for the float32 GEMM."""
        if path == FP32:
            return self._widened_product(a.float())
        # weight @ x.T (a matrix-vector product for one row): oneDNN's bf16 F.linear ran 1.1-1.7x
        # slower on lm_head's shapes from 1 to 128 rows (bench/results/cpu/NOTES.md); the transpose
        # back is folded into the caller's copy to the activations' dtype
        a = a.to(self.weight.dtype)
        return torch.mv(self.weight, a[0])[None] if a.shape[0] == 1 else (self.weight @ a.t()).t()

    def _widened_product(self, a: torch.Tensor) -> torch.Tensor:
        n, k = self.weight.shape
        step = max(1, self.WIDEN_WEIGHTS // k)
        if step >= n:
            return F.linear(a, scratch(n, k, torch.float32).copy_(self.weight))
        y = torch.empty(a.shape[0], n)
        for start in range(0, n, step):
            w = self.weight[start:start + step]
            y[:, start:start + w.shape[0]] = F.linear(a, scratch(w.shape[0], k, torch.float32).copy_(w))
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.weight.dtype} weight"


def build(packed: torch.Tensor, scale: torch.Tensor, zero_packed: torch.Tensor | None, shape: tuple[int, int],
          scheme: QuantScheme, g_idx: torch.Tensor | None = None) -> CpuWeight:
    """A checkpoint's ``weight_packed``/``weight_scale``/``weight_zero_point`` (``weight_g_idx``) as the
    CPU kernel's weight; the caller has checked :func:`unsupported_reason`."""
    n, k = shape
    zero = None if zero_packed is None else unpack(zero_packed, scheme.bits, n, dim=0)
    if scheme.bits == 8:
        return Int8Channels.build(unpack(packed, 8, k, dim=1), scale, zero)
    return Int4Slots.build(packed, scale, zero, k, scheme, g_idx)


def timing_weight(kind: str, n: int, k: int, group: int, g: torch.Generator):
    """A random weight of ``kind`` (``cpu_plan.KINDS``) and shape [n, k] for ``cpu_plan`` to time its
    ``paths`` on (``product(a, path)``); ``group``: the int4 kernel's group."""
    if kind == "int4":
        u = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
        return Int4Slots(torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1),
                         (torch.rand(k // group, n, 2, generator=g) * 0.01).to(ACTIVATIONS), group, None, 4)
    if kind == "int8":
        return Int8Channels.build(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
                                  torch.rand(n, generator=g) * 0.01, None)
    with torch.device("meta"):
        linear = nn.Linear(k, n, bias=False)
    linear.weight = nn.Parameter(torch.randn(n, k, generator=g).to(FLOAT_WEIGHTS), requires_grad=False)
    return NarrowLinear(linear)


cpu_plan.timing_weight = timing_weight  # cpu_plan times its candidates on these


_ROWS_PER_CHUNK = 2048  # bounds the int32 temporaries of a large layer; a multiple of every block_n


def _int4_slots(packed: torch.Tensor, bits: int, k: int, perm: torch.Tensor | None) -> torch.Tensor:
    """The codes of ``weight_packed`` as ``u = q + 8`` in the int4 kernel's layout. Rows go in
    chunks (whole blocks of outputs: the layout concatenates them) where the layout is known."""
    step = _ROWS_PER_CHUNK if int4_layout() is not None else packed.shape[0]
    chunks = []
    for r in range(0, packed.shape[0], step):
        q = unpack(packed[r:r + step], bits, k, dim=1)
        if perm is not None:
            q = q[:, perm]  # columns of a group side by side; the activations follow per call
        chunks.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32) + 8, 1))
    return torch.cat(chunks) if len(chunks) > 1 else chunks[0]
