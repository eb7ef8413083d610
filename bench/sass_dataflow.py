"""Which main-loop instructions dequantize: a register dataflow slice over a loop's SASS.

Issue 15's prefill budget counts *dequantization* instructions per weight, not the whole loop
(address math, barriers and TMA/cp.async bookkeeping are the GEMM's, not the dequantization's).
The count here is mechanical: the **chop** between the loop's data loads and its tensor-core
operands, i.e. every instruction that lies on a register path

    a load (LDS, LDSM, LDG, LD: packed weights, and scales and zero points) -> ... ->
    a register operand of a tensor-core instruction (HGMMA's A, HMMA's A and B), or the data
    register of a shared-memory store (STS/STSM: a tile staged for an operand read from there).

An instruction is in the chop when it reads a register that a load wrote (directly or through
other instructions of the chop; forward) *and* a register it writes reaches an operand
(backward). So the shifts/LOP3s that pull fields out of the words, the packed FMAs that
subtract the offset and apply the scale, the conversion and addition of zero points, and the
moves that put the results in the operand's registers are counted; the loads and the
tensor-core instructions themselves, loop counters, addresses and constants are not (constants
feed the chop but are fed by no load). Loads issued for the next iteration (software pipelining)
are followed by running the analysis over two copies of the body, back to back, and counting an
instruction once if it is in the chop in either copy. Predicated instructions may not execute:
their writes add to what is live but never kill. Dividing by the weights one thread dequantizes
per iteration (``units_per_iteration / (32 * num_warps)``) gives instructions per element.

Activations read straight into an operand (LDSM -> HMMA) have no instruction in between and add
nothing; activations converted on the way would be counted (none of the runtime's kernels does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LOAD_OPCODES = ("LDS", "LDSM", "LDG", "LD")  # data loads; LDC reads kernel arguments, not data
STAGE_OPCODES = ("STS", "STSM")  # stores of an operand tile to shared memory
MMA_OPCODES = ("HGMMA", "HMMA")
NO_DESTINATION = ("STS", "STSM", "STG", "ST", "STL", "RED", "LDGSTS", "BRA", "BAR", "DEPBAR", "MEMBAR", "FENCE",
                  "WARPGROUP", "UTMALDG", "SYNCS", "EXIT", "LDGDEPBAR", "ARRIVES")
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_REGISTER = re.compile(r"(?<![A-Za-z0-9_])R(\d+)(\.64)?")


@dataclass
class Instruction:
    address: int
    predicate: str
    opcode: str  # with modifiers, e.g. "LOP3.LUT"
    operands: str

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    def text(self) -> str:
        return f"/*{self.address:04x}*/ {self.predicate}{self.opcode} {self.operands}".rstrip()


def parse_sass(text: str) -> list[Instruction]:
    """Instructions of ``cuobjdump -sass`` text (lines ``/*0040*/ @!P0 IADD3 R1, R2, 0x1, RZ ;``)."""
    return [Instruction(int(m.group(1), 16), (m.group(2) or "").strip() + (" " if m.group(2) else ""),
                        m.group(3), m.group(4).strip()) for m in _SASS_LINE.finditer(text)]


def _registers(text: str, width: int = 1) -> set:
    """Registers named in ``text``: ``R4`` (``width`` registers from it), ``R4.64`` (two)."""
    out = set()
    for number, wide in _REGISTER.findall(text):
        n = int(number)
        out |= set(range(n, n + (2 if wide else width)))
    return out


def _width(opcode: str) -> int:
    """Registers an instruction's destination spans: ``LDS.128`` 4, ``LDSM.16.M88.4`` 4,
    ``IMAD.WIDE`` 2, plain 1."""
    parts = opcode.split(".")
    if parts[0] == "LDSM":
        return int(parts[-1]) if parts[-1] in ("2", "4") else 1
    if "128" in parts:
        return 4
    return 2 if "64" in parts[1:] or "WIDE" in parts else 1


def _mma_operands(opcode: str, operands: str) -> tuple[set, set, set]:
    """``(writes, operand reads, accumulator reads)`` of an HGMMA/HMMA. HGMMA (``HGMMA.64x{N}x16``,
    printed with a space before ``x{N}``) writes ``N / 2`` fp32 accumulator registers (``N / 4``
    fp16) and reads a 4-register A when A is not a shared-memory descriptor; HMMA.16816 reads a
    4-register A and a 2-register B (1688: 2 and 1) and writes 4 (fp32) or 2 (fp16)."""
    tokens = [t.strip() for t in operands.split(",")]
    fp32 = ".F32" in opcode + operands
    if opcode.startswith("HGMMA"):
        n = int(re.search(r"x(\d+)x", opcode + operands).group(1))
        acc = n // 2 if fp32 else n // 4
        a = _registers(tokens[1], 4) if re.match(r"R\d+", tokens[1]) else set()
        return _registers(tokens[0].split()[-1], acc), a, _registers(tokens[-1], acc) if len(tokens) > 3 else set()
    small = "1688" in opcode
    acc = 4 if fp32 else 2
    return (_registers(tokens[0], acc), _registers(tokens[1], 2 if small else 4) | _registers(tokens[2], 1 if small else 2),
            _registers(tokens[3], acc))


def reads_writes(ins) -> tuple[set, set]:
    """``(registers read, registers written)`` by one Instruction."""
    if ins.base in MMA_OPCODES:
        writes, operands, acc = _mma_operands(ins.opcode, ins.operands)
        return operands | acc, writes
    tokens = ins.operands.split(",")
    first = tokens[0].strip()
    if ins.base in NO_DESTINATION or not re.fullmatch(r"R\d+(\.\w+)*", first):
        return _registers(ins.operands), set()
    return _registers(",".join(tokens[1:])), _registers(first.split(".")[0], _width(ins.opcode))


def _sink_reads(ins) -> set:
    """Registers an instruction hands to a tensor-core operand: MMA A/B, STS data."""
    if ins.base in MMA_OPCODES:
        return _mma_operands(ins.opcode, ins.operands)[1]
    if ins.base in STAGE_OPCODES:  # "[address], data": the address is not the operand
        return _registers(ins.operands.split("]", 1)[1], _width(ins.opcode)) if "]" in ins.operands else set()
    return set()


def _forward(body: list) -> list[bool]:
    """Per instruction: does it read a register a load wrote (through the chain)?"""
    tainted, out = set(), []
    for ins in body:
        reads, writes = reads_writes(ins)
        hit = bool(reads & tainted) and ins.base not in MMA_OPCODES and ins.base not in LOAD_OPCODES
        out.append(hit)
        if ins.base in LOAD_OPCODES or hit:
            tainted |= writes
        elif not ins.predicate:
            tainted -= writes
    return out


def _backward(body: list) -> list[bool]:
    """Per instruction: does a register it writes reach a tensor-core operand?"""
    needed, out = set(), [False] * len(body)
    for i in range(len(body) - 1, -1, -1):
        ins = body[i]
        reads, writes = reads_writes(ins)
        if ins.base in MMA_OPCODES or ins.base in STAGE_OPCODES:
            needed |= _sink_reads(ins)
            continue
        if writes & needed:
            out[i] = True
            if not ins.predicate:
                needed -= writes
            if ins.base not in LOAD_OPCODES:  # addresses of loads are not the data
                needed |= reads
    return out


def dequant_slice(body: list) -> list[int]:
    """Indices into ``body`` (one main-loop iteration, Instructions) of the chop described in the
    module docstring: data derived from loads on its way to tensor-core operands."""
    twice = list(body) + list(body)
    forward, backward = _forward(twice), _backward(twice)
    return sorted({i % len(body) for i, (f, b) in enumerate(zip(forward, backward)) if f and b})


def dequant_report(body: list, units_per_thread: float | None) -> dict | None:
    """The slice's size, opcodes and addresses, and per element; None when the loop issues no
    tensor-core instruction (the GEMV: its arithmetic is the whole loop)."""
    if not any(ins.base in MMA_OPCODES for ins in body):
        return None
    picked = [body[i] for i in dequant_slice(body)]
    opcodes = {}
    for ins in picked:
        opcodes[ins.base] = opcodes.get(ins.base, 0) + 1
    return {"instructions": len(picked),
            "per_unit": round(len(picked) / units_per_thread, 3) if units_per_thread else None,
            "opcodes": dict(sorted(opcodes.items(), key=lambda kv: -kv[1])),
            "addresses": [ins.address for ins in picked]}
