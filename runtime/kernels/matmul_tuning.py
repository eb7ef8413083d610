"""Choosing the quantized matmul's launch configuration at first use: time the candidates, then
check the winner against the reference before it is used.

A tuned configuration may be one the load-time self-check (``runtime/selfcheck.py``) never ran:
that check runs the untimed default of each M regime, and ``Model.generate`` tunes lazily, at the
first call of each shape. So every timed winner is run once more here on the same shape against a
float64 reference of its output (the first and last 256 rows and columns, where the last tiles'
masking would hide a bug), within ``runtime.tolerances``. A winner that fails gives way to the next
fastest that passes, with one warning naming the kernel, the shape, the configuration and the
error. A candidate that fails to compile or launch (out of registers or shared memory, a compile or
ptxas error, a driver error) is skipped with its reason kept; when no candidate runs, or none
passes, :class:`NoConfiguration` names the kernel, the shape and every reason: ``choose_config``
keeps it for the shape and ``QuantLinear`` runs the dense reference (dequantize + matmul) for those
rows instead, with one warning.

Only the process-wide switch ``LOWBIT_SELF_CHECK=0`` (``lowbit --no-self-check``) skips the check,
not the timing. ``runtime.load(..., self_check=False)`` does not: it skips one model's load-time and
Engine start-up checks (``runtime/selfcheck.py``), while a tuned configuration is kept per process
and serves every model of that shape, so it is checked whichever model tuned it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import torch

from runtime.kernels.matmul_configs import MatmulConfig
from runtime.kernels.weight_layout import KernelWeight, dequantize_kernel_weight, interleave_word_rows, word_rows
from runtime.tolerances import checks_switched_off, compare

CHECKED = 256  # rows and output columns the reference computes at each end of a large product

Launch = Callable[[torch.Tensor, KernelWeight, torch.Tensor | None, torch.Tensor, MatmulConfig], None]


class NoConfiguration(RuntimeError):
    """No candidate configuration ran (or gave the reference's result) for a shape."""


def time_ms(fn: Callable[[], None]) -> float:
    """Median milliseconds of ``fn`` on the GPU (the seam tests replace: timing needs CUDA)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def shape_name(M: int, kw: KernelWeight, dtype: torch.dtype) -> str:
    zero = "symmetric" if kw.zeros is None else "asymmetric"
    return (f"M={M}, {kw.in_features}->{kw.out_features}, W{kw.bits} {zero} g{kw.group_len}, "
            f"{str(dtype).removeprefix('torch.')}")


def tune(M: int, kw: KernelWeight, dtype: torch.dtype, device: torch.device, candidates: list[MatmulConfig],
         launch: Launch) -> MatmulConfig:
    """The fastest candidate for ``M`` rows that runs and matches the reference."""
    x = torch.randn(M, kw.in_features, dtype=dtype, device=device)
    out = torch.empty(M, kw.out_features, dtype=dtype, device=device)
    timed, failed = [], []
    for config in candidates:
        try:
            timed.append((time_ms(lambda config=config: launch(x, kw, None, out, config)), config))
        except Exception as e:  # noqa: BLE001 - any compile or launch failure: skip this one, keep why
            failed.append(f"{config}: {_one_line(e)}")
    if not timed:
        raise NoConfiguration(f"quant_matmul ({shape_name(M, kw, dtype)}): none of the {len(candidates)} candidate "
                              f"configurations compiled and ran on this GPU: " + "; ".join(failed))
    timed.sort(key=lambda pair: pair[0])
    if checks_switched_off():
        return timed[0][1]
    mismatched = []
    for _, config in timed:
        try:
            check(M, kw, dtype, device, config, launch)
        except Exception as e:  # noqa: BLE001 - a wrong result or a failure on the check's input
            mismatched.append((config, _one_line(e)))
            continue
        if mismatched:
            first, error = mismatched[0]
            warnings.warn(f"quant_matmul ({shape_name(M, kw, dtype)}): the fastest configuration {first} failed its "
                          f"check: {error}; {config} runs instead", stacklevel=3)
        return config
    did_not_run = "; did not run: " + "; ".join(failed) if failed else ""
    raise NoConfiguration(f"quant_matmul ({shape_name(M, kw, dtype)}): no configuration that ran matches the "
                          f"reference: " + "; ".join(f"{c}: {e}" for c, e in mismatched) + did_not_run)


def check(M: int, kw: KernelWeight, dtype: torch.dtype, device: torch.device, config: MatmulConfig,
          launch: Launch) -> None:
    """``config`` on a random input of ``M`` rows against float64 over the dequantized weight (its
    first and last rows and columns, where the last tiles' masking is); raises
    ``runtime.tolerances.Mismatch``. The output starts as NaN, so an element never written fails."""
    x = torch.randn(M, kw.in_features, generator=torch.Generator().manual_seed(M)).to(device, dtype)
    out = torch.full((M, kw.out_features), float("nan"), dtype=dtype, device=device)
    launch(x, kw, None, out, config)
    rows = torch.cat([torch.arange(a, b) for a, b in checked_ranges(M)]).to(device)
    for a, b in checked_ranges(kw.out_features):
        # the weight rounded to the activation dtype, as the kernel and the self-check's reference see
        # it; ``launch`` takes inputs in the weight's (act-order) column order, so no permutation here
        weight = dequantize_kernel_weight(columns(kw, a, b), dtype).double()
        ref = x.index_select(0, rows).double() @ weight.T
        compare(out.index_select(0, rows)[:, a:b], ref, dtype, f"{config} at columns {a}..{b}")


def checked_ranges(n: int) -> list[tuple[int, int]]:
    """All of ``n`` rows or columns when few, else both ends: bounds the reference's work and memory."""
    if n <= 2 * CHECKED:
        return [(0, n)]
    return [(0, CHECKED), (n - CHECKED, n)]


def columns(kw: KernelWeight, a: int, b: int) -> KernelWeight:
    """Output columns ``a .. b`` of a kernel layout. Scales and zero points (unpacked) are ``[groups,
    N]``; the packed words are ``[K_pad // pack, N]`` in shape only (``interleave_word_rows``), so
    they are put back in row order, cut and interleaved again."""
    def cut(t):
        return None if t is None else t[:, a:b].contiguous()

    qweight = interleave_word_rows(cut(word_rows(kw.qweight)))
    return dataclasses.replace(kw, qweight=qweight, scales=cut(kw.scales), zeros=cut(kw.zeros), out_features=b - a)


def _one_line(e: Exception, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text if len(text) <= limit else '...' + text[-limit:]}"
