"""Static check of Triton issue 9433's register hazard in the fused matmul, on sm_90a SASS, no GPU.

    python -m bench.wgmma_hazard [--json bench/results/kernels/wgmma-hazard-triton<version>.json]
        [--alternatives step_tiles=2] [--formats w4-fp16 ...] [--jobs N] [--only TEXT]
    python -m bench.wgmma_hazard --sass dump.sass   # walk a cuobjdump -sass text (JSON report)

A Hopper ``wgmma`` (SASS ``HGMMA``) runs asynchronously: it reads its A operand (here the
dequantized weight tile, in registers) and its accumulator some time after it is issued, until a
``wgmma.wait_group`` (SASS ``WARPGROUP.DEPBAR.LE gsb0, n``: at most ``n`` committed groups still in
flight) retires it. PTX makes writing those registers before then undefined behaviour. Triton 3.6's
pipeliner waits with ``wait_group 7`` after each of 8 register-A wgmmas (3.7/3.8: ``wait_group 1``
after each of 2 groups of 4), and ptxas lets the next loop iteration's dequantization write the A
registers of wgmmas still in flight (bench/results/gpu/NOTES.md, "Why num_stages=3 tl.dot
configurations were wrong on the H200"; per release: bench/results/kernels/NOTES.md).

The walk (:func:`hazards`): the kernel's SASS in address order, one path: everything before the
main loop, the loop's body ``ROUNDS`` times (a hazard across iterations shows from the second),
then everything after. It keeps the wgmma groups in flight: an HGMMA joins the open group, one
carrying ``gsb0`` closes it; ``WARPGROUP.DEPBAR.LE gsb0, n`` (unpredicated) keeps the newest ``n``.
Any other wait form is counted in ``unknown_waits`` and retires nothing (so it can only add
hazards, never hide one). Flagged, per instruction (each address once): a non-HGMMA instruction
that writes an A register of an HGMMA in flight (``a_writes``, the hazard of issue 9433), or reads
or writes its accumulator (``accumulator_accesses``). Predicated instructions count: they may run.

:func:`tuner_cases` lists every ``tl.dot`` launch the tuner can choose (``matmul_configs.
candidate_configs`` in each M regime; fp16 and bf16; W4 and W8 asymmetric group 128; TMA
activations where the tile reads them by TMA on sm_90, and the same tile without, as a misaligned
input gets), compiled as ``bench/sass_weights.dot_case`` does. (The tuner leaves out of these only launches that
failed a check in the process; what a Triton release compiles wrongly is never a candidate.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import re
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bench.sass import BIN_DIR, compile_kernel, disassemble, find_loops, resource_usage
from bench.sass_dataflow import _mma_operands, reads_writes

ROUNDS = 3  # main-loop iterations walked: the second and third see what the first left in flight
SHOWN = 4  # hazardous instructions kept per configuration in the report
REGIMES = {"decode (2..16 rows)": 16, "17..64 rows": 64, "65+ rows": 4096}  # an M per candidate list


@dataclass
class InFlight:
    """The HGMMA groups not yet retired: each ``[(text, A registers, accumulator registers)]``."""

    groups: list = field(default_factory=list)  # committed (closed by gsb0), oldest first
    open: list = field(default_factory=list)  # issued, not yet closed

    def all(self):
        return [h for group in self.groups for h in group] + self.open


def _hgmma(ins) -> tuple[set, set]:
    """(A registers, accumulator registers) of an HGMMA (A empty when it reads A from shared memory)."""
    writes, a, acc_reads = _mma_operands(ins.opcode, ins.operands)
    return a, writes | acc_reads


def _step(ins, inflight: InFlight, unknown_waits: set) -> list[tuple[str, str]]:
    """Apply one instruction; return ``(kind, HGMMA text)`` for each hazard it makes."""
    if ins.base == "HGMMA":
        a, acc = _hgmma(ins)
        inflight.open.append((ins.text(), a, acc))
        if "gsb0" in ins.operands:
            inflight.groups.append(inflight.open)
            inflight.open = []
        return []
    wait = re.fullmatch(r"gsb0,\s*0x([0-9a-f]+)", ins.operands)
    if ins.opcode == "WARPGROUP.DEPBAR.LE" and wait and not ins.predicate:
        keep = int(wait.group(1), 16)
        inflight.groups = inflight.groups[len(inflight.groups) - keep:] if keep else []
        return []
    if "DEPBAR" in ins.opcode and "gsb" in ins.operands or ins.opcode.startswith("WARPGROUP") and (
            ins.opcode != "WARPGROUP.ARRIVE"):  # a wait form this walk does not know: retires nothing
        unknown_waits.add(ins.text())
        return []
    reads, writes = reads_writes(ins)
    found = []
    for text, a, acc in inflight.all():
        if writes & a:
            found.append(("a_writes", text))
        elif (reads | writes) & acc:
            found.append(("accumulator_accesses", text))
    return found


def hgmma_loops(sass: list) -> list:
    """Innermost loops (``bench.sass.find_loops``) that issue HGMMA."""
    loops = [lp for lp in find_loops(sass) if any(ins.base == "HGMMA" for ins in lp.instructions)]
    return [a for a in loops if not any(b is not a and a.start <= b.start and b.end <= a.end for b in loops)]


def walk_order(sass: list, rounds: int = ROUNDS) -> list:
    """The path the walk takes: address order, each HGMMA loop's body ``rounds`` times."""
    repeat = {lp.end: lp for lp in hgmma_loops(sass)}
    path = []
    for i, ins in enumerate(sass):
        path.append(ins)
        if i in repeat:
            path += repeat[i].instructions * (rounds - 1)
    return path


