"""Dequant-fused matmul for pack-quantized weights (Triton): ``y = x @ W.T + b``, W4A16/W8A16.

One kernel, two inner loops, chosen per call by the number of rows M:

* ``use_dot`` (prefill, and small M through a 16-row tile): each K tile of weights is
  dequantized in registers to the activation dtype (fp16/bf16) and fed to ``tl.dot`` with an
  fp32 accumulator; the dequantized tile never touches global memory, so the weight bytes
  read are the packed ones. The product is computed transposed, ``out.T = W @ x.T``, so the
  dequantized weight is the *first* operand: tensor-core instructions take that one from
  registers (Hopper's wgmma takes only the first from registers, the second must sit in
  shared memory), while the activations stream into shared memory asynchronously. With W
  second, the compiled code stored every dequantized tile to shared memory first and waited
  on each wgmma; transposed, it keeps W in registers and overlaps the next tile's
  dequantization with the running wgmma (read off the sm_90 PTX; not timed). Small M also
  maps better: the rows become wgmma's narrow N dimension (down to 8) instead of a 64-row M.
  The layout puts each register pair of inputs (k, k + 1) 16 bits apart in one word
  (``weight_tile``), so the dequantized tile is built in the operand's registers with no byte
  permutes and no trip through shared memory. Tile pointers are made once and advanced by a
  scalar; rows past M read row M - 1 (never stored) and only the last, partial K tile masks
  activations, so the loop's loads carry no per-element masks. Row tiles of 64 rows and more
  read the activations through a TMA descriptor instead where the GPU has TMA
  (``activations_by_tma``): no per-tile address math or copies in the loop, zeros past M and K.
  ``step_tiles`` runs several K tiles per iteration (two for small M), sharing the loop's own
  instructions between them.
* GEMV (``use_dot=False`` configurations): runtime/kernels/gemv.py for M == 1 (``block_m`` 1), its
  own kernel (each thread owns whole columns; packed 16-bit multiply-adds on CUDA cores; K splits
  reduced inside the one launch); runtime/kernels/gemv_rows.py, the same design for ``block_m`` (2..16)
  rows a program, each weight pair unpacked once for all of them (tuner candidates up to 8 rows).
* dense (``dense=True`` configurations, offered from ``matmul_configs.DENSE_MIN_M`` = 257 rows):
  the weight dequantized into a reused scratch ``[N, K]`` buffer by runtime/kernels/dequantize_weight.py
  (the same tile code as the dot path, so the same values bit for bit), then one cuBLAS GEMM
  (``torch.mm``). It costs one layer's dense weight in memory and its write and re-read per call;
  the tuner keeps it only where it times faster on the GPU at hand (unmeasured so far).

The dot path splits K across programs when the output alone has too few tiles to fill the
GPU: each split writes fp32 partial sums and a small kernel adds them (with the bias) in a
fixed order, so results are deterministic. The configuration (tile sizes, split, path) is autotuned per
(M bucket, N, K, bits, group, dtype) on first use and cached for the process.

Dequantization follows ``quant.affine``: ``w = (q - zero) * scale`` with ``q`` signed. Stored
values are ``u = q + 2**(bits-1)``. No integer-to-float conversion instruction (a
low-throughput one) runs per weight: the kernel works in the activation dtype, two weights per
instruction (``scaled_difference``): ``1024 + u`` in fp16 (``128 + u`` in bf16, 4 bits and
fewer; ``packed_pairs.magic_pairs``) from one LOP3 per pair (in fp16
``1024 + u * 2**r`` for a field at bit r of its byte: one shift per byte), then packed
``fma.rn.f16x2``/``bf16x2`` for ``(v * 2**-r - offset) * scale``, which rounds ``(q - zero) * scale`` to
the activation dtype once, exactly as ``quant.affine.dequantize(...).to(dtype)`` does (with the
scale first converted to the activation dtype: a bf16 scale below fp16's normal range would be
rounded twice), so both see the same weight. 8-bit bf16 (and bf16 in the interpreter) works in
fp32 with the ``2**23`` form of the same trick (OR the integer into the mantissa of 2**23,
subtract 2**23 + offset).

The reference is ``weight_layout.reference_matmul`` (and, from the checkpoint tensors,
``reference.dequantize_weight`` + ``reference.quant_linear``); tests run these kernels in the
Triton interpreter on CPU against it, and compile them for sm_80/sm_90 without a GPU to check
the properties above in the generated code (tests/kernels_aot.py). Speed is measured only by
bench/kernels.py on a GPU.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from runtime.kernels import matmul_tuning
from runtime.kernels.dequantize_weight import dequantize_into, scratch
from runtime.kernels.gemv import launch_gemv
from runtime.kernels.gemv_rows import launch_gemv_rows
from runtime.kernels.matmul_configs import MatmulConfig, candidate_configs, m_bucket  # noqa: F401 (callers read them here too)
from runtime.kernels.weight_layout import SUBTILE_K, KernelWeight
from runtime.kernels.weight_tile import dequantized, group_rows, input_order, integer_tile, tile_groups

try:  # host-side TMA descriptors (Triton 3.4 and later)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: activations through pointers
    TensorDescriptor = None

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TMA_MIN_BLOCK_M = 64  # row tiles from here on read activations by TMA where the GPU has it
_SUBTILE_K = tl.constexpr(SUBTILE_K)  # jit functions read module globals only as constexpr


@triton.jit
def _activation_tile(x_tile, m0, k0, K, TILE_K: tl.constexpr, MASK_K: tl.constexpr, X_TMA: tl.constexpr):
    """Rows ``m0 .. m0 + block_m`` of the activations, inputs ``k0 .. k0 + TILE_K``: through the
    tensor descriptor ``x_tile`` (``X_TMA``: TMA, which fills rows past M and inputs past K with
    zeros), else through the tile pointers ``x_tile`` (``MASK_K``: the tile passes K)."""
    if X_TMA:
        x = x_tile.load([m0, k0])
    elif MASK_K:
        x = tl.load(x_tile + k0, mask=(k0 + tl.arange(0, TILE_K) < K)[None, :], other=0.0)
    else:
        x = tl.load(x_tile + k0)
    return x


@triton.jit
def _tile_step(acc, k0, k_group, w_rows, x_tile, m0, x_ptr, s_ptr, z_ptr, offs_n, n_mask, N, K,
               BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, SCALE_PER_TILE: tl.constexpr,
               DOT_IN_FP32: tl.constexpr, DEQUANT: tl.constexpr, DEQUANT_ASM: tl.constexpr, MASK_K: tl.constexpr,
               X_TMA: tl.constexpr):
    """One K tile (inputs ``k0 .. k0 + tile_k``) added into ``acc``, with the scales and zeros of
    the group(s) of input ``k_group`` (``k0``, or the first input of a loop iteration whose tiles
    share a group); ``MASK_K``: the tile passes K."""
    PACK: tl.constexpr = 32 // BITS
    TILE_K: tl.constexpr = _SUBTILE_K * PACK
    g = tile_groups(k_group, K, BITS, GROUP, SCALE_PER_TILE)  # [1 or Q, 1 or 4, 1]
    scale = group_rows(s_ptr, g, offs_n, n_mask, N).to(DEQUANT)
    v, unit, offset = integer_tile(w_rows, z_ptr, k0, g, offs_n, n_mask, N, BITS, HAS_ZERO, DEQUANT, DEQUANT_ASM)
    x = _activation_tile(x_tile, m0, k0, K, TILE_K, MASK_K, X_TMA)
    # (q - zero) * scale rounded to the activation dtype (quant.affine.dequantize(...).to(dtype)),
    # [tile_k, BLOCK_N] in input order: the same code dequantize_weight.py writes dense weights with
    w = input_order(dequantized(v, unit, offset, scale, DEQUANT_ASM), x_ptr.dtype.element_ty)
    if DOT_IN_FP32:  # interpreter only: it multiplies bf16 operands as raw integers
        acc = tl.dot(tl.trans(w).to(tl.float32), tl.trans(x).to(tl.float32), acc)
    else:
        acc = tl.dot(tl.trans(w), tl.trans(x), acc)
    return acc


@triton.jit
def _quant_matmul_kernel(
    x_ptr, x_desc, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, tiles_per_split,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, SCALE_PER_TILE: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    DEQUANT: tl.constexpr, DEQUANT_ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    STEP_TILES: tl.constexpr, X_TMA: tl.constexpr, EVEN_N: tl.constexpr, STEP_GROUP: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    Q: tl.constexpr = PACK // 2
    TILE_K: tl.constexpr = _SUBTILE_K * PACK
    # Programs that share weight columns run close together (GROUP_M rows of tiles at a time),
    # so a weight tile read for one block of rows is still in L2 for the next.
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # M * N may pass 2**31 (lm_head)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    if EVEN_N:  # no column past N: loads without a mask (a constant true one folds away; the
        # masked loads of scales and zeros compiled to a zero-fill instruction each)
        n_mask = tl.full(offs_n.shape, True, tl.int1)
    t_start = pid_k * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, tl.cdiv(K, TILE_K))

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # transposed, out.T = W @ x.T: see the module docstring
    # Tile pointers made once, advanced by a scalar per tile. Rows past M read row M - 1 (real
    # memory, no mask per load); their results are never stored. X_TMA: activation tiles come
    # through x_desc, a tensor descriptor over x ([M, K], blocks [BLOCK_M, TILE_K]), instead.
    # word row 4 a + b of column n at a * 4N + 4 n + b of its tile (weight_layout); spelt as one
    # [16, BLOCK_N] tile ([4, 4, BLOCK_N] compiled the same on sm_90a but re-laid the tile
    # through shared memory in 16-bit pieces on sm_80, a longer loop)
    rows = tl.arange(0, _SUBTILE_K)[:, None]
    w_rows = qw_ptr + (rows // 4) * (4 * N) + rows % 4 + 4 * offs_n[None, :]
    m0 = pid_m * BLOCK_M
    if X_TMA:
        x_tile = x_desc
    else:
        x_tile = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm + tl.arange(0, TILE_K)[None, :]
    # Only the last tile of K can be partial: the loop reads activations without a K mask, and
    # the partial tile, if any, runs once after it with one.
    t_full = tl.maximum(tl.minimum(t_end, K // TILE_K), t_start)
    t_steps = t_start + (t_full - t_start) // STEP_TILES * STEP_TILES
    for t in range(t_start, t_steps, STEP_TILES):  # tiles of one iteration share the loop's own work
        for i in tl.static_range(STEP_TILES):
            # STEP_GROUP: the iteration's tiles share one group (t is a multiple of STEP_TILES):
            # their scales and zeros are loaded and converted once
            k_group = t * TILE_K if STEP_GROUP else (t + i) * TILE_K
            acc = _tile_step(acc, (t + i) * TILE_K, k_group, w_rows, x_tile, m0, x_ptr, s_ptr, z_ptr, offs_n, n_mask, N,
                             K, BITS, GROUP, HAS_ZERO, SCALE_PER_TILE, DOT_IN_FP32, DEQUANT, DEQUANT_ASM, False, X_TMA)
    for i in tl.static_range(STEP_TILES - 1):  # the full tiles left over, if any
        if t_steps + i < t_full:
            k0 = (t_steps + i) * TILE_K
            acc = _tile_step(acc, k0, k0, w_rows, x_tile, m0, x_ptr, s_ptr, z_ptr, offs_n, n_mask, N, K,
                             BITS, GROUP, HAS_ZERO, SCALE_PER_TILE, DOT_IN_FP32, DEQUANT, DEQUANT_ASM, False, X_TMA)
    if t_full < t_end:
        k0 = t_full * TILE_K
        acc = _tile_step(acc, k0, k0, w_rows, x_tile, m0, x_ptr, s_ptr, z_ptr, offs_n, n_mask, N, K,
                         BITS, GROUP, HAS_ZERO, SCALE_PER_TILE, DOT_IN_FP32, DEQUANT, DEQUANT_ASM, True, X_TMA)
    acc = tl.trans(acc)

    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:  # fp32 partial sums [split, M, N]; _split_k_sum_kernel adds them
        tl.store(out_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_k_sum_kernel(part_ptr, bias_ptr, out_ptr, M, N,
                        SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # fixed order: the same result every run
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# -- launch -----------------------------------------------------------------------------------------


def dequant_type(bits: int, dtype: torch.dtype, interpreted: bool):
    """The float type the dot path dequantizes weights in: the activation dtype (two weights per
    instruction) where ``magic + u`` is exact in it (fp16: any width here; bf16: up to 4 bits)
    and the interpreter can run it (not bf16); fp32 otherwise."""
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16 and bits <= 4 and not interpreted:
        return tl.bfloat16
    return tl.float32


def activations_by_tma(x2: torch.Tensor, block_m: int, interpreted: bool) -> bool:
    """Whether the activation tiles come through a TMA descriptor: prefill tiles (``block_m >=
    TMA_MIN_BLOCK_M``) on GPUs with TMA (Hopper and later; the interpreter runs the same path on
    CPU), where x meets TMA's rules (16-byte aligned base and row stride). On sm_90a it takes the
    tile's address math and copies out of the main loop (W4 128x64: 282 -> 266 SASS instructions,
    static count); for 16-row tiles it adds more (barrier waits) than it saves, and on sm_80,
    which has no TMA, Triton's emulation spills."""
    if TensorDescriptor is None or block_m < TMA_MIN_BLOCK_M:
        return False
    if x2.data_ptr() % 16 or (x2.stride(0) * x2.element_size()) % 16:
        return False
    if interpreted:
        return True
    return x2.is_cuda and torch.cuda.get_device_capability(x2.device)[0] >= 9


