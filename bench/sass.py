"""Static report of the runtime's Triton kernels as compiled for NVIDIA GPUs, without a GPU.

    python -m bench.sass [--json bench/results/kernels/sass-<commit>.json] [--arch sm_90a sm_80] [--only NAME]

Each kernel is compiled for its target (``sm_90a``: Hopper, ``sm_80``: Ampere) with Triton's
own compiler and the ptxas it ships, and the cubin is disassembled with the bundled cuobjdump.
From the SASS it reads what decides whether a kernel can keep up with memory:

* ``registers`` (per thread, from ``cuobjdump -res-usage``), ``spill_instructions`` (STL/LDL in
  the whole kernel: Triton kernels use no local arrays, so local-memory traffic is spilling),
  ``local_bytes`` (stack frame + local memory), ``shared_bytes`` (what Triton allocates);
* ``ctas_per_sm``: how many CTAs fit one SM by registers and shared memory (the occupancy
  formula, not a measurement);
* the main loop: the largest innermost loop (a backward branch's target .. the branch; loops of
  fewer than ``MIN_LOOP`` instructions are wait loops and ignored; ranges that hold an EXIT are
  out-of-line stubs, not loops), its instructions (``loop_sass``), their count, a breakdown by
  opcode, whether it issues asynchronous copies (LDGSTS = cp.async, UTMALDG = TMA,
  UBLKCP = cp.async.bulk) and how many plain global loads (LDG) and barriers (BAR) it has,
  and how many of those loads are software-pipelined (``prefetched_loads``: LDGs whose
  registers no later instruction of the iteration reads, so they are consumed by the next one);
* ``loop_instructions_per_unit``: thread-instructions of one main-loop iteration over the units
  (weights, elements) the whole CTA covers in that iteration, i.e.
  ``loop_instructions * 32 * num_warps / units_per_iteration``. This is the number an issue
  budget is about (an SM issues 4 warp-instructions = 128 thread-instructions per clock).
* ``dequant`` (loops with tensor-core instructions): the instructions on a register path from
  the loop's data loads (packed weights, scales, zero points) to the tensor-core operands, a
  dataflow chop explained in ``bench/sass_dataflow.py``, and ``per_unit``: that count over the
  weights one thread dequantizes per iteration (``units_per_iteration / (32 * num_warps)``).
  This is what the prefill budget "dequantization <= 3 instructions per element" is about; the
  whole loop's count stays reported beside it. ``sass_cases.max_registers`` gives the register count that
  still lets a number of CTAs share an SM (for a ``max_registers`` budget).

Instruction counts are deterministic for a given Triton/ptxas version; they are not timings.

Registering a kernel case (e.g. from another kernel's room): write a function returning a list
of ``bench.sass_cases.KernelCase`` (one per configuration the runtime really launches) and add it to
``CASE_SOURCES`` at the bottom of this file. A case names the ``@triton.jit`` function, the
types of its non-constexpr arguments (``"*fp16"``, ``"*i32"``, ``"i32"``, ``"fp32"``...), its
constexprs, ``num_warps``/``num_stages``, ``units_per_iteration`` (None when a per-unit count
makes no sense), and optionally ``budgets`` per arch (``{"sm_90a":
{"max_loop_instructions_per_unit": 2.5}}``, names in ``BUDGET_CHECKS``): the JSON then says
which are met. ``bench/sass_weights.py`` is an example. The library entry point is
:func:`static_report` (``compile_kernel``, ``disassemble``, ``find_loops``, ``main_loop`` are
its parts); it must run in a process where ``TRITON_INTERPRET`` was not set when triton was
imported (this module unsets it before importing triton).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not interpreted ones
ROOT = Path(__file__).resolve().parent.parent

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bench.results_file import write_result  # noqa: E402
from bench.sass_cases import KernelCase, ctas_per_sm  # noqa: E402
from bench.sass_dataflow import Instruction, dequant_report, parse_sass  # noqa: E402

ARCHS = {"sm_90a": 90, "sm_80": 80}  # Triton compiles capability 90 as sm_90a
MIN_LOOP = 8  # shorter backward-branch ranges are spin/wait loops, not a kernel's main loop
ASYNC_COPY_OPCODES = ("LDGSTS", "UTMALDG", "UBLKCP")
BIN_DIR = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@dataclass
class Loop:
    start: int  # index of the first instruction
    end: int  # index of the backward branch
    instructions: list = field(default_factory=list)


def compile_kernel(kernel_fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int, arch: str,
                   divisible_by_16: tuple | None = None):
    """``triton.compile`` for ``arch`` (a key of ARCHS) with no GPU present."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel_fn, InterpretedFunction):
        raise RuntimeError("the kernel was built for the Triton interpreter (TRITON_INTERPRET=1 when its module "
                           "was imported): run bench/sass.py in a process without TRITON_INTERPRET")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}: choose from {sorted(ARCHS)}")
    full = {}
    for name in kernel_fn.arg_names:
        if name in constexprs:
            full[name] = "constexpr"
        elif name in signature:
            full[name] = signature[name]
        else:
            raise ValueError(f"argument {name!r} of {kernel_fn.__name__} has no type in the signature "
                             "and is not a constexpr")
    if divisible_by_16 is None:  # torch allocations are aligned: Triton specializes such pointers
        divisible_by_16 = tuple(n for n, t in full.items() if t.startswith("*"))
    attrs = {(kernel_fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible_by_16}
    source = ASTSource(kernel_fn, full, constexprs, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True}
    return triton.compile(source, target=GPUTarget("cuda", ARCHS[arch], 32), options=options)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(BIN_DIR / "cuobjdump"), flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def disassemble(cubin: bytes) -> list[Instruction]:
    """The kernel's SASS, one Instruction per line of ``cuobjdump -sass``."""
    return parse_sass(_cuobjdump(cubin, "-sass"))


def resource_usage(cubin: bytes) -> dict:
    """REG/STACK/LOCAL/SHARED of the (single) function in the cubin."""
    text = _cuobjdump(cubin, "-res-usage")
    found = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}
    return {"registers": found.get("REG", 0), "local_bytes": found.get("STACK", 0) + found.get("LOCAL", 0),
            "static_shared_bytes": found.get("SHARED", 0)}


