"""The quantized matmul's launch configurations: what the autotuner times for M rows, and how rows
are bucketed for tuning (``runtime.kernels.quant_matmul`` times them and launches the winner)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from runtime.kernels.gemv import default_split
from runtime.kernels.gemv_rows import MAX_ROWS, supports as gemv_rows_supports
from runtime.kernels.weight_layout import KernelWeight

DECODE_MAX_M = 16  # up to here the decode candidates (GEMV, split-K) are tuned
# Dense configurations (dequantize into scratch + cuBLAS) are offered above this many rows only.
# They add a fixed cost per call, independent of M: reading the packed weight and writing, then
# re-reading, its dense copy (W4 fp16: about 4.5 bytes per weight against the fused kernel's 0.5),
# which only large M can hide behind a GEMM doing 2 M flops per weight; the fused kernel's measured
# loss to cuBLAS is at prefill sizes (M=4096 on the H200: bench/results/gpu/NOTES.md). And the engine
# captures decode steps in CUDA graphs for batches up to 256 (runtime.execution.DecodeGraphs): a
# dense configuration must never be chosen for an M a graph holds (the scratch buffer would be
# captured), so 256 is also the floor. Whether it wins above is the tuner's timing on the GPU.
DENSE_MIN_M = 257
# Triton issue 9433: releases before this one pipeline a one-K-tile tl.dot loop with wgmmas still
# reading their A registers (the dequantized weight) when the next iteration writes them (PTX:
# undefined behaviour; the H200's wrong 3-stage results, bench/results/gpu/NOTES.md). Two tiles per
# iteration compile to wait_group 0. bench/wgmma_hazard.py on sm_90a (bench/results/kernels/NOTES.md):
# one-tile candidates hazardous under 3.6.0 (all but some W8 bf16), 3.7.1 and 3.8.0, none under 3.9.0;
# two-tile ones free under each.
WGMMA_HAZARD_FIXED_IN = (3, 9)


@dataclass(frozen=True)
class MatmulConfig:
    """One launch configuration. ``use_dot=False``: the GEMV path, ``block_m`` rows a program (1: gemv.py,
    M=1 only; 2..16: gemv_rows.py, any M); ``dense``:
    dequantize into a scratch ``[N, K]`` weight (``dequantize_weight.py``, ``block_n`` outputs a
    program, ``num_warps``) and one cuBLAS GEMM (no row tile: ``block_m == 1``, ``use_dot=False``)."""

    block_m: int
    block_n: int
    split_k: int = 1
    use_dot: bool = True
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    step_tiles: int = 1  # K tiles per loop iteration (more: fewer loop instructions per weight)
    dense: bool = False  # dequantize into scratch, then torch.matmul (cuBLAS)

    def __post_init__(self):
        if any(b & (b - 1) for b in (self.block_m, self.block_n)):
            raise ValueError(f"block sizes must be powers of two, got {self.block_m}x{self.block_n}")
        if not self.use_dot and self.block_m > MAX_ROWS:
            raise ValueError(f"the GEMV path (use_dot=False) takes at most {MAX_ROWS} rows a program (block_m)")
        if self.use_dot and self.block_m < 16:
            raise ValueError("tl.dot needs block_m >= 16")
        if self.dense and (self.use_dot or self.block_m != 1 or self.split_k != 1):
            raise ValueError("a dense configuration has no row tile or K split of its own: block_m=1, "
                             "use_dot=False, split_k=1")


def m_bucket(M: int) -> int:
    """Rows are tuned exactly up to DECODE_MAX_M, then per power of two."""
    return M if M <= DECODE_MAX_M else 1 << (M - 1).bit_length()


def candidate_configs(M: int, kw: KernelWeight, dtype: torch.dtype | None = None) -> list[MatmulConfig]:
    """What the autotuner times for M rows (``dtype``: the activations', None where any may come); the
    first is the untimed default. Under a Triton release with issue 9433's hazard, tl.dot
    configurations in their hazard-free form (``hazard_free``)."""
    num_tiles = triton.cdiv(kw.in_features, kw.tile_k)
    if M == 1:  # the GEMV: 4 or 2 columns a thread, K split to fill the GPU (gemv.default_split)
        configs = []
        for bn, w in ((128, 4), (128, 8), (64, 4), (64, 8)):
            split = default_split(kw.out_features, num_tiles, bn, w)
            configs += [MatmulConfig(1, bn, s, use_dot=False, group_m=1, num_warps=w)
                        for s in dict.fromkeys((split, max(1, split // 2), 2 * split))]
    elif M <= DECODE_MAX_M:  # two K tiles per iteration, two stages (the same two tiles ahead as
        # three stages of one): 3.13 SASS instructions per weight against 3.81 (W4 16x64, sm_90a)
        # (W8: four tiles, 4.22 against 4.31, for twice the shared memory: not taken)
        configs = [MatmulConfig(16, bn, s, group_m=1, num_stages=2, step_tiles=2) for bn in (64, 128, 32)
                   for s in (4, 8, 2, 1, 16)]
        configs += [MatmulConfig(16, 256, s, group_m=1, num_warps=8, num_stages=2, step_tiles=2) for s in (1, 2)]
        # Two stages wait for every copy at the top of each iteration and issue the next ones at its
        # bottom (no overlap of a CTA's loads with its math); three or four keep one or two
        # iterations' copies in flight (sm_90a, Triton 3.6: bench/results/gpu/NOTES.md, "Small M")
        configs += [MatmulConfig(16, 64, s, group_m=1, num_stages=st, step_tiles=2) for st, s in
                    ((3, 4), (3, 8), (3, 2), (4, 4))]
        configs += few_row_gemvs(M, kw, dtype)
    elif M <= 64:
        configs = [MatmulConfig(bm, bn, s) for bm in (32, 64) for bn in (64, 128) for s in (2, 1, 4)]
    else:  # the dequantized tile is shared by block_m rows: large row tiles amortize it. First (the
        # untimed default): 128x64 on 4 warps, which fits 2 CTAs per SM on sm_90a by registers and
        # shared memory (128x128 on 8 warps holds 1; bench/README.md, sass.py); the GPU's timing
        # decides among them
        configs = [MatmulConfig(bm, bn, 1, num_warps=w, num_stages=st)
                   for bm, bn, w in ((128, 64, 4), (128, 128, 8), (64, 128, 4), (128, 256, 8), (256, 128, 8),
                                     (64, 256, 8))
                   for st in (3, 4, 2)]
        if M >= DENSE_MIN_M:  # see DENSE_MIN_M. 64 weights a thread (4-bit): the compiler then moves the
            # packed words, not the dense tile, through shared memory (3 barriers; at 128 a thread it
            # moved the whole fp16 tile, 39 barriers; sm_90a, Triton 3.6 and 3.9, bench/results/kernels/NOTES.md)
            configs += [dense_config(64, 4), dense_config(128, 8)]
    kept = [c for c in configs if c.split_k <= num_tiles]
    return hazard_free(kept or [MatmulConfig(1, 64, 1, use_dot=False) if M == 1 else MatmulConfig(16, 64)])


GEMV_ROWS_MAX_M = 8  # the few-row GEMV is offered up to here (its packed fmas grow with the rows)


def few_row_gemvs(M: int, kw: KernelWeight, dtype: torch.dtype | None) -> list[MatmulConfig]:
    """gemv_rows.py's candidates for M rows: all M rows in one program (the weight read once), 4 or 2
    columns a thread (8 rows: 2 or 1, for registers), K split to fill the GPU. From 2 to
    ``GEMV_ROWS_MAX_M`` rows: sm_90a SASS (Triton 3.6, W4 fp16) has 2.7 / 4.1-4.4 / 7.4 loop
    instructions per weight at 2 / 4 / 8 rows, against an SM's 128 a clock; at 16 rows, 15.4
    (bench/results/gpu/NOTES.md, "Small M"). Formats it runs: ``gemv_rows.supports``."""
    if not 1 < M <= GEMV_ROWS_MAX_M or not gemv_rows_supports(kw.bits, dtype):
        return []
    rows = 1 << (M - 1).bit_length()
    num_tiles = triton.cdiv(kw.in_features, kw.tile_k)
    configs = []
    for bn in (128, 64) if rows <= 4 else (64, 32):
        split = default_split(kw.out_features, num_tiles, bn, 4)
        configs += [MatmulConfig(rows, bn, s, use_dot=False, group_m=1, num_stages=1)
                    for s in dict.fromkeys((split, max(1, split // 2), 2 * split))]
    return configs


def wgmma_hazard(version: str | None = None) -> bool:
    """Whether a Triton release (default: the installed one) compiles one-tile tl.dot loops with
    issue 9433's register hazard (``WGMMA_HAZARD_FIXED_IN``)."""
    release = tuple(int(part) for part in (version or triton.__version__).split(".")[:2])
    return release < WGMMA_HAZARD_FIXED_IN


def hazard_free(configs: list[MatmulConfig]) -> list[MatmulConfig]:
    """``configs`` as offered under the installed Triton: where it carries the hazard, each one-tile
    tl.dot configuration becomes two tiles an iteration on two stages (the decode rows' form: the
    same two tiles ahead as three stages of one; speed unmeasured), duplicates dropped. On every
    GPU: the tuner's candidates do not depend on the device."""
    if not wgmma_hazard():
        return configs
    return list(dict.fromkeys(dataclasses.replace(c, step_tiles=2, num_stages=2) if c.use_dot and c.step_tiles == 1
                              else c for c in configs))


def dense_config(block_n: int = 64, num_warps: int = 4) -> MatmulConfig:
    """A dense configuration (dequantize into scratch + cuBLAS): ``block_n`` outputs of one K tile a
    program of ``num_warps`` warps."""
    return MatmulConfig(1, block_n, 1, use_dot=False, group_m=1, num_warps=num_warps, num_stages=1, dense=True)
