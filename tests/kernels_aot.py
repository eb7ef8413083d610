"""Compile runtime/kernels/quant_matmul.py for NVIDIA GPUs on a machine without one, and print
facts about the generated code as JSON (used by tests/test_kernels_linear.py).

    python tests/kernels_aot.py '[{"arch": 90, "dtype": "bf16", "bits": 4, "group": 128, ...}]'

The Triton wheel ships ptxas, so the whole pipeline down to a cubin runs without a GPU: this
catches compile errors the interpreter never sees (layouts, dot shapes, shared memory). It uses
Triton's compiler entry points (``ASTSource``, ``GPUTarget``), which are internal: keep it out
of the library. Must run without TRITON_INTERPRET (compiled, not interpreted, kernels).
"""

import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from runtime.kernels import quant_matmul as qm


def compile_case(case: dict):
    fn = qm._quant_matmul_kernel
    dtype, split, tma = case["dtype"], case["split"], case.get("tma", False)
    tile_k = 16 * 32 // case["bits"]
    signature = {"x_ptr": f"*{dtype}", "x_desc": f"tensordesc<{dtype}[{case['block_m']}, {tile_k}]>" if tma
                 else f"*{dtype}", "qw_ptr": "*i32", "s_ptr": f"*{dtype}", "z_ptr": "*i8",
                 "bias_ptr": f"*{dtype}", "out_ptr": "*fp32" if split else f"*{dtype}",
                 "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "tiles_per_split": "i32"}
    constants = dict(BITS=case["bits"], GROUP=case["group"], HAS_ZERO=case["zero"],
                     SCALE_PER_TILE=case["group"] % (16 * 32 // case["bits"]) == 0, HAS_BIAS=not split,
                     SPLIT=split, DOT_IN_FP32=False,
                     DEQUANT=qm.dequant_type(case["bits"], qm.TORCH_DTYPES[dtype], False),
                     DEQUANT_ASM=True,
                     BLOCK_M=case["block_m"], BLOCK_N=case["block_n"], GROUP_M=8,
                     STEP_TILES=case.get("step_tiles", 1), X_TMA=tma, EVEN_N=True,
                     STEP_GROUP=case["group"] % (tile_k * case.get("step_tiles", 1)) == 0)
    signature.update({name: "constexpr" for name in constants})
    # what Triton specializes at launch for aligned tensors and sizes divisible by 16
    divisible = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "bias_ptr", "out_ptr", "N", "K", "stride_xm")
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", case["arch"], 32),
                          options={"num_warps": case["num_warps"], "num_stages": 3})


def facts(kernel) -> dict:
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    # "... = ttng.warp_group_dot %a, %b, %c {attributes} : <type of a> * <type of b> -> ..."
    dots = [m.group(1) for m in re.finditer(r"warp_group_dot %.*?\}\s*:\s*(\S+)", ttgir)]
    return {
        "shared_bytes": kernel.metadata.shared,
        # integer-to-float conversions of 32-bit values (the per-weight path must have none)
        "int32_to_float": len(re.findall(r"cvt\.rn\.f(?:16|32)\.[su]32", ptx)),
        "wgmma": "wgmma.mma_async" in ptx,
        "mma_sync": "mma.sync" in ptx,
        # where wgmma reads its first operand (the dequantized weight) from
        "wgmma_first_operand": sorted({"registers" if d.startswith("tensor") else "shared" for d in dots}),
        # the packed 16-bit dequantization (inline assembly in scaled_difference)
        "packed_half_fma": len(re.findall(r"fma\.rn\.b?f16x2", ptx)),
        # activation tiles by TMA (the X_TMA path)
        "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
    }


if __name__ == "__main__":
    print(json.dumps([facts(compile_case(case)) for case in json.loads(sys.argv[1])]))