def find_loops(sass: list[Instruction]) -> list[Loop]:
    """Backward branches as loops [target .. branch], minus wait loops and out-of-line stubs."""
    index = {ins.address: i for i, ins in enumerate(sass)}
    loops = []
    for i, ins in enumerate(sass):
        if ins.base != "BRA":
            continue
        target = re.match(r"(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", ins.operands)
        if not target or target.group(1) is None:
            continue
        start = index.get(int(target.group(1), 16))
        if start is None or start > i or i - start + 1 < MIN_LOOP:
            continue
        body = sass[start : i + 1]
        if any(b.base == "EXIT" for b in body):
            continue
        loops.append(Loop(start, i, body))
    return loops


def main_loop(loops: list[Loop]) -> Loop | None:
    """The largest loop that contains no other loop."""
    innermost = [a for a in loops if not any(b is not a and a.start <= b.start and b.end <= a.end for b in loops)]
    return max(innermost, key=lambda lp: len(lp.instructions), default=None)


def _load_registers(ins: Instruction) -> set:
    """Registers an LDG writes: ``LDG.E.128 R20`` is R20..R23."""
    first = re.match(r"R(\d+)", ins.operands)
    if not first:
        return set()
    width = next((int(m) for m in re.findall(r"\.(64|128)\b", ins.opcode)), 32) // 32
    return {int(first.group(1)) + i for i in range(width)}


def _reads(ins: Instruction) -> set:
    """Registers an instruction reads (its operands after the destination; ``R4.64`` is R4, R5)."""
    sources = ins.operands.split(",", 1)[1] if "," in ins.operands else ins.operands
    regs = set()
    for number, wide in re.findall(r"\bR(\d+)(\.64)?", sources):
        regs |= {int(number), int(number) + 1} if wide else {int(number)}
    return regs


