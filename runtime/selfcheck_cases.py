"""The kernel configurations a decoder runs, each with its check against the reference and its way
back to the reference path (``runtime/selfcheck.py`` runs them).

A configuration is what makes a different compiled kernel or launch: a quantized Linear's scheme,
shape, bias, scale and activation dtypes, in each M regime ``matmul_configs.candidate_configs``
launches differently (the GEMV at M = 1, 16-row ``tl.dot`` tiles up to ``DECODE_MAX_M``, 32/64-row
tiles up to 64, 64-row tiles and more above, by TMA on Hopper); each fused small op per width and
dtype; attention per KV scheme, head layout, window and dtype. Inputs are small (a few rows), so a
check costs a launch or a few, and the float64 reference of a large Linear reads only its first and
last output rows (the last tile's masking is where a bug would hide).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# the kernels' own checks (the backends call them too); re-exported for this module's older callers
from runtime.kernel_checks import check_attention, check_linear, launch_name, random, regime_rows  # noqa: F401
from runtime.tolerances import compare

LINEAR_ROWS = (1, 5, 40, 65)  # an M per launch regime of matmul_configs.candidate_configs (65: a masked 128-row tile)
CPU_ONLY = "kernels run on CUDA only; this device runs the reference"


@dataclass
class Config:
    """One kernel configuration: what it is, whether it runs fused now, how to check it and how to
    send it to the reference path. ``key`` (ending with the device) identifies it in the process."""

    kernel: str
    config: str
    reference: str
    key: tuple
    fused: bool
    why_not: str | None = None
    check: Callable[[], str | None] | None = None  # raises when it fails; may return what failed in part
    fall_back: Callable[[str], None] | None = None
    instead: str = "reference"  # what runs when it is not fused
    backend: str | None = None  # a quantized Linear's chosen backend (runtime/linear_backends/)

    @property
    def checkable(self) -> bool:
        """The Triton interpreter (tests, no GPU) runs bf16 as raw integers (its ``tl.dot``
        multiplies them), so there only fp16 and fp32 configurations can be judged."""
        return self.key[-1].type == "cuda" or torch.bfloat16 not in self.key


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")



def linear_configs(decoder, dtype: torch.dtype, tuned_up_to: int | None = None) -> list[Config]:
    """One configuration per distinct quantized Linear (layers of one shape share it). Checked at
    the first row count of each M regime on its default launch configuration, or, ``tuned_up_to``
    (an Engine), at every M bucket up to it (or at the buckets it lists) on the configuration tuned for it."""
    from runtime.linear import QuantLinear

    groups: dict[tuple, list] = {}
    names: dict[tuple, set] = {}
    for name, m in decoder.named_modules():
        if isinstance(m, QuantLinear):
            if m.choice is None:
                m.materialize(dtype)  # (prepare chose every layer's backend; a decoder built by hand had not)
            shape = (m.scheme.describe(), m.out_features, m.in_features, m.bias is not None,
                     hasattr(m, "weight_g_idx"), dtype_name(m.weight_scale.dtype))
            groups.setdefault((shape, m.backend_name), []).append(m)
            names.setdefault((shape, m.backend_name), set()).add(name.rsplit(".", 1)[-1])
    configs = []
    for (shape, backend), layers in groups.items():
        first = layers[0]
        device = first.weight_scale.device  # (on CPU the packed codes may live in the CPU kernel's copy)
        description = (f"{shape[0]}, {shape[2]}->{shape[1]}{', bias' if shape[3] else ''}"
                       f"{', act-order' if shape[4] else ''}, {dtype_name(dtype)}: "
                       f"{'/'.join(sorted(names[shape, backend]))} x{len(layers)}")
        rows = _tuned_rows(tuned_up_to) if tuned_up_to else LINEAR_ROWS
        configs.append(Config(
            "quant_matmul", description, "dequantize + matmul",
            ("linear", shape, dtype, "tuned" if tuned_up_to else "default", rows, device), first.self_checks,
            passed_over(first.choice),
            check=lambda first=first, rows=rows: first.self_check(dtype, rows, tuned=bool(tuned_up_to)),
            fall_back=lambda reason, layers=layers: _linears_fall_back(layers, reason),
            instead=backend, backend=backend))
    return configs


def _tuned_rows(tuned: int | tuple[int, ...]) -> tuple[int, ...]:
    """Every bucket up to an M, or an Engine's own (``Engine.tuned_buckets``: what it tuned)."""
    from runtime.execution import tuning_buckets

    return tuning_buckets(tuned) if isinstance(tuned, int) else tuple(tuned)


