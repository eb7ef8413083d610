"""Speed of the W4 weight kernels against torch fp16 (cuBLAS) on Llama-3 linear shapes.

    python -m bench.kernels [--ms 1 4 16 64 256 1024 4096] [--shapes 4096x4096 ...]
                            [--bits 4] [--group 128] [--dtype float16] [--out PATH]

Needs a CUDA GPU (it refuses to run without one). For every shape ``KxN`` (inputs x outputs:
Llama-3-8B and -70B projections) and every row count M, it times

* ``lowbit``: ``runtime.kernels.quant_matmul`` on a random weight quantized with quant's own
  math (4-bit, group 128, asymmetric: scales and zero points included), autotuned first (every
  candidate's tuning time in ``tuner_ms``, fastest first: do_bench medians, weights L2-warm);
* ``lowbit-dense`` (row counts the tuner offers dense configurations for, ``DENSE_MIN_M`` and up):
  ``quant_matmul`` forced to the first dense configuration (the weight dequantized into scratch by
  ``runtime/kernels/dequantize_weight.py``, then cuBLAS), whichever the tuner picked; and
  ``dequantize`` (``M`` 0: once per shape), that dequantization alone;
* ``torch-fp16``: ``torch.nn.functional.linear`` with the dense fp16 weight (cuBLAS);
* ``torch-int4`` (4-bit only): PyTorch's own int4 kernel, ``aten._weight_int4pack_mm`` on the
  weight packed by ``aten._convert_weight_to_int4pack`` (tinygemm, the kernel gpt-fast and torchao
  use; bf16 activations, its only dtype on CUDA) with the same codes, scales and zero points,

in the same run, and reports the ratios of ours against both peers (``ratios``), median time, achieved TFLOP/s (2 M N K / t) and GB/s (weight,
scale, zero-point, activation and output bytes / t), with the device's measured copy bandwidth
and bf16 matmul rate (``evals.diagnose.measure_ceilings``) as ceilings.

Method: each timed sample runs the op once per weight copy, over enough copies that together
they are three times the L2 cache, so weights come from HBM as in a real model; the median of
the per-call times is reported. Cases with M <= 256 run as a CUDA graph (as the engine will run
decode steps; eager launches at these sizes would time the Python launch path), larger M as
plain launches. Results go to
``bench/results/gpu/kernels-<device>-<commit>.json`` with device, versions and commit.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.results_file import write_result
from bench.gpu import device_slug, l2_bytes, median_seconds_per_call, refuse_without_cuda

ROOT = Path(__file__).resolve().parent.parent


SHAPES = ["4096x4096", "4096x14336", "14336x4096", "8192x8192", "8192x28672"]  # in x out
SEVENTY_B = {"8192x8192", "8192x28672"}
ROWS = [1, 4, 16, 64, 256, 1024, 4096]
# Up to here each case runs as one CUDA graph: decode steps will (the engine captures them), and
# at these sizes a plain Triton launch costs more CPU time than the kernel takes on the GPU, so
# eager timing would measure Python, not the kernel. Larger M runs as plain launches.
GRAPH_MAX_M = 256
# --smoke: the interpreter on CPU, N not a multiple of our tiles (but of the int4 peer's 16)
SMOKE_SHAPES, SMOKE_ROWS = ["256x80"], [1, 16, 260]
TORCH_INT4_INNER_K_TILES = 8  # tinygemm's widest K tiling (what gpt-fast and torchao pack with)


def quantized_weight(K: int, N: int, bits: int, group: int, device):
    """A random [N, K] weight through quant's math, as a checkpoint stores it, then re-laid: our
    kernel's weight, the dense fp16 weight, and the checkpoint tensors (packed, scale, zero_packed)."""
    from quant.affine import QuantScheme, choose_qparams, quantize
    from quant.packing import pack
    from runtime.kernels import reference
    from runtime.kernels.weight_layout import make_kernel_weight

    scheme = QuantScheme(bits, group, symmetric=False)
    w = torch.randn(N, K, device=device) * 0.02
    scale, zero = choose_qparams(w, scheme, scale_dtype=torch.float16)
    packed, zero_packed = pack(quantize(w, scale, zero, scheme), bits, dim=1), pack(zero, bits, dim=0)
    kw = make_kernel_weight(packed, scale, zero_packed, (N, K), scheme)
    dense = reference.dequantize_weight(packed, scale, zero_packed, (N, K), scheme, torch.float16)
    return kw, dense, scheme, (packed, scale, zero_packed)


