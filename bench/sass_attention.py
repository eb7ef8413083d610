"""Decode attention's cases for bench/sass.py: the configurations ``decode_attention`` launches.

One case per KV scheme (fp16, fp8, int8, int4, int2) and GQA ratio (4:1 and 1:1), head_dim 128,
the runtime's default blocks (residual 128, KIVI groups of 64) and tile. A unit is one cached
element (keys and values both count): a main-loop iteration covers ``TILE * head_dim * 2`` of them.
"""

from __future__ import annotations

import triton
import triton.language as tl

SCHEMES = {  # name: (bits, fp8, kivi)
    "fp16": (16, False, False), "fp8": (8, True, False), "int8": (8, False, False),
    "int4": (4, False, True), "int2": (2, False, True),
}
HEAD_DIM, BLOCK, GROUP, KV_HEADS = 128, 128, 64, 8
# Issue 15 on sm_90a: INT4 and INT8 at most 5 main-loop instructions per cached element; fp16,
# fp8 and int2 no more than before the folded kernel (bench/results/kernels/sass-attention-20c4e22.json:
# 3.25/3.281, 7.516, 14.27/14.438, rounded up). No case may spill.
PER_ELEMENT_BUDGET = {"int4": 5.0, "int8": 5.0, "fp16": 3.29, "fp8": 7.52, "int2": 14.44}


def decode_case(name: str, group_q: int, dtype: str = "fp16"):
    from bench.sass_cases import KernelCase
    from runtime.kernels import attention as A

    bits, fp8, kivi = SCHEMES[name]
    data = f"*{dtype}" if bits == 16 else ("*fp8e4nv" if fp8 else "*i32")
    qparam = "*fp32" if fp8 else "*fp16"
    signature = dict(q_ptr=f"*{dtype}", kd=data, ks=qparam, kz=qparam, vd=data, vs=qparam, vz=qparam,
                     rk_ptr=f"*{dtype}", rv_ptr=f"*{dtype}", table_ptr="*i32", lens_ptr="*i32",
                     out_ptr=f"*{dtype}", part_o_ptr="*fp32", part_lse_ptr="*fp32", qk_scale="fp32")
    signature.update({n: "i32" for n in A._decode_kernel.arg_names if n not in signature})
    config = A.launch_config(bits, fp8, kivi, group_q, HEAD_DIM)
    constexprs = dict(H=KV_HEADS, GROUP_Q=group_q, QH=max(16, triton.next_power_of_2(group_q)), B=BLOCK,
                      D=HEAD_DIM, G=GROUP if kivi else HEAD_DIM, BITS=bits, FP8=fp8, KIVI=kivi,
                      TILE=config["tile"], SLIDING=False, IEEE=False, OUT=getattr(tl, {"fp16": "float16",
                                                                                     "bf16": "bfloat16"}[dtype]))
    constexprs = {k: v for k, v in constexprs.items() if k in A._decode_kernel.arg_names}
    # the folded INT4 path steps a whole key group per main-loop iteration (STEP in _decode_kernel)
    step = GROUP if bits == 4 and GROUP > config["tile"] else config["tile"]
    signature = {k: v for k, v in signature.items() if k not in constexprs}
    return KernelCase(name=f"decode-attention {name} gqa{group_q}:1 d{HEAD_DIM}", kernel_fn=A._decode_kernel,
                      signature=signature, constexprs=constexprs, num_warps=config["num_warps"],
                      num_stages=config["num_stages"], units_per_iteration=step * HEAD_DIM * 2,
                      unit="element", archs=("sm_90a",),
                      notes="decode_attention's default launch for this scheme (launch_config)",
                      budgets={"sm_90a": {"max_loop_instructions_per_unit": PER_ELEMENT_BUDGET[name],
                                          "max_spill_instructions": 0}})


def attention_cases() -> list:
    return [decode_case(name, group_q) for name in SCHEMES for group_q in (4, 1)]
