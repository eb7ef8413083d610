"""Which phase is slow and why: measured speed against this device's measured ceilings.

* Ceilings: a large tensor copy (bytes read + written per second) and a square
  matmul in the model's dtype (FLOP/s), both measured here, best of a few runs.
* Decode is memory-bound when it works well: each step reads every weight the
  forward uses and every cached key/value. Achieved bandwidth = those bytes / ITL.
* Prefill is compute-bound: achieved FLOP/s = the forward's useful FLOPs / TTFT
  (matmuls of every Linear including the head over every prompt position, and
  causal attention's lower triangle).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from evals.speed import PROTOCOL, PhaseTiming, Workload, measure
from kvquant import KVScheme, bytes_per_token, parse_kv
from kvquant import schemes as kv_families
from kvquant.memory import stored_bytes
from runtime.linear import QuantLinear
from runtime.units import sync

COPY_BYTES = {"cpu": 256 * 2**20, "cuda": 1024 * 2**20}
MATMUL_N = {"cpu": 1024, "cuda": 8192}
BANDWIDTH_BOUND = 0.5  # a phase at half its ceiling or more is limited by it, below that by overheads


def _best_time(fn, device: torch.device, repeats: int = 5) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_ceilings(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """Copy bandwidth (bytes/s, read + write) and matmul rate (FLOP/s in ``dtype``) of ``device``."""
    device = torch.device(device)
    n_bytes = COPY_BYTES.get(device.type, COPY_BYTES["cpu"])
    src = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_s = _best_time(lambda: dst.copy_(src), device)
    del src, dst
    n = MATMUL_N.get(device.type, MATMUL_N["cpu"])
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    mm_s = _best_time(lambda: a @ b, device)
    return {
        "copy_bytes_per_s": 2 * n_bytes / copy_s,
        "matmul_flops_per_s": 2 * n**3 / mm_s,
        "method": f"copy of {n_bytes // 2**20} MiB (read + write counted); {n}x{n} @ {n}x{n} matmul in "
                  f"{str(dtype).replace('torch.', '')}; best of 5 after a warm-up",
    }


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def weight_bytes_per_step(model, batch: int) -> tuple[int, str]:
    """Bytes of weights one decode step reads, as this runtime holds them, and how they are held.

    A quantized Linear on the reference path multiplies with a weight dequantized at load, so it
    reads that dense copy; on the kernel path it reads the packed weight, scales and zero points.
    An embedding reads one row per token.
    """
    total, dense_copies = 0, 0
    for module in model.decoder.modules():
        if isinstance(module, QuantLinear):
            dense = getattr(module, "_dense", None)
            if dense is not None:
                total += _tensor_bytes([dense])
                dense_copies += 1
            else:
                total += _tensor_bytes(module.buffers(recurse=False))
            total += _tensor_bytes([module.bias])
        elif isinstance(module, nn.Embedding):
            total += batch * module.embedding_dim * module.weight.element_size()
        else:
            total += _tensor_bytes(module.parameters(recurse=False))
    held = ("quantized Linears dequantized at load (this runtime's reference path): decode reads dense "
            f"{str(model.dtype).replace('torch.', '')} weights" if dense_copies else "weights as stored")
    return total, held


def kv_bytes_per_step(model, scheme: KVScheme, batch: int, prompt_len: int, output_len: int) -> float:
    """Mean bytes of cached keys and values one decode step reads over the request."""
    cfg = model.decoder.cfg
    steps = range(prompt_len, prompt_len + output_len - 1)
    if not steps:
        return 0.0
    per_step = [stored_bytes(scheme, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, c, model.dtype) for c in steps]
    return batch * sum(per_step) / len(per_step)


def prefill_flops(model, batch: int, prompt_len: int) -> dict:
    """Useful FLOPs of one prefill forward: Linear matmuls (head included) and causal attention."""
    cfg = model.decoder.cfg
    linear_weights = sum(m.in_features * m.out_features for m in model.decoder.modules()
                         if isinstance(m, (nn.Linear, QuantLinear)))
    head = cfg.hidden_size * cfg.vocab_size
    tokens = batch * prompt_len
    # QK^T and PV over the causal lower triangle: T(T+1)/2 query-key pairs per head
    attention = batch * cfg.num_layers * 2 * 2 * cfg.num_heads * cfg.head_dim * prompt_len * (prompt_len + 1) // 2
    return {"linear": 2 * tokens * linear_weights, "lm_head": 2 * tokens * head, "attention": attention,
            "total": 2 * tokens * linear_weights + attention}


def diagnose(model, workload: Workload, scheme: KVScheme | None = None, ceilings: dict | None = None,
             repeats: int = 1) -> dict:
    """Measure both phases of ``workload``, compare them with the ceilings, name the dominant phase and the lever."""
    scheme = scheme or model.kv_scheme
    ceilings = ceilings or measure_ceilings(model.device, model.dtype)
    timing: PhaseTiming = measure(model, workload, scheme, repeats)
    w_bytes, held = weight_bytes_per_step(model, workload.batch)
    kv_bytes = kv_bytes_per_step(model, scheme, workload.batch, workload.prompt_len, workload.output_len)
    flops = prefill_flops(model, workload.batch, workload.prompt_len)
    decode_s = timing.itl_s * (workload.output_len - 1)
    result = {
        "protocol": f"{PROTOCOL}; ceilings: {ceilings['method']}",
        "workload": {"prompt_len": workload.prompt_len, "output_len": workload.output_len, "batch": workload.batch,
                     "kv": scheme.name},
        "timing": timing.to_dict(),
        "ceilings": ceilings,
        "prefill": {"seconds": timing.ttft_s, "flops": flops,
                    "achieved_flops_per_s": flops["total"] / timing.ttft_s,
                    "fraction_of_matmul_ceiling": flops["total"] / timing.ttft_s / ceilings["matmul_flops_per_s"]},
        "decode": {"seconds": decode_s, "weight_bytes_per_step": w_bytes, "weights_held_as": held,
                   "kv_bytes_per_step": kv_bytes,
                   "achieved_bytes_per_s": (w_bytes + kv_bytes) / timing.itl_s if timing.itl_s else None,
                   "fraction_of_copy_ceiling": ((w_bytes + kv_bytes) / timing.itl_s / ceilings["copy_bytes_per_s"])
                   if timing.itl_s else None},
    }
    result["dominant_phase"] = "decode" if decode_s > timing.ttft_s else "prefill"
    result["advice"] = advice(result, model)
    return result


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _kv_ratios(model) -> str:
    cfg = model.decoder.cfg
    base = bytes_per_token(KVScheme(), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    parts = []
    for name in kv_families.listed_names(quantized=True):  # every family's
        s = parse_kv(name)
        try:
            s.check_head_dim(cfg.head_dim)
        except ValueError:
            continue  # its groups do not fit these heads
        parts.append(f"{name} {bytes_per_token(s, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) / base:.2f}x")
    return ", ".join(parts)


def advice(r: dict, model) -> list[str]:
    """Plain sentences: which phase dominates this workload and which lever helps it."""
    pre, dec, w = r["prefill"], r["decode"], r["workload"]
    total = pre["seconds"] + dec["seconds"]
    lines = [f"For {w['batch']} x ({w['prompt_len']} prompt + {w['output_len']} output) tokens, "
             f"{r['dominant_phase']} takes {_pct(max(pre['seconds'], dec['seconds']) / total)} of the request time "
             f"(prefill {pre['seconds'] * 1e3:.0f} ms, decode {dec['seconds'] * 1e3:.0f} ms)."]
    if r["dominant_phase"] == "decode":
        lines += _decode_advice(dec, w, model)
    else:
        lines += _prefill_advice(pre, w)
    return lines


def _decode_advice(dec: dict, w: dict, model) -> list[str]:
    frac = dec["fraction_of_copy_ceiling"] or 0.0
    wb, kb = dec["weight_bytes_per_step"], dec["kv_bytes_per_step"]
    dense = " (dequantized at load: this runtime's reference path)" if "dequantized at load" in dec["weights_held_as"] else ""
    lines = [f"Each decode step reads {wb / 1e6:.1f} MB of weights{dense} and {kb / 1e6:.1f} MB of KV cache: "
             f"{(dec['achieved_bytes_per_s'] or 0) / 1e9:.1f} GB/s, {_pct(frac)} of the measured copy bandwidth."]
    if frac < BANDWIDTH_BOUND:
        lines.append("Decode is below the bandwidth ceiling: per-step overhead (framework, kernel launches), not "
                     "bytes, limits it. Fewer bits help less here than a fused step (CUDA graphs) or a larger batch, "
                     "which does more work per step for the same overhead.")
        return lines
    if wb >= kb:
        lever = "Weights are most of those bytes: fewer weight bits is the lever (4-bit weights are ~1/4 of 16-bit)"
        if "dequantized at load" in dec["weights_held_as"]:
            lever += (", but this runtime's reference path multiplies with weights dequantized at load, so weight "
                      "bits do not change what decode reads on this device; the GPU kernels read packed weights")
        lines.append(lever + ". A larger batch shares each weight read among more sequences: decode tokens/s grows "
                             "almost linearly with batch until the KV cache dominates.")
    else:
        lines.append(f"The KV cache is most of those bytes: fewer KV bits is the lever (bytes per token vs fp16: "
                     f"{_kv_ratios(model)}); a larger batch does not help, as each sequence brings its own cache.")
    return lines


def _prefill_advice(pre: dict, w: dict) -> list[str]:
    frac = pre["fraction_of_matmul_ceiling"]
    flops = pre["flops"]
    lines = [f"Prefill does {flops['total'] / 1e9:.1f} GFLOP at {pre['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s, "
             f"{_pct(frac)} of the measured matmul rate."]
    if frac >= BANDWIDTH_BOUND:
        lines.append("Prefill is compute-bound: a shorter prompt (or reusing a cached shared prefix) is the lever; "
                     "fewer weight bits do not remove FLOPs, and a larger batch only adds them.")
    else:
        lines.append("Prefill runs below the matmul ceiling: overheads (attention, dequantization, the head over "
                     f"every prompt position: {flops['lm_head'] / 1e9:.1f} GFLOP) limit it; a shorter prompt still "
                     "cuts its time in proportion, and batching short prompts fills the matrix units better.")
    return lines


def diagnose_text(r: dict, device: str) -> str:
    c, t = r["ceilings"], r["timing"]
    lines = [
        f"device: {device}",
        f"ceilings: copy {c['copy_bytes_per_s'] / 1e9:.1f} GB/s, matmul {c['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s "
        f"({c['method']})",
        f"TTFT {t['ttft_s'] * 1e3:.1f} ms ({t['prefill_tokens_per_s']:,.0f} prompt tokens/s); "
        f"ITL {t['itl_s'] * 1e3:.1f} ms ({t['decode_tokens_per_s']:,.1f} tokens/s); KV cache {t['kv']}",
        "",
    ]
    return "\n".join(lines + r["advice"])