def hazards(sass: list, rounds: int = ROUNDS) -> dict:
    """The walk of the module docstring over one kernel's SASS (``bench.sass.disassemble``)."""
    inflight, unknown_waits, flagged = InFlight(), set(), {}
    for ins in walk_order(sass, rounds):
        for kind, hgmma in _step(ins, inflight, unknown_waits):
            flagged.setdefault((kind, ins.address), (ins.text(), hgmma))
    waits = sorted({ins.operands for ins in sass if ins.opcode == "WARPGROUP.DEPBAR.LE"})
    report = {"hgmma": sum(ins.base == "HGMMA" for ins in sass),
              "register_a_hgmma": sum(ins.base == "HGMMA" and bool(_hgmma(ins)[0]) for ins in sass),
              "hgmma_loops": len(hgmma_loops(sass)), "waits": waits, "unknown_waits": sorted(unknown_waits)}
    for kind in ("a_writes", "accumulator_accesses"):
        hits = sorted((address, text, hgmma) for (k, address), (text, hgmma) in flagged.items() if k == kind)
        report[kind] = len(hits)
        report[f"first_{kind}"] = [f"{text}  (in flight: {hgmma})" for _, text, hgmma in hits[:SHOWN]]
    report["hazard_free"] = report["a_writes"] == 0 and report["accumulator_accesses"] == 0 and not unknown_waits
    return report


# -- the tuner's tl.dot launches ---------------------------------------------------------------------


@dataclass(frozen=True)
class DotLaunch:
    """One tl.dot launch as compiled: the configuration, the weight's format and the input's path."""

    regime: str
    config: object  # matmul_configs.MatmulConfig
    bits: int
    dtype: str  # "fp16" / "bf16"
    x_tma: bool
    form: str = "candidate"  # or how it was derived from one (--alternatives)

    def name(self) -> str:
        c = self.config
        return (f"w{self.bits} {self.dtype} {c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages} "
                f"step{c.step_tiles} split{c.split_k}" + (" tma" if self.x_tma else ""))


def weight(bits: int):
    """An 8192 x 8192 group-128 weight's shape fields (all candidate_configs reads)."""
    from runtime.kernels.weight_layout import KernelWeight

    return KernelWeight(None, None, None, None, 8192, 8192, bits, 128)


FORMATS = ("w4-fp16", "w4-bf16", "w8-fp16", "w8-bf16")
ALTERNATIVES = {"step_tiles=2": dict(step_tiles=2), "num_stages=1": dict(num_stages=1)}


def tuner_cases(alternatives: tuple = (), formats: tuple = FORMATS) -> list[DotLaunch]:
    """Every tl.dot launch of the module docstring (the candidates under the installed Triton);
    ``alternatives`` (names in ``ALTERNATIVES``): with each one-tile-per-iteration candidate above
    the decode rows, those forms of it too (what a hazard-free candidate list could be made of);
    ``formats``: the weight bits and activation dtypes (``FORMATS``)."""
    from runtime.kernels import quant_matmul
    from runtime.kernels.matmul_configs import candidate_configs

    cases = []
    for bits in sorted({int(f[1]) for f in formats}):
        kw = weight(bits)
        for regime, M in REGIMES.items():
            configs = [c for c in candidate_configs(M, kw) if c.use_dot]
            forms = {c: "candidate" for c in configs}
            if alternatives and M > 16:
                for config in [c for c in configs if c.step_tiles == 1]:
                    for form in alternatives:
                        change = ALTERNATIVES[form]
                        forms.setdefault(dataclasses.replace(config, **change), form)
            for config, form in forms.items():
                for dtype in [f.split("-")[1] for f in formats if f.startswith(f"w{bits}-")]:
                    for x_tma in (False, True) if config.block_m >= quant_matmul.TMA_MIN_BLOCK_M else (False,):
                        cases.append(DotLaunch(regime, config, bits, dtype, x_tma, form))
    return cases


