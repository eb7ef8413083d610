"""The self-check on first use: each kernel configuration a model will run is run once on a small
input against its reference before a request reaches it.

Kernels nobody has run on this GPU, driver and Triton release must not crash a user's job or give
wrong numbers. :func:`check_decoder` (``runtime.load.prepare`` on CUDA) and :func:`check_engine` (an
Engine's start-up: its KV scheme, and the GEMM configurations it tuned) find every distinct
configuration the decoder is set to run on Triton (``runtime/selfcheck_cases.py``: quantized
Linears per scheme, shape, dtype and M regime; the fused small ops; attention over the KV scheme),
run each once per process and compare it with its reference within ``runtime.tolerances``. A
compile error, a launch error or a result outside the bound sends that configuration to its
reference path (``QuantLinear.fall_back``, the PyTorch small ops, SDPA over the dequantized cache)
with one warning naming the kernel, the configuration, the GPU, the Triton release and the error.
A quantized Linear is checked per M regime (``selfcheck_cases.check_linear``): a launch
configuration that fails is remembered (the tuner leaves it out) and the regime's next candidate
is checked; a regime none passes runs the reference for its rows only, and the whole Linear falls
back only when no regime passes (one warning says what failed and what runs instead).
Where nothing runs on Triton (CPU) it does nothing. :func:`kernel_table` is what ``lowbit doctor``
prints. Skipped by ``runtime.load(..., self_check=False)`` or ``LOWBIT_SELF_CHECK=0``.
A GEMM configuration tuned later, at the first call of a shape (``Model.generate``), is checked
where it is tuned (``runtime/kernels/matmul_tuning.py``) before its first use, whatever the
model's ``self_check`` (only ``LOWBIT_SELF_CHECK=0`` skips that); a shape none passes runs the
reference for those rows (``QuantLinear.forward``).

One failure no fallback can undo: a launch that faults (an illegal address) leaves CUDA's context
unusable for the whole process. The check then fails at load, naming the kernel, instead of in the
middle of a job; every check reads its result back before the next starts, so the error surfaces
in the configuration that caused it.
"""

from __future__ import annotations

import warnings

import torch

from runtime import selfcheck_cases as cases
from runtime.selfcheck_cases import Config
from runtime.tolerances import SELF_CHECK_ENV as ENV_SWITCH  # noqa: F401 (the CLI's --no-self-check sets it)
from runtime.tolerances import Mismatch, checks_switched_off

_OUTCOMES: dict[tuple, str | None] = {}  # configuration key -> None (passed) or what failed: once per process
_PARTLY: dict[tuple, str] = {}  # configuration key -> what failed in a configuration that passed otherwise


class SelfCheckError(ValueError):
    """The kernels were asked for explicitly (``attention="triton"``) and failed their check."""


def enabled(decoder=None) -> bool:
    """Whether the check runs: not switched off by the environment or for this decoder (``prepare``)."""
    if checks_switched_off():
        return False
    return getattr(decoder, "self_check", True)


def check_decoder(decoder, dtype: torch.dtype, kv_scheme=None) -> list[Config]:
    """Check every configuration ``decoder`` is set to run on Triton (after ``prepare`` chose them);
    the failed ones run their reference from now on. Attention over ``kv_scheme`` when the decoder
    chose the attention kernels. Returns the configurations as they now run."""
    if not enabled(decoder):
        return []
    configs = cases.linear_configs(decoder, dtype) + cases.small_op_configs(decoder, dtype)
    if kv_scheme is not None and decoder.attention_kernels:
        configs.append(cases.attention_config(decoder, dtype, kv_scheme, decoder.attention_kernels))
    return run(configs)


def check_engine(model, scheme, kernels: bool, strict: bool, largest_m: int | tuple[int, ...]) -> bool:
    """At an Engine's start-up (its GEMMs tuned, before its CUDA graphs are captured): the tuned
    configuration of every M bucket (up to ``largest_m``, or the buckets it lists: those the Engine
    tuned) of each quantized Linear, and attention over the engine's KV
    scheme when ``kernels`` chose the Triton backend. Returns whether attention stays on the kernels.
    ``strict`` (``attention="triton"``): a failed attention check is an error, not a fallback."""
    decoder = model.decoder
    if not enabled(decoder):
        return kernels
    if model.device.type == "cuda":  # where the engine tuned them (elsewhere the load-time check saw the same)
        run(cases.linear_configs(decoder, model.dtype, tuned_up_to=largest_m))
    if not kernels:
        return False
    config = cases.attention_config(decoder, model.dtype, scheme, kernels, own_cache=scheme == model.kv_scheme)
    run([config], strict=strict)
    return config.fused