def torch_int4_unsupported(K: int, N: int, bits: int, group: int) -> str | None:
    """Why PyTorch's int4 kernel cannot run this layer (it is then not timed), or None."""
    from quant.affine import QuantScheme
    from runtime import cpu_linear

    if bits != 4:
        return f"{bits}-bit weights (the int4 kernel takes 4-bit codes)"
    if K % (TORCH_INT4_INNER_K_TILES * 16):
        return f"inputs not a multiple of {TORCH_INT4_INNER_K_TILES * 16} (the int4 kernel's K tiles)"
    return cpu_linear.unsupported_reason(QuantScheme(bits, group, symmetric=False), K, N)


@dataclass
class TorchInt4:
    """A layer through PyTorch's int4 kernel: on CUDA ``_weight_int4pack_mm`` over ``weight`` (from
    ``_convert_weight_to_int4pack``), on CPU (--smoke) ``runtime.cpu_linear``'s layer over the CPU
    variants of both ops."""

    weight: torch.Tensor | None
    scale_zeros: torch.Tensor | None
    group: int
    cpu_layer: object = None

    @classmethod
    def build(cls, packed, scale, zero_packed, K: int, N: int, scheme, device) -> "TorchInt4":
        """From a checkpoint's tensors. Its affine form ``(u - 8) * scale + zero`` per group holds
        ours as ``u = q + 8``, ``zero = -z * scale`` (``runtime.cpu_linear.Int4Slots``, whose bf16
        [K / group, N, 2] scales and zeros both devices take). On CUDA the codes go in as
        ``_convert_weight_to_int4pack`` wants them (:func:`cuda_nibbles`)."""
        from runtime import cpu_linear

        slots = cpu_linear.build(packed.cpu(), scale.cpu(), zero_packed.cpu(), (N, K), scheme)
        if torch.device(device).type == "cpu":
            return cls(None, None, slots.group, slots)
        return cls.on_device(cuda_nibbles(packed, K), slots.scale_zeros, slots.group, device)

    @classmethod
    def on_device(cls, nibbles: torch.Tensor, scale_zeros: torch.Tensor, group: int, device) -> "TorchInt4":
        weight = torch.ops.aten._convert_weight_to_int4pack(nibbles.to(device), TORCH_INT4_INNER_K_TILES)
        return cls(weight, scale_zeros.to(device), group)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_layer is not None:
            return self.cpu_layer(x, None)
        return torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16), self.weight, self.group, self.scale_zeros)

    def clone(self) -> "TorchInt4":
        if self.cpu_layer is not None:  # --smoke: copies only matter against a GPU's L2
            return self
        return TorchInt4(self.weight.clone(), self.scale_zeros.clone(), self.group)

    @property
    def nbytes(self) -> int:
        if self.cpu_layer is not None:
            return self.cpu_layer.nbytes
        return self.weight.nbytes + self.scale_zeros.nbytes


def cuda_nibbles(packed: torch.Tensor, K: int) -> torch.Tensor:
    """4-bit codes ``q`` of a checkpoint's ``weight_packed`` as ``_convert_weight_to_int4pack`` takes
    them: ``u = q + 8``, uint8 [N, K / 2], the even input in the high nibble (as torchao packs)."""
    from quant.packing import unpack

    u = unpack(packed.cpu(), 4, K, dim=1).to(torch.int32) + 8
    return ((u[:, ::2] << 4) | u[:, 1::2]).to(torch.uint8)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def copies_of_kernel_weight(kw, n: int):
    from dataclasses import replace

    def clone(t):
        return None if t is None else t.clone()

    return [kw] + [replace(kw, qweight=kw.qweight.clone(), scales=kw.scales.clone(), zeros=clone(kw.zeros))
                   for _ in range(n - 1)]


def kernel_weight_bytes(kw) -> int:
    return sum(t.numel() * t.element_size() for t in (kw.qweight, kw.scales, kw.zeros) if t is not None)