def prefetched_loads(body: list) -> int:
    """LDGs of a loop body whose results the rest of the iteration never computes with (a MOV or
    IMAD.MOV that carries them to another register for the next iteration does not count): loads issued
    for the next iteration, i.e. software pipelining in registers."""
    count = 0
    for i, ins in enumerate(body):
        if ins.base != "LDG":
            continue
        live, used = _load_registers(ins), False
        for later in body[i + 1 :]:
            dest = re.match(r"R(\d+)", later.operands)
            written = set()
            if dest and later.base not in ("STG", "STS", "ST", "RED", "BRA"):
                written = _load_registers(later) if later.base == "LDG" else {int(dest.group(1))}
            read = live & _reads(later)
            if read and (later.base == "MOV" or later.opcode.startswith("IMAD.MOV")):  # a copy: follow it
                live = (live - written) | written
                continue
            if read:
                used = True
                break
            live -= written
            if not live:
                break
        count += not used
    return count


def static_report(kernel_fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int, arch: str,
                  units_per_iteration: int | None = None, divisible_by_16: tuple | None = None) -> dict:
    """Compile one kernel configuration for ``arch`` and read its SASS (see the module docstring)."""
    kernel = compile_kernel(kernel_fn, signature, constexprs, num_warps, num_stages, arch, divisible_by_16)
    cubin = kernel.asm["cubin"]
    sass = [ins for ins in disassemble(cubin) if ins.base != "NOP"]
    usage = resource_usage(cubin)
    shared = int(kernel.metadata.shared)
    report = {
        "arch": arch, "num_warps": num_warps, "num_stages": num_stages,
        "registers": usage["registers"],
        "spill_instructions": sum(ins.base in ("STL", "LDL") for ins in sass),
        "local_bytes": usage["local_bytes"],
        "shared_bytes": shared,
        "ctas_per_sm": ctas_per_sm(usage["registers"], shared, num_warps, ARCHS[arch]),
        "kernel_instructions": len(sass),
        # the whole kernel's global stores by width and its barriers (what a loopless kernel is read by)
        "global_stores": dict(Counter(ins.opcode for ins in sass if ins.base == "STG")),
        "kernel_barriers": sum(ins.base == "BAR" for ins in sass),
    }
    loops = find_loops(sass)
    loop = main_loop(loops)
    report["loops"] = [[sass[lp.start].address, sass[lp.end].address, len(lp.instructions)] for lp in loops]
    if loop is None:
        report["main_loop"] = None
        return report
    opcodes = Counter(ins.base for ins in loop.instructions)
    count = len(loop.instructions)
    report["main_loop"] = {
        "first_address": sass[loop.start].address, "branch_address": sass[loop.end].address,
        "instructions": count,
        "opcodes": dict(opcodes.most_common()),
        "async_copies": sorted(op for op in ASYNC_COPY_OPCODES if opcodes[op]),
        "global_loads": opcodes["LDG"], "prefetched_loads": prefetched_loads(loop.instructions),
        "barriers": opcodes["BAR"], "shared_stores": opcodes["STS"],
        "units_per_iteration": units_per_iteration,
        "loop_instructions_per_unit": (None if not units_per_iteration
                                       else round(count * 32 * num_warps / units_per_iteration, 3)),
        "loop_sass": [ins.text() for ins in loop.instructions],
        # instructions between the loop's loads and its tensor-core operands (bench/sass_dataflow.py)
        "dequant": dequant_report(loop.instructions, units_per_iteration / (32 * num_warps)
                                  if units_per_iteration else None),
    }
    return report


# budget name -> (what it reads from a report, whether the value passes)
BUDGET_CHECKS = {
    "max_loop_instructions_per_unit": lambda r, v: (r["main_loop"] or {}).get("loop_instructions_per_unit", 1e9) <= v,
    "max_dequant_instructions_per_unit": lambda r, v: ((r["main_loop"] or {}).get("dequant") or {}).get(
        "per_unit", 1e9) <= v,
    "max_registers": lambda r, v: r["registers"] <= v,
    "max_spill_instructions": lambda r, v: r["spill_instructions"] <= v,
    "min_ctas_per_sm": lambda r, v: r["ctas_per_sm"] >= v,
    "max_loop_barriers": lambda r, v: (r["main_loop"] or {}).get("barriers", 1e9) <= v,
    "max_loop_shared_stores": lambda r, v: (r["main_loop"] or {}).get("shared_stores", 1e9) <= v,
    "async_copies_in_loop": lambda r, v: bool((r["main_loop"] or {}).get("async_copies")) == v,
    "min_prefetched_loads": lambda r, v: (r["main_loop"] or {}).get("prefetched_loads", 0) >= v,
    "max_kernel_barriers": lambda r, v: r["kernel_barriers"] <= v,
    "global_stores_only": lambda r, v: set(r["global_stores"]) == {v},  # every STG of this width (opcode)
}


