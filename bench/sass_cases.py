"""The kernel cases bench/sass.py compiles (one kernel at one launch configuration) and the per-SM
limits of the GPUs its targets stand for, with the occupancy arithmetic on them. The case files
(``sass_weights.py``, ``sass_attention.py``) import this module, not bench/sass.py (which imports
them)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Per-SM limits of the GPUs these targets stand for (H100, A100): registers, shared memory a
# CTA may use, shared memory per SM (each CTA also reserves 1 KiB), warps.
SM_LIMITS = {90: dict(registers=65536, smem_per_cta=227 * 1024, smem_per_sm=228 * 1024, warps=64),
             80: dict(registers=65536, smem_per_cta=163 * 1024, smem_per_sm=164 * 1024, warps=64)}


@dataclass
class KernelCase:
    """One kernel at one launch configuration, as the runtime launches it."""

    name: str
    kernel_fn: object  # a @triton.jit function
    signature: dict  # non-constexpr argument -> Triton type string
    constexprs: dict
    num_warps: int
    num_stages: int
    units_per_iteration: int | None = None  # what the whole CTA covers per main-loop iteration
    unit: str = "weight"
    archs: tuple = ("sm_90a", "sm_80")
    notes: str = ""  # how the runtime picks this configuration
    budgets: dict = field(default_factory=dict)  # bench/sass.py's BUDGET_CHECKS; met or not, the JSON says which
    divisible_by_16: tuple | None = None  # arguments Triton would specialize; None: every pointer


def ctas_per_sm(registers: int, shared_bytes: int, num_warps: int, capability: int) -> int:
    """CTAs one SM holds: registers are allocated per warp in units of 256, shared memory per
    CTA plus 1 KiB reserved."""
    limit = SM_LIMITS[capability]
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = (limit["registers"] // per_warp) // num_warps if per_warp else limit["warps"] // num_warps
    by_warps = limit["warps"] // num_warps
    by_smem = limit["smem_per_sm"] // (shared_bytes + 1024) if shared_bytes else by_warps
    if shared_bytes > limit["smem_per_cta"]:
        return 0
    return min(by_regs, by_warps, by_smem)


def max_registers(ctas: int, num_warps: int, capability: int) -> int:
    """The most registers per thread that still let ``ctas`` CTAs of ``num_warps`` warps share
    one SM's register file (allocated per warp in units of 256; 255 is the hardware's cap)."""
    warp_units = SM_LIMITS[capability]["registers"] // (ctas * num_warps * 256)
    return min(255, warp_units * 256 // 32)