def bench_shape(shape: str, rows: list[int], bits: int, group: int, dtype, device, samples: int) -> list[dict]:
    from runtime.kernels import matmul_tuning
    from runtime.kernels import quant_matmul as qm

    K, N = (int(v) for v in shape.split("x"))
    kw, dense, scheme, checkpoint = quantized_weight(K, N, bits, group, device)
    dense = dense.to(dtype)
    peer_skipped = torch_int4_unsupported(K, N, bits, group)
    peer = None if peer_skipped else TorchInt4.build(*checkpoint, K, N, scheme, device)
    enough = 3 * l2_bytes(device) if device.type == "cuda" else 0  # --smoke: two copies
    q_copies = copies_of_kernel_weight(kw, max(2, math.ceil(enough / kernel_weight_bytes(kw))))
    w16_copies = [dense] + [dense.clone() for _ in range(max(2, math.ceil(enough / dense.nbytes)) - 1)]
    peer_copies = peer and [peer] + [peer.clone() for _ in range(max(2, math.ceil(enough / peer.nbytes)) - 1)]
    out = []
    for M in rows:
        x = torch.randn(M, K, device=device, dtype=dtype)
        # correctness first: the kernel against the dense dequantized weight
        err = rel_error(qm.quant_matmul(x, kw), F.linear(x, dense))
        if err > 1e-2:
            raise AssertionError(f"{shape} M={M}: kernel output differs from the dense reference (rel. error {err:.2e})")
        config = qm.choose_config(M, kw, dtype, x.device)  # tuned by the call above
        timed = matmul_tuning.TIMINGS.get((qm.m_bucket(M), matmul_tuning.weight_key(kw, dtype, x.device)), [])
        graph = M <= GRAPH_MAX_M
        t_q = median_seconds_per_call([lambda w=w: qm.quant_matmul(x, w) for w in q_copies], samples, device, graph)[0]
        t_16 = median_seconds_per_call([lambda w=w: F.linear(x, w) for w in w16_copies], samples, device, graph)[0]
        row = {"shape": shape, "in_features": K, "out_features": N, "M": M, "cuda_graph": graph}
        io_bytes = (M * K + M * N) * x.element_size()
        for impl, t, w_bytes, extra in (("lowbit", t_q, kernel_weight_bytes(kw),
                                         {"config": config.__dict__, "rel_error_vs_dense": err, "activations": str(dtype),
                                          "tuner_ms": [[round(ms, 5), c.__dict__] for ms, c in timed]}),
                                        ("torch-fp16", t_16, dense.nbytes, {"activations": str(dtype)})):
            out.append({**row, "impl": impl, **timing(t, M, N, K, w_bytes + io_bytes), "weight_bytes": w_bytes, **extra})
        ours = out[-2]
        peer = {**row, "impl": "torch-int4", **time_torch_int4(peer_copies, peer_skipped, x, dense, samples, device,
                                                                graph)}
        dense_rows = time_dense_path(q_copies, kw, x, dense, row, samples, device,
                                     dequantized_alone=not any(r["impl"] == "dequantize" for r in out))
        out += [peer, *dense_rows]
        t_i4 = peer.get("median_s")
        print(f"{shape:>11} M={M:<5} lowbit {t_q * 1e6:9.1f} us   fp16 {t_16 * 1e6:9.1f} us   "
              + (f"torch-int4 {t_i4 * 1e6:9.1f} us   " if t_i4 else f"torch-int4 {peer['status']}   ")
              + f"vs fp16 {t_16 / t_q:5.2f}x" + (f"  vs int4 {t_i4 / t_q:5.2f}x" if t_i4 else "")
              + f"   {ours['gb_per_s']:7.0f} GB/s  {ours['tflops']:6.1f} TFLOP/s"
              + "".join(f"   {r['impl']} {r['median_s'] * 1e6:9.1f} us" for r in dense_rows), flush=True)
    return out


def time_dense_path(q_copies, kw, x, dense, row: dict, samples: int, device, dequantized_alone: bool) -> list[dict]:
    """The dense configuration's rows for ``x``'s M where the tuner offers one (none otherwise):
    ``lowbit-dense`` (dequantize into scratch + cuBLAS), checked against the dense weight first, and,
    when ``dequantized_alone``, the dequantization alone (``M`` 0: it does not depend on the rows)."""
    from runtime.kernels import quant_matmul as qm
    from runtime.kernels.matmul_configs import candidate_configs

    config = next((c for c in candidate_configs(x.shape[0], kw) if c.dense), None)
    if config is None:
        return []
    M, K = x.shape
    N = kw.out_features
    err = rel_error(qm.quant_matmul(x, kw, config=config), F.linear(x, dense))
    if err > 1e-2:
        raise AssertionError(f"{row['shape']} M={M}: the dense path differs from the dense reference ({err:.2e})")
    # graph=False: a dense configuration is never captured (the scratch buffer; matmul_configs.DENSE_MIN_M)
    t = median_seconds_per_call([lambda w=w: qm.quant_matmul(x, w, config=config) for w in q_copies], samples,
                                device, graph=False)[0]
    w_bytes = kernel_weight_bytes(kw)
    rows = [{**row, "impl": "lowbit-dense", **timing(t, M, N, K, w_bytes + (M * K + M * N) * x.element_size()),
             "weight_bytes": w_bytes, "config": config.__dict__, "rel_error_vs_dense": err, "activations": str(x.dtype)}]
    if dequantized_alone:
        target = torch.empty(N, K, dtype=x.dtype, device=x.device)  # (the scratch buffer's lookup is host work)
        t = median_seconds_per_call([lambda w=w: qm.dense_weight(w, target, config) for w in q_copies],
                                    samples, device, graph=False)[0]
        moved = w_bytes + N * K * x.element_size()  # packed weight, scales, zero points read; dense weight written
        rows.append({**row, "M": 0, "cuda_graph": False, "impl": "dequantize", "median_s": t, "gb_per_s": moved / t / 1e9,
                     "bytes_moved": moved, "config": config.__dict__})
    return rows


