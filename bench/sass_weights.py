"""The weight kernels' cases for bench/sass.py: ``quant_matmul``'s tensor-core path and the M=1
GEMV (``gemv.py``) at the configurations the runtime launches by default, with issue 15's
budgets; the few-row GEMV (``gemv_rows.py``) at M=4's first candidate; the dense path's
dequantization (``dequantize_weight.py``) at its configurations."""

from __future__ import annotations

from bench.sass_cases import KernelCase, max_registers


# Issue 15's static budgets on sm_90a (thread-instructions of the main loop per weight, etc.);
# the JSON records which ones each configuration meets.
# The GEMV's "asynchronous or software-pipelined loads" is read as: all 16 word rows of a tile
# are loaded one iteration ahead, into registers (cp.async would go through shared memory).
SASS_BUDGETS = {
    "gemv": {"max_loop_instructions_per_unit": 2.5, "min_prefetched_loads": 16, "max_loop_shared_stores": 0,
             "max_loop_barriers": 0},
    "small-m": {"max_loop_instructions_per_unit": 3.5},
    # the few-row GEMV (gemv_rows.py): the GEMV's load budgets, and at most 8 thread-instructions per
    # weight byte (an SM issues 128 a clock; the H200's copy rate is ~16 bytes per SM and clock at an
    # assumed 1.98 GHz: bench/results/gpu/NOTES.md, "Small M"); per weight, 8 * bits / 8 (set per case)
    "gemv-rows": {"max_spill_instructions": 0, "max_loop_shared_stores": 0, "max_loop_barriers": 0},
    # the prefill budget: no spills, registers allowing 2 CTAs per SM, dequantization
    # (bench/sass_dataflow.py's slice, not the whole loop) at most 3 instructions per weight;
    # max_registers is filled in per case from its num_warps (prefill_budgets). min_ctas_per_sm
    # (registers and shared memory) is kept: met, and stricter.
    "prefill": {"max_dequant_instructions_per_unit": 3.0, "max_spill_instructions": 0, "min_ctas_per_sm": 2},
}


def prefill_budgets(num_warps: int) -> dict:
    """The prefill budgets with the register count that lets 2 CTAs of ``num_warps`` share an SM."""
    return {**SASS_BUDGETS["prefill"], "max_registers": max_registers(2, num_warps, 90)}


def weight_cases() -> list[KernelCase]:
    """runtime/kernels/quant_matmul.py at the configurations it launches by default: the first
    candidate of each row range (decode M=1, M=2..16, prefill) for 4-bit group 128 asymmetric
    (the budgets' case) in fp16 and bf16, and 8-bit group 128 asymmetric in fp16."""
    from runtime.kernels.quant_matmul import TMA_MIN_BLOCK_M, KernelWeight, candidate_configs

    kw = KernelWeight(None, None, None, None, 8192, 8192, 4, 128)  # only shape fields are read
    cases = []
    for bits, dtype in ((4, "fp16"), (4, "bf16"), (8, "fp16")):
        kw.bits = bits
        cases.append(gemv_case(kw, dtype))
        cases.append(gemv_rows_case(kw, dtype, 4))
        for label, M in (("small-m", 16), ("prefill", 4096)):
            config = candidate_configs(M, kw)[0]
            for arch in ("sm_90a", "sm_80"):  # activations by TMA only where the GPU has it
                cases.append(dot_case(kw, dtype, label, M, config, arch,
                                      arch == "sm_90a" and config.block_m >= TMA_MIN_BLOCK_M))
    return cases