def check_budgets(report: dict, budgets: dict) -> dict:
    """``{budget: {"limit": value, "met": bool}}`` for one report."""
    unknown = set(budgets) - set(BUDGET_CHECKS)
    if unknown:
        raise ValueError(f"unknown budgets {sorted(unknown)}: choose from {sorted(BUDGET_CHECKS)}")
    return {name: {"limit": limit, "met": BUDGET_CHECKS[name](report, limit)} for name, limit in budgets.items()}


def report_case(case: KernelCase, arch: str) -> dict:
    report = static_report(case.kernel_fn, case.signature, case.constexprs, case.num_warps, case.num_stages, arch,
                           case.units_per_iteration, case.divisible_by_16)
    budgets = case.budgets.get(arch, {})  # budgets are per arch: {"sm_90a": {...}}
    return {"name": case.name, "kernel": case.kernel_fn.__name__, "unit": case.unit, "notes": case.notes,
            "constexprs": {k: str(v) for k, v in case.constexprs.items()}, **report,
            "budgets": check_budgets(report, budgets)}


# -- the runtime's kernels --------------------------------------------------------------------------


def weight_cases() -> list[KernelCase]:
    """runtime/kernels/quant_matmul.py, gemv.py and dequantize_weight.py (cases in bench/sass_weights.py)."""
    from bench.sass_weights import dequantize_cases, weight_cases as cases

    return cases() + dequantize_cases()


def attention_cases() -> list[KernelCase]:
    """runtime/kernels/attention.py's decode kernel (cases in bench/sass_attention.py)."""
    from bench.sass_attention import attention_cases as cases

    return cases()


CASE_SOURCES = [weight_cases, attention_cases]  # add a kernel room's ``*_cases`` function here


def all_cases() -> list[KernelCase]:
    return [case for source in CASE_SOURCES for case in source()]


def summary_line(r: dict) -> str:
    loop = r["main_loop"] or {}
    per_unit = loop.get("loop_instructions_per_unit")
    per = f"{per_unit:.2f}/{r['unit']}" if per_unit is not None else "-"
    missed = [name for name, b in r["budgets"].items() if not b["met"]]
    dequant = (loop.get("dequant") or {}).get("per_unit")
    return (f"{r['name']:<40} {r['arch']:<7} regs {r['registers']:>3}  spills {r['spill_instructions']:>3}  "
            f"smem {r['shared_bytes']:>6}  ctas/sm {r['ctas_per_sm']}  loop {loop.get('instructions', '-')!s:>4} "
            f"({per})" + (f"  dequant {dequant:.2f}/{r['unit']}" if dequant is not None else "")
            + f"  async {','.join(loop.get('async_copies', [])) or '-'}  bar {loop.get('barriers', '-')}"
            + ("" if loop else f"  kernel: bar {r['kernel_barriers']} stores {r['global_stores']}")
            + (f"  MISSED {','.join(missed)}" if missed else ""))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path,
                    help="write the raw reports here (e.g. bench/results/kernels/sass-<commit>.json)")
    ap.add_argument("--arch", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--only", help="only cases whose name contains this")
    args = ap.parse_args(argv)
    from evals.provenance import commit

    code_version = commit()
    reports = []
    for case in all_cases():
        if args.only and args.only not in case.name:
            continue
        for arch in args.arch:
            if arch in case.archs:
                reports.append(report_case(case, arch))
                print(summary_line(reports[-1]), flush=True)
    if args.json:
        ptxas = subprocess.run([str(BIN_DIR / "ptxas"), "--version"], capture_output=True, text=True).stdout
        result = {"commit": code_version, "triton": triton.__version__, "ptxas": ptxas.strip().splitlines()[-1],
                  "reports": reports}
        write_result(args.json, result)


if __name__ == "__main__":
    main()