def timing(t: float, M: int, N: int, K: int, nbytes: int) -> dict:
    return {"median_s": t, "tflops": 2 * M * N * K / t / 1e12, "gb_per_s": nbytes / t / 1e9}


def time_torch_int4(copies, skipped: str | None, x, dense, samples: int, device, graph: bool) -> dict:
    """PyTorch's int4 kernel on ``x`` (in bf16), checked against the dense weight first. A layer it
    cannot take, an error, or a wrong result is recorded (``status``) and ours is still measured."""
    if skipped:
        return {"status": "unsupported", "reason": skipped}
    M, K = x.shape
    N = dense.shape[0]
    xb = x.to(torch.bfloat16)
    try:
        err = rel_error(copies[0](xb), F.linear(xb, dense.to(torch.bfloat16)))
        if not err <= 2e-2:  # bf16 activations and output: a looser bound than ours in fp16
            return {"status": "wrong", "rel_error_vs_dense": err}
        t = median_seconds_per_call([lambda w=w: w(xb) for w in copies], samples, device, graph)[0]
    except Exception as e:  # noqa: BLE001 - the peer failing must not lose our own measurement
        return {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
    w_bytes = copies[0].nbytes
    return {"status": "ok", **timing(t, M, N, K, w_bytes + (M * K + M * N) * 2), "weight_bytes": w_bytes,
            "rel_error_vs_dense": err, "activations": "torch.bfloat16", "inner_k_tiles": TORCH_INT4_INNER_K_TILES}


def ratios(results: list[dict]) -> list[dict]:
    """Per shape and M: our speed-up over cuBLAS fp16 and over PyTorch's int4 kernel (None where
    the peer did not run); where the dense path ran, its speed-up over cuBLAS fp16 and over the
    tuned kernel (above 1: faster than it)."""
    by = {(r["shape"], r["M"], r["impl"]): r for r in results}
    out = []
    for (shape, M, impl), r in by.items():
        if impl != "lowbit":
            continue
        peers = {name: by.get((shape, M, name), {}).get("median_s") for name in ("torch-fp16", "torch-int4")}
        ratio = {"shape": shape, "M": M,
                 **{f"vs_{name.replace('-', '_')}": t and t / r["median_s"] for name, t in peers.items()}}
        dense = by.get((shape, M, "lowbit-dense"))
        if dense:  # the dense path (dequantize into scratch + cuBLAS) over fp16 cuBLAS, and over the fused kernel
            ratio["dense_vs_torch_fp16"] = peers["torch-fp16"] and peers["torch-fp16"] / dense["median_s"]
            ratio["dense_vs_fused"] = r["median_s"] / dense["median_s"]
        out.append(ratio)
    return out


# issue 15's H100 targets: speed-up over fp16 cuBLAS at M=1 (8B / 70B shapes), M=16 on the 70B
# shapes, large M everywhere, and the fraction of copy bandwidth at M=1 on the 70B shapes
TARGETS = {"m1_8b": 2.8, "m1_70b": 3.3, "m1_70b_bandwidth": 0.85, "m16_70b": 3.0, "large_m": 0.95}


def targets(results: list[dict], ceilings: dict) -> list[dict]:
    """The issue's targets, evaluated on these measurements (a missing case is reported as such)."""
    by = {(r["shape"], r["M"], r["impl"]): r for r in results}
    checks = []

    def speedup(shape, M):
        q, t = by.get((shape, M, "lowbit")), by.get((shape, M, "torch-fp16"))
        return None if q is None or t is None else t["median_s"] / q["median_s"]

    for shape in sorted({r["shape"] for r in results}):
        big = shape in SEVENTY_B
        goal = TARGETS["m1_70b" if big else "m1_8b"]
        checks.append({"target": f"M=1 >= {goal}x fp16", "shape": shape, "measured": speedup(shape, 1), "goal": goal})
        if big:
            q = by.get((shape, 1, "lowbit"))
            frac = None if q is None else q["gb_per_s"] * 1e9 / ceilings["copy_bytes_per_s"]
            checks.append({"target": f"M=1 >= {TARGETS['m1_70b_bandwidth']:.0%} of copy bandwidth", "shape": shape,
                           "measured": frac, "goal": TARGETS["m1_70b_bandwidth"]})
            checks.append({"target": f"M=16 >= {TARGETS['m16_70b']}x fp16", "shape": shape,
                           "measured": speedup(shape, 16), "goal": TARGETS["m16_70b"]})
        for M in sorted({r["M"] for r in results if r["M"] >= 1024}):
            checks.append({"target": f"M={M} >= {TARGETS['large_m']}x fp16 cuBLAS", "shape": shape,
                           "measured": speedup(shape, M), "goal": TARGETS["large_m"]})
    for c in checks:
        c["met"] = None if c["measured"] is None else c["measured"] >= c["goal"]
    return checks


def with_triton(block: dict, code_version: str) -> dict:
    """The provenance block with the Triton version beside torch's (a speed figure is read with both)."""
    import triton

    return {**block, "commit": code_version, "versions": {**block["versions"], "triton": triton.__version__}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=SHAPES, help="KxN (inputs x outputs)")
    ap.add_argument("--ms", nargs="*", type=int, default=ROWS, help="rows M (tokens) per call")
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8])
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--samples", type=int, default=30, help="timed samples per case (median reported)")
    ap.add_argument("--out", type=Path, help="default: bench/results/gpu/kernels-<device>-<commit>.json")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU + Triton interpreter, one tiny shape: checks this script; writes only to --out")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
        args.shapes, args.ms, args.samples = SMOKE_SHAPES, SMOKE_ROWS, 2
    else:
        refuse_without_cuda("bench/kernels.py")

    from evals.diagnose import measure_ceilings
    from evals.provenance import commit, provenance

    code_version = commit()  # before the run, so a later commit cannot mislabel it
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = getattr(torch, args.dtype)
    started = time.time()
    ceilings = measure_ceilings(device, torch.float32 if args.smoke else torch.bfloat16)
    print(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e9:.0f} GB/s, bf16 matmul "
          f"{ceilings['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    torch.manual_seed(0)
    results = []
    with torch.inference_mode():
        for shape in args.shapes:
            results += bench_shape(shape, args.ms, args.bits, args.group, dtype, device, args.samples)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    name = "cpu-smoke" if args.smoke else torch.cuda.get_device_name(device)
    record = {
        "benchmark": "bench/kernels.py",
        "provenance": with_triton(provenance(device), code_version),
        "scheme": f"w{args.bits} g{args.group} asymmetric (scales {args.dtype}, int8 zero points)",
        "activations": args.dtype,
        "peers": ("torch-fp16: F.linear on the dense weight (cuBLAS); lowbit-dense: quant_matmul's first dense "
                  "configuration (dequantize into scratch + cuBLAS), dequantize: that dequantization alone (M 0); "
                  "torch-int4: aten._weight_int4pack_mm "
                  f"(tinygemm, inner K tiles {TORCH_INT4_INNER_K_TILES}, bf16 activations) on the same codes, "
                  "scales and zero points; ratios = peer time / our time"),
        "method": ("median of per-call times; each sample calls once per weight copy, copies together 3x L2; "
                   f"CUDA graphs for M <= {GRAPH_MAX_M}; GB/s counts weight + scales + zeros + activations + "
                   "output bytes; TFLOP/s = 2 M N K / t"),
        "ceilings": ceilings,
        "results": results,
        "ratios": ratios(results),
        "targets": targets(results, ceilings),
        "wall_s": time.time() - started,
        "smoke": args.smoke,
    }
    if args.smoke and args.out is None:
        print("smoke run: nothing written (its timings mean nothing)")
        return record
    out = args.out or ROOT / "bench" / "results" / "gpu" / f"kernels-{device_slug(name)}-{code_version}.json"
    write_result(out, record)
    for t in record["targets"]:
        m = t["measured"]
        print(f"  {t['target']:<32} {t['shape']:>11}: {'n/a' if m is None else f'{m:.2f}'} "
              f"({'met' if t['met'] else 'not met' if t['met'] is False else 'not measured'})")


if __name__ == "__main__":
    main()
