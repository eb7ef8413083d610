"""How a kernel's result is judged against its reference: the one home of the bounds that
``bench/correctness.py`` (the GPU check), ``runtime/selfcheck.py`` (the load-time self-check) and
``runtime/kernels/matmul_tuning.py`` (the check of a GEMM configuration tuned at first use) hold
the kernels to, and of the switch that turns the checks off.

Errors are ``‖out − ref‖ / ‖ref‖`` in float64; the bounds are per activation dtype (fp16 rounds
at 2⁻¹¹, bf16 at 2⁻⁸; float32 kernels may multiply in TF32, which rounds as fp16 does).
"""

from __future__ import annotations

import os

import torch

REL_ERROR_BOUND = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2, torch.float32: 2e-3}
POISON = float("nan")
SELF_CHECK_ENV = "LOWBIT_SELF_CHECK"  # "0" skips the checks in every process that reads it


class Mismatch(AssertionError):
    """The kernel ran, and its result is not the reference's."""


def checks_switched_off() -> bool:
    """Whether the environment turns the kernels' checks off (``LOWBIT_SELF_CHECK=0``)."""
    return os.environ.get(SELF_CHECK_ENV, "1").strip().lower() in ("0", "false", "no", "off")


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Raise :class:`Mismatch` (naming ``what``) when ``out`` is outside the bound of ``dtype``."""
    err, bound = rel_error(out, ref), REL_ERROR_BOUND[dtype]
    if not err <= bound:
        raise Mismatch(f"{what}: relative error {err:.2e} against the reference (bound {bound:.1e})")


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN (an unwritten or broken element) never passes."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def poison(numel: int, dtype: torch.dtype, device: torch.device) -> None:
    """Leave a NaN-filled block of this size in the caching allocator for the next output to reuse
    (a freed block of the same size goes to the next allocation), so an element a kernel never
    writes fails the check."""
    torch.full((numel,), POISON, dtype=dtype, device=device)