def compile_key(case: DotLaunch) -> tuple:
    """What the compiled kernel depends on (split_k only through SPLIT): launches sharing it share a walk."""
    c = case.config
    return (c.block_m, c.block_n, c.group_m, c.num_warps, c.num_stages, c.step_tiles, c.split_k > 1,
            case.bits, case.dtype, case.x_tma)


def check(case: DotLaunch) -> dict:
    """Compile ``case`` for sm_90a and walk its SASS."""
    from bench.sass_weights import dot_case

    label = "small-m" if case.config.block_m <= 16 else "prefill"
    kc = dot_case(weight(case.bits), case.dtype, label, REGIMES[case.regime], case.config, "sm_90a", case.x_tma)
    kernel = compile_kernel(kc.kernel_fn, kc.signature, kc.constexprs, kc.num_warps, kc.num_stages, "sm_90a",
                            kc.divisible_by_16)
    sass = [ins for ins in disassemble(kernel.asm["cubin"]) if ins.base != "NOP"]
    return {**hazards(sass), "registers": resource_usage(kernel.asm["cubin"])["registers"],
            "shared_bytes": int(kernel.metadata.shared),
            "spill_instructions": sum(ins.base in ("STL", "LDL") for ins in sass)}


def summary(name: str, r: dict) -> str:
    verdict = "hazard-free" if r["hazard_free"] else (
        f"{r['a_writes']} hazardous A writes, {r['accumulator_accesses']} accumulator accesses"
        + (f", unknown waits {r['unknown_waits']}" if r["unknown_waits"] else ""))
    lines = [f"{name:<44} hgmma {r['register_a_hgmma']:>2}/{r['hgmma']:<2} waits {','.join(r['waits'])}: {verdict}"]
    lines += [f"    {text}" for text in r["first_a_writes"] + r["first_accumulator_accesses"]]
    return "\n".join(lines)


def scan(cases: list[DotLaunch], only: str | None = None, echo=print, jobs: int = 1) -> list[dict]:
    """One report per launch, each distinct kernel (``compile_key``) compiled once, ``jobs`` at a time."""
    cases = [case for case in cases if not only or only in case.name()]
    distinct = list({compile_key(case): case for case in cases}.values())
    walked = {}
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:  # children inherit
        for i, (case, report) in enumerate(zip(distinct, pool.map(check, distinct))):  # the imported kernels
            walked[compile_key(case)] = report
            print(f"[{i + 1}/{len(distinct)}] {case.name()}: {report['a_writes']} A writes", file=sys.stderr,
                  flush=True)
    reports = []
    for case in cases:
        reports.append({"name": case.name(), "regime": case.regime, "config": dataclasses.asdict(case.config),
                        "bits": case.bits, "dtype": case.dtype, "x_tma": case.x_tma, "form": case.form,
                        **walked[compile_key(case)]})
        echo(summary(case.name() + ("" if case.form == "candidate" else f" ({case.form})"), reports[-1]))
    return reports


def main(argv=None) -> None:
    import triton

    from bench.results_file import write_result
    from evals.provenance import commit

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the reports here (bench/results/kernels/wgmma-hazard-triton<v>.json)")
    ap.add_argument("--alternatives", nargs="+", default=(), choices=list(ALTERNATIVES),
                    help="also these forms of each one-tile-per-iteration candidate above 16 rows")
    ap.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS, help="weight bits and dtypes")
    ap.add_argument("--only", help="only launches whose name contains this")
    ap.add_argument("--jobs", type=int, default=1, help="compile this many kernels at a time")
    ap.add_argument("--sass", nargs="+", type=Path,
                    help="walk these cuobjdump -sass texts instead (prints one JSON report per file)")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="main-loop iterations walked (with --sass)")
    args = ap.parse_args(argv)
    if args.sass:
        from bench.sass_dataflow import parse_sass

        print(json.dumps([hazards([i for i in parse_sass(f.read_text()) if i.base != "NOP"], args.rounds)
                          for f in args.sass]))
        return
    reports = scan(tuner_cases(args.alternatives, tuple(args.formats)), args.only,
                   echo=lambda line: print(line, flush=True), jobs=args.jobs)
    free = sum(r["hazard_free"] for r in reports)
    print(f"triton {triton.__version__}: {free} of {len(reports)} launches hazard-free")
    if args.json:
        ptxas = subprocess.run([str(BIN_DIR / "ptxas"), "--version"], capture_output=True, text=True).stdout
        write_result(args.json, {
            "commit": commit(), "triton": triton.__version__, "ptxas": ptxas.strip().splitlines()[-1],
            "arch": "sm_90a", "rounds": ROUNDS,
            "alternatives": args.alternatives, "formats": args.formats, "command": "python -m bench.wgmma_hazard " + " ".join(argv or sys.argv[1:]),
            "weight": "8192x8192, asymmetric group 128, EVEN_N", "hazard_free": free, "launches": len(reports),
            "reports": reports})


if __name__ == "__main__":
    main()