def checked_capture(make_executor, graphs: bool, decoder):
    """``make_executor(graphs)``, its CUDA graphs (one per batch bucket) each replayed once against
    the same step run eagerly on the same inputs; a capture that fails or a replay that disagrees
    leaves the engine on eager decode steps (the same kernels, launched one by one) with one warning."""
    if not graphs or not enabled(decoder):
        return make_executor(graphs)
    try:
        executor = make_executor(True)
        for graph in executor.graphs.graphs.values():
            check_replay(graph, next(decoder.parameters()).dtype)
    except Exception as e:  # noqa: BLE001 - whatever broke the capture or the replay: run without graphs
        device = next(decoder.parameters()).device
        warnings.warn(f"self-check: the CUDA graphs of the decode step failed on {device_name_of(device)}, Triton "
                      f"{triton_version()}: {describe_error(e)}; decode steps run eagerly instead (correct, slower)",
                      stacklevel=2)
        return make_executor(False)
    return executor


def check_replay(graph, dtype: torch.dtype) -> None:
    """One replay of ``graph`` (``runtime.execution.DecodeGraph``) against its step run eagerly on
    the same static inputs: token 0 at position 0 of every row (free slots at start-up, which the
    capture's own warm-up wrote the same way)."""
    rows = graph.batch
    with torch.inference_mode():
        replayed = graph.run([0] * rows, [0] * rows).clone()
        eager = graph.step()
    cases.compare(replayed, eager, dtype, f"the replay of the decode graph for {rows} rows")


def run(configs: list[Config], strict: bool = False) -> list[Config]:
    """Check each fused configuration (once per process); the failed ones fall back."""
    for config in configs:
        if not (config.fused and config.checkable):
            continue
        error = _outcome(config)
        if error is None:
            continue
        if strict:
            raise SelfCheckError(f"{config.kernel} [{config.config}] failed its self-check on {device_name(config)}: "
                                 f"{error}; the reference path (attention='reference' or 'auto') runs instead of it")
        config.fall_back(f"self-check failed: {error}")
        config.fused, config.why_not = False, f"fell back: {error}"
    return configs


def _outcome(config: Config) -> str | None:
    """None when the configuration passed (run now, or earlier in this process), else the error;
    a new failure warns once."""
    if config.key in _OUTCOMES:
        return _OUTCOMES[config.key]
    try:
        with torch.inference_mode():
            partly = config.check()
        error = None
    except Exception as e:  # noqa: BLE001 - a compile error, a launch error or a mismatch: all mean "do not run it"
        error, partly = describe_error(e), None
    _OUTCOMES[config.key] = error
    if error is not None:
        warnings.warn(f"self-check: {config.kernel} [{config.config}] failed on {device_name(config)}, "
                      f"Triton {triton_version()}: {error}; it runs {config.reference} instead (correct, slower)",
                      stacklevel=3)
    elif partly:  # a quantized Linear: some launch configurations failed, others run instead
        _PARTLY[config.key] = partly
        warnings.warn(f"self-check: {config.kernel} [{config.config}] on {device_name(config)}, Triton "
                      f"{triton_version()}: {partly}", stacklevel=3)
    return error


def describe_error(e: Exception, limit: int = 400) -> str:
    """The error in one line: its type and message (a compile error's last lines say the most)."""
    text = " ".join(str(e).split())
    if len(text) > limit:
        text = "..." + text[-limit:]
    return f"{type(e).__name__}: {text}" if not isinstance(e, Mismatch) else text


def device_name(config: Config) -> str:
    return device_name_of(config.key[-1])


def device_name_of(device: torch.device) -> str:
    """The GPU (its architecture and torch's CUDA release) or, in tests, the interpreter."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor}, CUDA {torch.version.cuda})"
    return f"{device.type} (Triton interpreter)"


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def kernel_table(decoder, dtype: torch.dtype, kv_scheme=None) -> list[dict]:
    """What runs fused and what runs the reference (and why), one row per configuration; a quantized
    Linear's row names its backend (``runs``) and every backend its choice passed over, with why
    (``why``; read from ``QuantLinear.choice``, not decided again)."""
    configs = cases.linear_configs(decoder, dtype) + cases.small_op_configs(decoder, dtype)
    if kv_scheme is not None:
        configs.append(cases.attention_config(decoder, dtype, kv_scheme, decoder.attention_kernels))
    rows = []
    for c in configs:
        failed = _OUTCOMES.get(c.key)
        why = _PARTLY.get(c.key) if c.fused else (f"fell back: {failed}" if failed else c.why_not)
        if c.backend is not None and c.fused and c.why_not:  # a Linear on Triton: what it passed over too
            why = "; ".join(filter(None, (why, c.why_not)))
        runs = c.backend or ("fused" if c.fused else c.instead)  # a Linear: its backend, from its choice
        rows.append({"kernel": c.kernel, "configuration": c.config, "runs": runs, "reference": c.reference,
                     "why": why})
    return rows


def table_text(rows: list[dict]) -> str:
    """``kernel_table`` as aligned text columns."""
    header = ("kernel", "configuration", "runs", "why")
    lines = [header] + [(r["kernel"], r["configuration"], r["runs"], r["why"] or "") for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(3)]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line[:3], widths)) + "  " + line[3]
                     for line in lines).rstrip()