def _linears_fall_back(layers, reason: str) -> None:
    for layer in layers:
        layer.fall_back(reason)  # the next backend's weight built now, so the first request does not build it


def passed_over(choice) -> str | None:
    """The backends a Linear's choice passed over and why, as ``lowbit doctor`` prints them."""
    return "; ".join(f"{r.name}: {r.reason}" for r in choice.rejected) or None


# ------------------------------------------------------------------------------------ small ops


def small_op_configs(decoder, dtype: torch.dtype) -> list[Config]:
    """The fused add + RMSNorm, RoPE and SiLU-and-multiply, per width and dtype, where the decoder
    uses them (``Decoder.use_kernels``; Gemma's offset norms and q/k-normed models never do)."""
    from runtime.model import MLP, Attention
    from runtime.norms import RMSNorm

    cfg = decoder.cfg
    device = next(decoder.parameters()).device
    norms = [m for m in decoder.modules() if type(m) is RMSNorm and m.weight.shape[0] == cfg.hidden_size]
    ropes = [m for m in decoder.modules() if isinstance(m, Attention) and hasattr(m, "qkv_proj") and not cfg.qk_norm]
    mlps: dict[int, list] = {}
    for m in decoder.modules():
        if isinstance(m, MLP) and hasattr(m, "gate_up_proj") and m.act_name == "silu":
            mlps.setdefault(m.gate_up_proj.out_features // 2, []).append(m)
    configs = []
    if norms:
        configs.append(_small_op("add_rmsnorm", f"width {cfg.hidden_size}", norms, dtype, device,
                                 lambda: check_norm(norms[0], dtype, device)))
    if ropes:
        shape = f"{cfg.num_heads} query / {cfg.num_kv_heads} KV heads x {cfg.head_dim}"
        configs.append(_small_op("rope_qkv", shape, ropes, dtype, device, lambda: check_rope(decoder, dtype, device)))
    for width, modules in mlps.items():
        configs.append(_small_op("silu_mul", f"width {width}", modules, dtype, device,
                                 lambda width=width: check_silu(width, dtype, device)))
    return configs


def _small_op(kernel: str, shape: str, modules: list, dtype, device, check) -> Config:
    def fall_back(reason: str) -> None:
        for m in modules:
            m.kernels = False

    fused = modules[0].kernels
    return Config(kernel, f"{shape}, {dtype_name(dtype)}", "PyTorch ops", (kernel, shape, dtype, device), fused,
                  None if fused else CPU_ONLY if device.type != "cuda" else "not chosen at load",
                  check=check, fall_back=fall_back)


def check_norm(norm, dtype, device) -> None:
    from runtime.kernels.small_ops import add_rmsnorm

    n = norm.weight.shape[0]
    x, residual = random((3, n), dtype, device, 1), random((3, n), dtype, device, 2)
    for res in (residual, None):
        out, total = add_rmsnorm(x, res, norm.weight.to(dtype), norm.eps)
        want_total = x if res is None else x + res
        compare(total, want_total, dtype, "the residual sum")
        compare(out, type(norm).forward(norm, want_total), dtype, "the norm")  # forward: the PyTorch path


def check_silu(width: int, dtype, device) -> None:
    import torch.nn.functional as F

    from runtime.kernels.small_ops import silu_mul

    gate_up = random((3, 2 * width), dtype, device, 3)
    gate, up = gate_up.chunk(2, dim=-1)
    compare(silu_mul(gate_up), F.silu(gate) * up, dtype, "silu(gate) * up")


def check_rope(decoder, dtype, device) -> None:
    """A prefill's rotation (cos/sin [T, D]) and a decode step's, which also writes each
    sequence's key and value into its cache residual block (cos/sin per sequence)."""
    from runtime.kernels.small_ops import rope_qkv
    from runtime.rope import apply_rope

    cfg = decoder.cfg
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def reference(qkv, cos, sin):
        B, T, _ = qkv.shape
        q, k, v = (t.view(B, T, -1, d).transpose(1, 2) for t in qkv.split([h * d, kv * d, kv * d], dim=-1))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    qkv = random((2, 3, (h + 2 * kv) * d), dtype, device, 4)
    cos, sin = decoder.rope(5, 3, dtype)[0]
    for got, want, what in zip(rope_qkv(qkv, cos, sin, h, kv, d), reference(qkv, cos, sin), "qkv"):
        compare(got, want, dtype, f"{what} of a prefill")
    block, positions = 16, [3, 17]
    starts = torch.tensor(positions, dtype=torch.int32, device=device)
    residual_k, residual_v = (torch.zeros(2, kv, block, d, dtype=dtype, device=device) for _ in range(2))
    step = random((2, 1, (h + 2 * kv) * d), dtype, device, 5)
    cos, sin = decoder.rope(starts, 1, dtype)[0]
    got = rope_qkv(step, cos, sin, h, kv, d, store=(residual_k, residual_v, starts))
    want = reference(step, cos, sin)
    for what, g, w in zip("qkv", got, want):
        compare(g, w, dtype, f"{what} of a decode step")
    for b, row in enumerate(p % block for p in positions):
        compare(residual_k[b, :, row], want[1][b, :, 0], dtype, "the key stored in the cache")
        compare(residual_v[b, :, row], want[2][b, :, 0], dtype, "the value stored in the cache")


# ------------------------------------------------------------------------------------ attention


def attention_config(decoder, dtype: torch.dtype, scheme, chosen: bool, own_cache: bool = True) -> Config:
    """Attention over a ``scheme`` cache: the quantize-on-write, dequantize-to-dense (chunked
    prefill) and decode kernels, for the decoder's head layout and windows. ``own_cache``: the
    model's own scheme, whose failure passes the Triton backend over in the model's choice
    (``Decoder.attention``); an Engine's other scheme only decides that Engine's backend. Not
    ``chosen``: the row says which backend runs decode steps and why the ones before it do not."""
    cfg = decoder.cfg
    device = next(decoder.parameters()).device
    windows = tuple(sorted(set(cfg.sliding_windows), key=lambda w: w or 0))  # None: a layer that sees everything
    slides = [w for w in windows if w is not None]
    shape = f"{scheme.name} cache, {cfg.num_heads} query / {cfg.num_kv_heads} KV heads x {cfg.head_dim}" + \
        (f", windows {slides}" if slides else "")
    key = ("attention", scheme, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, windows, dtype, device)
    why = None  # chosen: the Triton backend took this cache (runtime/attention_backends/)
    if not chosen:  # the backend the model runs instead, and why each before it was passed over
        from runtime.attention import model_attention

        where = "kernels run on CUDA only" if device.type != "cuda" else "not on the kernels"
        why = f"{where}; decode attention: {model_attention(decoder, scheme, dtype, device).explain()}"

    def fall_back(reason: str) -> None:
        if own_cache:  # the model's choice made again without the Triton backend
            from runtime.attention import pass_over

            pass_over(decoder, "triton", reason)

    return Config("attention (write, decode, prefill)", f"{shape}, {dtype_name(dtype)}",
                  "SDPA over the dequantized cache", key, why is None, why,
                  check=lambda: check_attention(cfg, scheme, dtype, device, windows), fall_back=fall_back)


