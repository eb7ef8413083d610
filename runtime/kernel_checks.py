"""The kernels' own checks against their references, for the backends' self-check hooks
(``runtime/linear_backends/triton.py``, ``runtime/attention_backends/triton.py``) and for
``runtime/selfcheck_cases.py``, which builds a model's configurations around them. Nothing here
imports the modules that hold backends (the Linear, the model, attention), so the backends can call
it without a circle of imports."""

from __future__ import annotations

import torch

from runtime.tolerances import Mismatch, compare, poison

CHECKED_OUTPUTS = 256  # output rows of a large Linear the reference computes, at each end


def random(shape, dtype, device, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


# ------------------------------------------------------------------------------ quantized Linears



def check_linear(layer, kw, dtype: torch.dtype, rows: tuple[int, ...], tuned: bool) -> str | None:
    """The Triton kernel's ``x @ W.T + b`` on ``layer``'s kernel weight ``kw`` at each row count
    against float64 over the dequantized weight (the Triton backend's self-check hook).

    ``tuned`` (an Engine): the configuration tuned for each row count (one whose tuning found none
    is skipped: its rows run the reference); a failure raises. Otherwise each row count stands for
    its M regime: the regime's candidates, untimed, in order, until one passes. Each that fails is
    remembered for this weight (``matmul_tuning.remember_failure``: the tuner leaves it out in this
    process), so a regime none passes finds no configuration when tuned and runs dequantize + matmul
    for its rows, while the other regimes keep the kernels. Raises the first failure when no regime
    passes (the whole Linear falls back); returns what failed and what runs instead when some did."""
    from runtime.kernels import matmul_tuning as tuning
    from runtime.kernels import quant_matmul as qm
    from runtime.kernels.matmul_configs import candidate_configs

    bias = None if layer.bias is None else layer.bias.detach()
    device = layer.weight_scale.device
    outputs = _checked_outputs(layer.out_features, 32 // layer.scheme.bits)
    dense = torch.cat([_dense_rows(layer, a, b, dtype) for a, b in outputs]).double()
    picked = torch.cat([torch.arange(a, b) for a, b in outputs]).to(device)

    def run(M: int, config) -> None:
        x = random((M, layer.in_features), dtype, device, seed=M)
        poison(M * layer.out_features, dtype, device)
        out = qm.quant_matmul(x, kw, bias, config=config)
        ref = x.double() @ dense.T
        if bias is not None:
            ref = ref + bias[picked].double()
        compare(out.index_select(-1, picked), ref, dtype, f"M={M} ({launch_name(config)})")

    if tuned:
        for M in rows:
            try:
                config = qm.choose_config(M, kw, dtype, device)
            except tuning.NoConfiguration:
                continue
            run(M, config)
        return None
    notes, errors, passed = [], [], 0
    for M in rows:
        candidates, _ = tuning.usable(candidate_configs(M, kw), kw, dtype, device)
        failed = []
        for config in candidates:
            try:
                run(M, config)
            except Exception as e:  # noqa: BLE001 - a compile error, a launch error or a mismatch: the next one
                tuning.remember_failure(kw, dtype, device, config, tuning.one_line(e))
                failed.append((config, e))
                continue
            passed += 1
            if failed:
                notes.append(f"{_failures(M, failed)}; the tuner leaves {'it' if len(failed) == 1 else 'them'} out "
                             f"in this process, {launch_name(config)} passed")
            break
        else:
            errors += [e for _, e in failed]
            notes.append(f"{_failures(M, failed) if failed else f'M={M}: every candidate is known to fail here'}; "
                         f"no configuration passed for {regime_rows(M, kw)}: those rows run dequantize + matmul")
    if not passed:
        raise errors[0] if errors else RuntimeError("; ".join(notes))
    return "; ".join(notes) or None


def _failures(M: int, failed: list) -> str:
    return "; ".join(f"M={M} ({launch_name(c)}): {_describe(e)}" for c, e in failed)


def _describe(e: Exception) -> str:
    from runtime.kernels.matmul_tuning import one_line

    return str(e) if isinstance(e, Mismatch) else one_line(e)


def regime_rows(M: int, kw, largest: int = 1024) -> str:
    """The row counts tuned with the same candidates as ``M`` (its regime), e.g. ``M=17..64``."""
    from runtime.kernels.matmul_configs import candidate_configs

    same = candidate_configs(M, kw)
    lo, hi = M, M
    while lo > 1 and candidate_configs(lo - 1, kw) == same:
        lo -= 1
    while hi < largest and candidate_configs(hi + 1, kw) == same:
        hi += 1
    return f"M={lo}" if lo == hi else f"M={lo}..{hi}" if hi < largest else f"M>={lo}"


def launch_name(config) -> str:
    """A ``MatmulConfig`` in a few words: which loop, its tile, split and warps."""
    if getattr(config, "dense", False):
        return f"dense (dequantize x{config.block_n}, {config.num_warps} warps, then cuBLAS)"
    loop = f"tl.dot {config.block_m}x{config.block_n}" if config.use_dot else f"GEMV x{config.block_n}"
    return f"{loop}, split-K {config.split_k}, {config.num_warps} warps, {config.num_stages} stages"


def _checked_outputs(n: int, pack: int) -> list[tuple[int, int]]:
    """The output rows the reference computes: all of a small Linear, else both ends (the second
    range starts on a zero-point word boundary, so its packed zero points slice cleanly)."""
    if n <= 2 * CHECKED_OUTPUTS:
        return [(0, n)]
    start = (n - CHECKED_OUTPUTS) // pack * pack
    return [(0, CHECKED_OUTPUTS), (start, n)]


def _dense_rows(layer, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
    """Output rows ``a .. b`` of the layer's dequantized weight (the reference path's weight)."""
    from runtime.kernels import reference

    pack = 32 // layer.scheme.bits
    zero = getattr(layer, "weight_zero_point", None)
    zero = None if zero is None else zero[a // pack:-(-b // pack)]
    return reference.dequantize_weight(layer.weight_packed[a:b], layer.weight_scale[a:b], zero,
                                       (b - a, layer.in_features), layer.scheme, dtype,
                                       getattr(layer, "weight_g_idx", None))


# ------------------------------------------------------------------------------------ attention


def check_attention(cfg, scheme, dtype, device, windows) -> None:
    """The same steps on two one-layer caches, one through the kernels and one through their
    references: a prefill that fills a block, a chunk after cached positions, two decode steps."""
    from runtime.attention_math import attention_mask
    from runtime.cache_lockstep import LockstepCache
    from runtime.kernels import kv_reference as ref
    from runtime.kernels.attention import KERNEL_OPS

    B, h, kv, d = scheme.block_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    steps = [(0, B + 3), (B + 3, 2), (B + 5, 1), (B + 6, 1)]
    for window in windows:
        caches = [LockstepCache(1, 2, kv, d, B + 7, dtype, device, scheme=scheme, windows=[window]) for _ in "ab"]
        for i, (start, T) in enumerate(steps):
            q = random((2, h, T, d), dtype, device, 10 + i)
            k = random((2, kv, T, d), dtype, device, 20 + i)
            k[..., :: max(d // 8, 1)] += 4.0  # persistent key channels, as LLMs make them
            v = random((2, kv, T, d), dtype, device, 30 + i)
            mask = attention_mask(T, start + T, window, device)
            got = ref.cache_attention(caches[0], 0, start, q, k, v, mask, window, ops=KERNEL_OPS)
            want = ref.cache_attention(caches[1], 0, start, q, k, v, mask, window, ops=ref.REFERENCE_OPS)
            compare(got, want, dtype, f"{'decode' if T == 1 else 'prefill'} at position {start}"
                    + (f", window {window}" if window else ""))
