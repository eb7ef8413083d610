"""The load-time weight layout the GPU matmul kernels read, and its PyTorch reference.

Checkpoints stay in the compressed-tensors ``pack-quantized`` layout (rows = outputs, words
packed along inputs). At load, each quantized Linear is re-laid once into :class:`KernelWeight`:

* ``qweight`` int32 ``[K_pad // pack, N]``: words packed along the input dimension K with
  outputs N contiguous, so a tile of words for ``BLOCK_N`` outputs is one coalesced load.
  K is cut into tiles of ``tile_k = 16 * pack`` inputs (128 at 4 bits) padded at the end with
  zeros. Inside a tile the 16 word rows and ``pack`` bit fields are ordered for the tensor
  cores (:func:`tile_position`): field ``j`` of word row ``r`` holds input
  ``k = 8 (a Q + q) + 2 b + p`` of the tile, with ``r = 4 a + b``, ``j = p Q + q`` and
  ``Q = pack / 2``. So the two inputs ``k, k + 1`` that a tensor-core register holds as a
  16-bit pair sit in one word exactly 16 bits apart (``p`` = 0, 1): one AND/OR with
  ``0x000f000f``-style masks after one shift makes the pair, no byte permutes. A thread of
  mma/wgmma's register operand holds inputs ``16 s + 8 h + 2 c + p`` (lane ``c``): the word
  rows ``4 a + c`` for its ``c``, every field of them. The 16 inputs ``16 f .. 16 f + 15``
  (the smallest group) are the fields with ``a Q + q`` = ``2 f`` or ``2 f + 1``. A GEMV reading
  a word as ``Q`` 16-bit pairs multiplies pair ``q`` by the adjacent activations
  ``x[k], x[k + 1]`` (one 32-bit fp16x2 load).
  In memory the word rows ``4 a .. 4 a + 3`` of a column lie side by side
  (:func:`interleave_word_rows`): a tile's ``16 x N`` words are stored as ``[4 (a), N, 4 (b)]``, so
  the four words of rows ``4 a + b`` that a column needs are one 16-byte vector (the GEMV's
  loads, and 16-byte asynchronous copies in the tensor-core path; with rows laid out one after
  the other, W8 16x64 on sm_90a copied word by word: 4.19 SASS instructions per weight against
  3.47). ``qweight`` keeps its ``[K_pad // pack, N]`` shape (the same bytes).
* ``scales`` ``[groups, N]`` (the stored dtype: no rounding is added), ``zeros`` int8
  ``[groups, N]`` or None (symmetric): one row per group, outputs contiguous.
* ``perm`` (act-order checkpoints with ``weight_g_idx``): input columns are sorted by group at
  load, so every group is a contiguous run of columns again and the kernels index scales by
  ``k // group`` with no per-element gather; activations are permuted the same way per call.

Everything here is plain PyTorch built on ``quant.packing`` and ``quant.affine``; the kernels
(``quant_matmul.py``) are tested against :func:`reference_matmul` and the checkpoint-level
reference in ``reference.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.affine import QuantScheme, dequantize
from quant.packing import pack, unpack

KERNEL_BITS = (2, 4, 8)  # widths whose values never straddle an int32 word
SUBTILE_K = 16  # inputs per bit field of a tile: the K of one tensor-core step
_COLUMNS_PER_CHUNK = 4096  # bounds the int64 temporaries of packing on large layers


@dataclass
class KernelWeight:
    """A quantized Linear in the layout the Triton kernels read (see the module docstring)."""

    qweight: torch.Tensor  # int32 [K_pad // pack, N], word rows interleaved (interleave_word_rows)
    scales: torch.Tensor  # [groups, N], stored dtype
    zeros: torch.Tensor | None  # int8 [groups, N]; None when symmetric
    perm: torch.Tensor | None  # int64 [K]: input column order, None when columns stay in order
    in_features: int
    out_features: int
    bits: int
    group_len: int  # inputs per group (in_features for one group per row)

    @property
    def pack(self) -> int:
        return 32 // self.bits

    @property
    def tile_k(self) -> int:
        return SUBTILE_K * self.pack

    @property
    def num_groups(self) -> int:
        return self.scales.shape[0]


def unsupported_reason(scheme: QuantScheme, in_features: int, g_idx: torch.Tensor | None = None) -> str | None:
    """Why the kernels cannot run this layer (it then keeps the dense reference path), or None."""
    if scheme.bits not in KERNEL_BITS:
        return f"{scheme.bits}-bit values straddle int32 words; the kernels read {KERNEL_BITS}-bit weights"
    group = scheme.group_len(in_features)
    if group != in_features and group % SUBTILE_K:
        return f"group size {group} is not a multiple of {SUBTILE_K} (one scale per kernel sub-tile)"
    if g_idx is not None and act_order_permutation(g_idx, group) is None:
        return "weight_g_idx does not split the inputs into equal groups"
    return None


def act_order_permutation(g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """Input order that makes every group contiguous: columns sorted by group (stable).

    Returns None when sorted groups are not ``group`` columns each (then ``k // group`` cannot
    name a column's group). GPTQ act-order, ours and llm-compressor's, always satisfies it.
    """
    g_idx = g_idx.long()
    perm = torch.argsort(g_idx, stable=True)
    expected = torch.arange(g_idx.numel(), device=g_idx.device) // group
    if not torch.equal(g_idx[perm], expected):
        return None
    return perm


def tile_position(bits: int) -> torch.Tensor:
    """``index[r, j]``: the input of a tile (0 .. tile_k - 1) held by field ``j`` of word row ``r``
    (the layout in the module docstring; the kernels compute the same formula)."""
    per_word = 32 // bits
    half = per_word // 2
    r = torch.arange(SUBTILE_K).unsqueeze(1)
    j = torch.arange(per_word).unsqueeze(0)
    a, b, p, q = r // 4, r % 4, j // half, j % half
    return 8 * (a * half + q) + 2 * b + p


def tile_order(in_features: int, bits: int, device=None) -> torch.Tensor:
    """Input index stored at each packed position: ``order[j]`` is the input column that goes
    to position ``j`` of the padded run packed along K (``-1``: padding)."""
    per_word = 32 // bits
    tile_k = SUBTILE_K * per_word
    padded = -(-in_features // tile_k) * tile_k
    # position (tile t, word row r, field j) holds input t * tile_k + tile_position[r, j]
    within = tile_position(bits).flatten().to(device)
    order = (torch.arange(padded // tile_k, device=device).unsqueeze(1) * tile_k + within).flatten()
    return torch.where(order < in_features, order, -1)


def interleave_word_rows(words: torch.Tensor) -> torch.Tensor:
    """Word rows ``[K_pad // pack, N]`` (row ``16 t + 4 a + b`` of tile ``t``) in the kernels'
    memory order: each tile's ``[4 (a), 4 (b), N]`` block stored as ``[4 (a), N, 4 (b)]``."""
    n = words.shape[1]
    return words.view(-1, 4, 4, n).transpose(2, 3).contiguous().view(-1, n)


def word_rows(qweight: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`interleave_word_rows`: word rows in order."""
    n = qweight.shape[1]
    return qweight.view(-1, 4, n, 4).transpose(2, 3).contiguous().view(-1, n)


def make_kernel_weight(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero_packed: torch.Tensor | None,
    shape: tuple[int, int],
    scheme: QuantScheme,
    g_idx: torch.Tensor | None = None,
) -> KernelWeight:
    """Re-lay a checkpoint's ``weight_packed``/``weight_scale``/``weight_zero_point`` (and
    ``weight_g_idx``) for the kernels. Runs once per layer at load, on the weight's device."""
    out_features, in_features = shape
    reason = unsupported_reason(scheme, in_features, g_idx)
    if reason:
        raise ValueError(f"no kernel layout for a {out_features}x{in_features} {scheme.describe()} layer: {reason}")
    bits, group = scheme.bits, scheme.group_len(in_features)
    perm = None
    if g_idx is not None:
        perm = act_order_permutation(g_idx, group)
        if torch.equal(perm, torch.arange(in_features, device=perm.device)):
            perm = None  # groups already in order: nothing to permute per call
    order = tile_order(in_features, bits, packed.device)
    source = order.clamp_min(0) if perm is None else perm[order.clamp_min(0)]
    padding = (order < 0).unsqueeze(1)
    words = []
    for n0 in range(0, out_features, _COLUMNS_PER_CHUNK):
        q = unpack(packed[n0 : n0 + _COLUMNS_PER_CHUNK], bits, in_features, dim=1)  # int8 [n, K]
        q_kn = q.t()[source].masked_fill(padding, 0)  # [K_pad, n] in packed order; padding multiplies zeros
        words.append(pack(q_kn.contiguous(), bits, dim=0))
    zeros = None
    if zero_packed is not None:
        zeros = unpack(zero_packed, bits, out_features, dim=0).t().contiguous()  # int8 [groups, N]
    return KernelWeight(
        qweight=interleave_word_rows(torch.cat(words, dim=1)),
        scales=scale.t().contiguous(),
        zeros=zeros,
        perm=perm,
        in_features=in_features,
        out_features=out_features,
        bits=bits,
        group_len=group,
    )


def kernel_weight_values(kw: KernelWeight) -> torch.Tensor:
    """The int8 values ``[N, K]`` of a kernel layout, inputs in kernel (permuted) order."""
    q_kn = unpack(word_rows(kw.qweight), kw.bits, kw.qweight.shape[0] * kw.pack, dim=0)  # [K_pad, N], packed order
    order = tile_order(kw.in_features, kw.bits, q_kn.device)
    q = torch.empty(kw.in_features, kw.out_features, dtype=torch.int8, device=q_kn.device)
    q[order[order >= 0]] = q_kn[order >= 0]
    return q.t().contiguous()


def dequantize_kernel_weight(kw: KernelWeight, dtype: torch.dtype) -> torch.Tensor:
    """Reference: the dense weight ``[N, K]`` (inputs in kernel order) a KernelWeight encodes."""
    scheme = QuantScheme(kw.bits, kw.group_len, kw.zeros is None)
    zero = None if kw.zeros is None else kw.zeros.t()
    return dequantize(kernel_weight_values(kw), kw.scales.t(), zero, scheme, dtype)


def reference_matmul(x: torch.Tensor, kw: KernelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for ``quant_matmul``: ``x @ W.T + bias`` from the kernel layout, in plain PyTorch."""
    if kw.perm is not None:
        x = x.index_select(-1, kw.perm)
    return torch.nn.functional.linear(x, dequantize_kernel_weight(kw, x.dtype), bias)