def interpreting() -> bool:
    """Whether these kernels were built for the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_quant_matmul_kernel, InterpretedFunction)


def quant_matmul(x: torch.Tensor, kw: KernelWeight, bias: torch.Tensor | None = None,
                 config: MatmulConfig | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x [..., in_features]`` in fp16/bf16; the result has x's dtype.

    ``config`` forces a launch configuration (tests, benchmarks); by default it is autotuned.
    """
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"quant_matmul takes fp16 or bf16 activations, got {x.dtype}")
    if x.shape[-1] != kw.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {kw.in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, kw.in_features)
    if kw.perm is not None:  # act-order: inputs in the weight's (group-sorted) column order
        x2 = x2.index_select(1, kw.perm)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape[0], kw.out_features
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*lead, N)
    config = config or choose_config(M, kw, x.dtype, x.device)
    if not config.use_dot and not config.dense and config.block_m == 1 and M != 1:
        raise ValueError(f"the one-row GEMV configuration (block_m=1) computes one row, got M={M}")
    launch(x2, kw, bias, out, config)
    return out.reshape(*lead, N)


def launch(x2: torch.Tensor, kw: KernelWeight, bias: torch.Tensor | None, out: torch.Tensor,
           config: MatmulConfig) -> None:
    """One configuration's launch into ``out [M, N]``; ``x2 [M, K]`` has unit column stride and its
    columns already in the weight's (act-order) order, as ``quant_matmul`` passes them."""
    if config.dense:  # the weight dequantized into scratch, then one cuBLAS GEMM
        with scratch(kw.out_features, kw.in_features, x2.dtype, x2.device) as weight:
            dense_weight(kw, weight, config)
            if bias is None:
                torch.mm(x2, weight.t(), out=out)
            else:
                torch.addmm(bias.to(x2.dtype), x2, weight.t(), out=out)
        return
    if not config.use_dot and config.block_m == 1:  # one row: runtime/kernels/gemv.py
        launch_gemv(x2, kw, bias, out, config.block_n, config.num_warps, config.split_k, interpreting())
        return
    if not config.use_dot:  # block_m rows a program: runtime/kernels/gemv_rows.py
        launch_gemv_rows(x2, kw, bias, out, config.block_m, config.block_n, config.num_warps, config.split_k,
                         interpreting())
        return
    M, K = x2.shape
    N = kw.out_features
    num_tiles = triton.cdiv(K, kw.tile_k)
    # One group per row: any group length works; give the kernel the padded length so every
    # tile maps to group 0 with the per-tile scale load.
    group = kw.group_len if kw.num_groups > 1 else num_tiles * kw.tile_k
    step_group = group % (kw.tile_k * config.step_tiles) == 0  # an iteration's tiles share a group
    tiles_per_split = triton.cdiv(num_tiles, config.split_k)
    if step_group:  # splits start on an iteration boundary, so on a group boundary
        tiles_per_split = triton.cdiv(tiles_per_split, config.step_tiles) * config.step_tiles
    splits = triton.cdiv(num_tiles, tiles_per_split)  # no empty split
    target = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=out.device)
    grid = (triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n), splits)
    x_tma = activations_by_tma(x2, config.block_m, interpreting())
    x_desc = TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [config.block_m, kw.tile_k]) if x_tma else x2
    _quant_matmul_kernel[grid](
        x2, x_desc, kw.qweight, kw.scales, kw.zeros if kw.zeros is not None else kw.scales,
        bias if bias is not None else kw.scales, target,
        M, N, K, x2.stride(0), tiles_per_split,
        BITS=kw.bits, GROUP=group, HAS_ZERO=kw.zeros is not None, SCALE_PER_TILE=group % kw.tile_k == 0,
        HAS_BIAS=bias is not None and splits == 1, SPLIT=splits > 1,
        DOT_IN_FP32=interpreting() and x2.dtype == torch.bfloat16,
        DEQUANT=dequant_type(kw.bits, x2.dtype, interpreting()), DEQUANT_ASM=not interpreting(),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, GROUP_M=config.group_m, STEP_TILES=config.step_tiles,
        X_TMA=x_tma, EVEN_N=N % config.block_n == 0, STEP_GROUP=step_group,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        block = 1024
        _split_k_sum_kernel[(triton.cdiv(M * N, block),)](
            target, bias if bias is not None else target, out, M, N,
            SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=block,
        )


def dense_weight(kw: KernelWeight, weight: torch.Tensor, config: MatmulConfig) -> None:
    """``kw`` dequantized into ``weight [N, K]`` (fp16/bf16: the activation dtype), inputs in the
    weight's (act-order) order, by a dense configuration's launch."""
    dequantize_into(kw, weight, config.block_n, config.num_warps,
                    dequant_type(kw.bits, weight.dtype, interpreting()), not interpreting())


# -- choosing a configuration -----------------------------------------------------------------------

_TUNED: dict[tuple, MatmulConfig] = {}
_NO_CONFIGURATION: dict[tuple, str] = {}  # shapes tuning found no configuration for: why (not tuned again)


def choose_config(M: int, kw: KernelWeight, dtype: torch.dtype, device: torch.device) -> MatmulConfig:
    """The tuned configuration for this shape, timed and checked against the reference on first use
    (``runtime/kernels/matmul_tuning.py``).

    Not timed (the first candidate not known to fail is used, and not cached) where ``tunes_on`` says no. When no
    candidate runs and matches the reference, every call for the shape raises
    ``matmul_tuning.NoConfiguration`` (tuned once: the outcome is kept); ``QuantLinear`` then runs
    the dense reference for those rows.
    """
    key = (m_bucket(M), kw.out_features, kw.in_features, kw.bits, kw.group_len, kw.zeros is None,
           dtype, str(device))
    if key in _TUNED:
        return _TUNED[key]
    if key in _NO_CONFIGURATION:
        raise matmul_tuning.NoConfiguration(_NO_CONFIGURATION[key])  # a new error: no traceback piles up
    candidates = candidate_configs(M, kw, dtype)
    if not tunes_on(device):  # the first candidate not known to be wrong here (a bucket first met in a capture)
        kept, left_out = matmul_tuning.usable(candidates, kw, dtype, device)
        if not kept:
            raise matmul_tuning.NoConfiguration(f"quant_matmul ({matmul_tuning.shape_name(M, kw, dtype)}): every "
                                                f"candidate is known to fail here: " + "; ".join(left_out))
        return kept[0]
    try:
        _TUNED[key] = matmul_tuning.tune(m_bucket(M), kw, dtype, device, candidates, launch)
    except matmul_tuning.NoConfiguration as e:
        _NO_CONFIGURATION[key] = str(e)
        raise
    return _TUNED[key]


def tunes_on(device: torch.device) -> bool:
    """Whether ``choose_config`` times the candidates: on CUDA with the compiled kernels, not in the
    interpreter, and not during CUDA-graph capture (run each shape once before capturing so the
    graph holds the tuned launch). The seam tests replace to tune in the interpreter."""
    return device.type == "cuda" and not interpreting() and not torch.cuda.is_current_stream_capturing()
