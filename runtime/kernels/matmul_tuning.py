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

Configurations known to give wrong results are left out before timing, each with its reason (in
``NoConfiguration``'s message when nothing is left): those that failed a check in this process for
the same weight shape (this tuner's check or the load-time self-check: :func:`remember_failure`).
(What a Triton release is known to compile wrongly, matmul_configs leaves out of the candidates:
``wgmma_hazard``.) A winner is kept on
disk for later processes (``runtime/kernels/tuning_cache.py``); a process that finds one checks it
before use instead of timing the candidates.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import torch

from runtime.kernels import tuning_cache
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


# -- configurations known to give wrong results --------------------------------------------------------

_FAILED: dict[tuple, dict[MatmulConfig, str]] = {}  # weight shape -> configuration -> what failed (this process)
# (M bucket, weight key) -> every timed candidate's median ms, fastest first (this process): what the
# benches record beside the winner (bench/kernels.py), so one GPU run times every candidate family
TIMINGS: dict[tuple, list[tuple[float, MatmulConfig]]] = {}


def weight_key(kw: KernelWeight, dtype: torch.dtype, device: torch.device) -> tuple:
    """What a known failure is kept for: the weight's shape and format, the dtype and the device
    (every M: a configuration wrong at one row count is not trusted at another)."""
    return kw.out_features, kw.in_features, kw.bits, kw.group_len, kw.zeros is None, dtype, str(device)


def remember_failure(kw: KernelWeight, dtype: torch.dtype, device: torch.device, config: MatmulConfig,
                     reason: str) -> None:
    """``config`` failed a check for this weight: it is not tuned or checked again in this process."""
    _FAILED.setdefault(weight_key(kw, dtype, device), {})[config] = reason


def usable(candidates: list[MatmulConfig], kw: KernelWeight, dtype: torch.dtype,
           device: torch.device) -> tuple[list[MatmulConfig], list[str]]:
    """The candidates not known to give wrong results, in order, and why each other one is left out."""
    failed = _FAILED.get(weight_key(kw, dtype, device), {})
    kept = [config for config in candidates if config not in failed]
    left_out = [f"{config}: failed its check earlier in this process: {failed[config]}"
                for config in candidates if config in failed]
    return kept, left_out


def tune(M: int, kw: KernelWeight, dtype: torch.dtype, device: torch.device, candidates: list[MatmulConfig],
         launch: Launch) -> MatmulConfig:
    """The fastest candidate for ``M`` rows that runs and matches the reference (a winner kept on
    disk by an earlier process, once it passes its check here)."""
    kept, failed = usable(candidates, kw, dtype, device)
    if not kept:
        raise NoConfiguration(f"quant_matmul ({shape_name(M, kw, dtype)}): every one of the {len(candidates)} "
                              f"candidate configurations is known to give wrong results here: " + "; ".join(failed))
    cached = tuning_cache.load(M, kw, dtype, device, candidates)
    if cached in kept:
        if _cached_passes(M, kw, dtype, device, cached, candidates, launch):
            return cached
        kept.remove(cached)  # remembered as failing: not timed again
        failed.append(f"{cached}: failed its check")
    winner = _timed_winner(M, kw, dtype, device, kept, failed, launch)
    if not checks_switched_off():  # only a checked winner is kept for other processes
        tuning_cache.store(M, kw, dtype, device, candidates, winner)
    return winner


def _cached_passes(M, kw, dtype, device, config: MatmulConfig, candidates, launch: Launch) -> bool:
    """Whether the winner an earlier process kept passes its check in this one (a failure is
    remembered, its file discarded, and the candidates are timed again)."""
    if checks_switched_off():
        return True
    try:
        check(M, kw, dtype, device, config, launch)
    except Exception as e:  # noqa: BLE001 - a wrong result or a failure on the check's input
        remember_failure(kw, dtype, device, config, one_line(e))
        tuning_cache.discard(M, kw, dtype, device, candidates)
        warnings.warn(f"quant_matmul ({shape_name(M, kw, dtype)}): the tuning cache's configuration {config} failed "
                      f"its check: {one_line(e)}; the entry is discarded and the candidates are timed again",
                      stacklevel=4)
        return False
    return True


def _timed_winner(M, kw, dtype, device, candidates: list[MatmulConfig], failed: list[str],
                  launch: Launch) -> MatmulConfig:
    x = torch.randn(M, kw.in_features, dtype=dtype, device=device)
    out = torch.empty(M, kw.out_features, dtype=dtype, device=device)
    timed = []
    for config in candidates:
        try:
            timed.append((time_ms(lambda config=config: launch(x, kw, None, out, config)), config))
        except Exception as e:  # noqa: BLE001 - any compile or launch failure: skip this one, keep why
            failed.append(f"{config}: {one_line(e)}")
    if not timed:
        raise NoConfiguration(f"quant_matmul ({shape_name(M, kw, dtype)}): none of the {len(candidates)} candidate "
                              f"configurations tried compiled and ran on this GPU: " + "; ".join(failed))
    timed.sort(key=lambda pair: pair[0])
    TIMINGS[(M, weight_key(kw, dtype, device))] = timed
    if checks_switched_off():
        return timed[0][1]
    mismatched = []
    for _, config in timed:
        try:
            check(M, kw, dtype, device, config, launch)
        except Exception as e:  # noqa: BLE001 - a wrong result or a failure on the check's input
            mismatched.append((config, one_line(e)))
            remember_failure(kw, dtype, device, config, one_line(e))
            continue
        if mismatched:
            first, error = mismatched[0]
            warnings.warn(f"quant_matmul ({shape_name(M, kw, dtype)}): the fastest configuration {first} failed its "
                          f"check: {error}; {config} runs instead", stacklevel=4)
        return config
    did_not_run = "; left out or did not run: " + "; ".join(failed) if failed else ""
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


def one_line(e: Exception, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text if len(text) <= limit else '...' + text[-limit:]}"