def dot_case(kw, dtype: str, label: str, M: int, config, arch: str, x_tma: bool) -> KernelCase:
    """runtime/kernels/quant_matmul.py's tensor-core path at ``config`` for ``arch``."""
    from runtime.kernels.quant_matmul import TORCH_DTYPES, _quant_matmul_kernel, dequant_type

    split = config.split_k > 1
    signature = {"x_ptr": f"*{dtype}", "x_desc": f"tensordesc<{dtype}[{config.block_m}, {kw.tile_k}]>" if x_tma
                 else f"*{dtype}", "qw_ptr": "*i32", "s_ptr": f"*{dtype}", "z_ptr": "*i8",
                 "bias_ptr": f"*{dtype}", "out_ptr": "*fp32" if split else f"*{dtype}",
                 "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "tiles_per_split": "i32"}
    constexprs = dict(BITS=kw.bits, GROUP=128, HAS_ZERO=True, SCALE_PER_TILE=128 % kw.tile_k == 0,
                      HAS_BIAS=False, SPLIT=split, DOT_IN_FP32=False,
                      DEQUANT=dequant_type(kw.bits, TORCH_DTYPES[dtype], False), DEQUANT_ASM=True,
                      BLOCK_M=config.block_m, BLOCK_N=config.block_n, GROUP_M=config.group_m,
                      STEP_TILES=config.step_tiles, X_TMA=x_tma,
                      EVEN_N=kw.out_features % config.block_n == 0,  # as launch passes them
                      STEP_GROUP=128 % (kw.tile_k * config.step_tiles) == 0)
    steps = f" {config.step_tiles}tiles" if config.step_tiles > 1 else ""  # K tiles per main-loop iteration
    return KernelCase(
        name=f"w{kw.bits}g128 {dtype} {label} {config.block_m}x{config.block_n} split{config.split_k}{steps}"
             + (" tma" if x_tma else ""),
        kernel_fn=_quant_matmul_kernel, signature=signature, constexprs=constexprs,
        num_warps=config.num_warps, num_stages=config.num_stages,
        units_per_iteration=config.block_n * kw.tile_k * config.step_tiles, archs=(arch,),
        # aligned tensors, and sizes and row strides divisible by 16, as real layers have
        divisible_by_16=("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "bias_ptr", "out_ptr", "N", "K", "stride_xm"),
        notes=f"default candidate for M={M} (candidate_configs(M)[0])" + (", activations by TMA" if x_tma else ""),
        budgets={"sm_90a": prefill_budgets(config.num_warps) if label == "prefill" else SASS_BUDGETS[label]})


def gemv_case(kw, dtype: str) -> KernelCase:
    """runtime/kernels/gemv.py at M=1's default candidate for an 8192 x 8192 layer."""
    from runtime.kernels.gemv import _gemv_kernel, pair_type
    from runtime.kernels.quant_matmul import TORCH_DTYPES, candidate_configs

    config = candidate_configs(1, kw)[0]
    split = config.split_k > 1
    signature = {"x_ptr": f"*{dtype}", "qw_ptr": "*i32", "s_ptr": f"*{dtype}", "z_ptr": "*i8",
                 "bias_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "part_ptr": "*fp32", "count_ptr": "*i32",
                 "K": "i32", "tiles_per_split": "i32"}
    constexprs = dict(N=kw.out_features, BITS=kw.bits, GROUP=kw.group_len, HAS_ZERO=True, HAS_BIAS=False,
                      SPLIT=split, PAIR=pair_type(kw.bits, TORCH_DTYPES[dtype]), ASM=True, EVEN_K=True,
                      BLOCK_N=config.block_n, WARPS=config.num_warps)
    return KernelCase(
        name=f"w{kw.bits}g{kw.group_len} {dtype} gemv 1x{config.block_n} w{config.num_warps} split{config.split_k}",
        kernel_fn=_gemv_kernel, signature=signature, constexprs=constexprs,
        num_warps=config.num_warps, num_stages=1,
        # a main-loop iteration: one K tile per warp, BLOCK_N columns
        units_per_iteration=config.num_warps * config.block_n * kw.tile_k,
        divisible_by_16=("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "bias_ptr", "out_ptr", "part_ptr", "count_ptr", "K"),
        notes="default candidate for M=1 (candidate_configs(1)[0])", budgets={"sm_90a": SASS_BUDGETS["gemv"]})


def gemv_rows_case(kw, dtype: str, M: int) -> KernelCase:
    """runtime/kernels/gemv_rows.py at M rows' first few-row candidate for an 8192 x 8192 layer."""
    from runtime.kernels.gemv import pair_type
    from runtime.kernels.gemv_rows import _gemv_rows_kernel
    from runtime.kernels.matmul_configs import few_row_gemvs
    from runtime.kernels.quant_matmul import TORCH_DTYPES

    config = few_row_gemvs(M, kw, TORCH_DTYPES[dtype])[0]
    signature = {"x_ptr": f"*{dtype}", "qw_ptr": "*i32", "s_ptr": f"*{dtype}", "z_ptr": "*i8",
                 "bias_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "part_ptr": "*fp32", "count_ptr": "*i32",
                 "M": "i32", "K": "i32", "stride_x": "i32", "tiles_per_split": "i32"}
    constexprs = dict(N=kw.out_features, BITS=kw.bits, GROUP=kw.group_len, HAS_ZERO=True, HAS_BIAS=False,
                      SPLIT=config.split_k > 1, PAIR=pair_type(kw.bits, TORCH_DTYPES[dtype]), ASM=True, EVEN_K=True,
                      BLOCK_N=config.block_n, WARPS=config.num_warps, ROWS=config.block_m)
    return KernelCase(
        name=f"w{kw.bits}g{kw.group_len} {dtype} gemv-rows {config.block_m}x{config.block_n} w{config.num_warps} "
             f"split{config.split_k}",
        kernel_fn=_gemv_rows_kernel, signature=signature, constexprs=constexprs,
        num_warps=config.num_warps, num_stages=1,
        units_per_iteration=config.num_warps * config.block_n * kw.tile_k,  # one K tile per warp
        divisible_by_16=("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "bias_ptr", "out_ptr", "part_ptr", "count_ptr", "K",
                         "stride_x"),
        notes=f"first few-row GEMV candidate for M={M} (matmul_configs.few_row_gemvs; tl.dot stays the default)",
        budgets={"sm_90a": {**SASS_BUDGETS["gemv-rows"], "max_loop_instructions_per_unit": float(kw.bits),
                            "min_prefetched_loads": 4 * config.block_n // 32}})


# The dense path's dequantization (runtime/kernels/dequantize_weight.py): one K tile a program, no
# loop. Read by the whole kernel: no spills, every global store 16 bytes wide, and at most 3
# barriers (the packed words, not the dense tile, go through shared memory to the store's layout).
DEQUANTIZE_BUDGETS = {"max_spill_instructions": 0, "global_stores_only": "STG.E.128", "max_kernel_barriers": 3}


def dequantize_cases() -> list[KernelCase]:
    """runtime/kernels/dequantize_weight.py at the dense configurations ``candidate_configs`` offers
    for prefill, 4-bit group 128 asymmetric in fp16 and bf16, 8-bit in fp16."""
    from runtime.kernels.dequantize_weight import _dequantize_kernel
    from runtime.kernels.quant_matmul import TORCH_DTYPES, KernelWeight, candidate_configs, dequant_type

    kw = KernelWeight(None, None, None, None, 8192, 8192, 4, 128)  # only shape fields are read
    cases = []
    for bits, dtype in ((4, "fp16"), (4, "bf16"), (8, "fp16")):
        kw.bits = bits
        for config in [c for c in candidate_configs(4096, kw) if c.dense]:
            constexprs = dict(BITS=bits, GROUP=128, HAS_ZERO=True, SCALE_PER_TILE=128 % kw.tile_k == 0,
                              DEQUANT=dequant_type(bits, TORCH_DTYPES[dtype], False), DEQUANT_ASM=True,
                              BLOCK_N=config.block_n, EVEN_N=True, EVEN_K=True)
            cases.append(KernelCase(
                name=f"w{bits}g128 {dtype} dequantize {config.block_n}x{kw.tile_k} w{config.num_warps}",
                kernel_fn=_dequantize_kernel,
                signature={"qw_ptr": "*i32", "s_ptr": f"*{dtype}", "z_ptr": "*i8", "out_ptr": f"*{dtype}",
                           "N": "i32", "K": "i32"},
                constexprs=constexprs, num_warps=config.num_warps, num_stages=1,
                divisible_by_16=("qw_ptr", "s_ptr", "z_ptr", "out_ptr", "N", "K"),
                notes="a dense configuration of candidate_configs(4096) (dequantize into scratch + cuBLAS)",
                budgets={"sm_90a": DEQUANTIZE_BUDGETS}))
    return cases
