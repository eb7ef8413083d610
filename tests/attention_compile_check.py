"""Compile the KV-cache attention kernels for an NVIDIA GPU without one (run by
tests/test_kernels_attention.py in a subprocess, because the interpreter must be off).

The interpreter runs kernels as numpy and skips code generation; this lowers each kernel
through Triton's CUDA backend to PTX and ptxas (shipped in the PyPI wheel) for a target GPU,
which catches what only the compiler rejects: ``tl.dot`` shape and dtype rules, layouts of
reshapes, bfloat16 (which the interpreter cannot run). It prints ptxas' register and spill
counts; it measures nothing about speed.

    python tests/attention_compile_check.py [capability, default 90] [--quick]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from runtime.kernels import attention as A  # noqa: E402
from runtime.kernels import kv_dequantize as KD  # noqa: E402
from runtime.kernels import kv_write as W  # noqa: E402

TL = {"fp16": tl.float16, "bf16": tl.bfloat16, "fp32": tl.float32}


def compile_kernel(fn, target, pointer_types: dict, constants: dict, num_warps: int, num_stages: int):
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        else:
            signature[name] = pointer_types.get(name, "fp32" if name == "qk_scale" else "i32")
    src = ASTSource(fn, signature, constexprs=constants)
    return triton.compile(src, target=target, options={"num_warps": num_warps, "num_stages": num_stages})


def ptxas_report(kernel, capability: int) -> str:
    """ptxas -v on the kernel's PTX: registers and spill bytes (empty when ptxas is not found)."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for ptxas in ("ptxas-blackwell", "ptxas"):
        path = bin_dir / ptxas
        if not path.exists():
            continue
        ptx = Path(os.environ.get("TMPDIR", "/tmp")) / f"lowbit-attention-{os.getpid()}.ptx"
        ptx.write_text(kernel.asm["ptx"])
        out = subprocess.run([str(path), f"-arch=sm_{capability}a", "-v", str(ptx), "-o", os.devnull],
                             capture_output=True, text=True).stderr
        ptx.unlink()
        regs, spills = re.search(r"Used (\d+) registers", out), re.search(r"(\d+) bytes spill stores", out)
        if regs:
            return f"{regs.group(1)} registers, {spills.group(1) if spills else '?'} bytes spilled"
    return ""


def main(capability: int = 90, quick: bool = False) -> None:
    target = GPUTarget("cuda", capability, 32)
    # (name, bits, fp8, kivi, model dtype)
    cases = [("int4", 4, False, True, "fp16"), ("int8", 8, False, False, "bf16"), ("int2", 2, False, True, "fp16"),
             ("fp8", 8, True, False, "fp16"), ("fp16", 16, False, False, "bf16"), ("int4", 4, False, True, "fp32")]
    if quick:  # the test suite's subset: a KIVI and a per-token scheme, fp16 and bf16
        cases = cases[:2]
    for name, bits, fp8, kivi, dt in cases:
        data = f"*{dt}" if bits == 16 else ("*fp8e4nv" if fp8 else "*i32")
        qparam = "*fp32" if fp8 else "*fp16"
        pool = dict(kd=data, ks=qparam, kz=qparam, vd=data, vs=qparam, vz=qparam)
        dense = {n: f"*{dt}" for n in ("q_ptr", "rk_ptr", "rv_ptr", "out_ptr", "ko_ptr", "vo_ptr", "k_ptr", "v_ptr")}
        ints = {n: "*i32" for n in ("table_ptr", "lens_ptr", "starts_ptr")}
        parts = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"}
        types = {**pool, **dense, **ints, **parts}
        scheme = dict(B=128, D=128, G=64 if kivi else 128, BITS=bits, FP8=fp8, KIVI=kivi)
        built = []
        for sliding in (True,) if quick else (False, True):
            k = compile_kernel(A._decode_kernel, target, types,
                               dict(H=8, GROUP_Q=4, QH=16, TILE=16 if dt == "fp32" else KD.DEFAULT_TILE,
                                    SLIDING=sliding,
                                    IEEE=dt == "fp32", OUT=TL[dt], **scheme), 4, 2)
            built.append(("decode", k))
        built.append(("combine", compile_kernel(A._combine_kernel, target, {**parts, "out_ptr": f"*{dt}"},
                                                dict(MAX=A.MAX_SPLITS, D=128), 4, 1)))
        built.append(("dequantize", compile_kernel(KD._dequantize_kernel, target, types,
                                                   dict(H=8, TILE=KD.DEFAULT_TILE, OUT=TL[dt], **scheme), 4, 1)))
        built.append(("write blocks", compile_kernel(
            W._write_blocks_kernel, target, types,
            dict(H=8, KEY_ROWS=64 if kivi else W.WRITE_ROWS, ROWS=W.WRITE_ROWS, CACHE=TL[dt], **scheme),
            W.WRITE_WARPS, 1)))
        built.append(("write residual", compile_kernel(W._write_residual_kernel, target, types,
                                                       dict(H=8, B=128, D=128, ROWS=16, CACHE=TL[dt]), 4, 1)))
        for kernel_name, k in built:
            print(f"sm_{capability} {name} {dt} {kernel_name}: compiled {ptxas_report(k, capability)}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--quick"]
    main(int(args[0]) if args else 90, quick="--quick" in sys.argv)
