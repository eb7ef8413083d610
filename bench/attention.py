"""Decode attention over the quantized KV cache: the fused Triton kernel against fp16 SDPA and
against dequantize-then-SDPA (transformers' quantized-cache path).

    python -m bench.attention [--batches 1 8 32] [--contexts 1024 2048 4096 8192 16384 32768]
                              [--schemes fp16 int8 int4] [--samples 30] [--out PATH]
    python -m bench.attention --smoke     # CPU, Triton interpreter, tiny shapes: checks this script only

Needs a CUDA GPU (it refuses to run without one, except ``--smoke``, whose times mean nothing and
which never writes under bench/results). Shapes: 32 query heads sharing 8 KV heads, head_dim 128,
float16, one new query token per sequence, every sequence ``context`` positions long. For each
batch and context it times, in the same run and on the same keys and values:

* ``sdpa-fp16``: ``scaled_dot_product_attention(q, k, v, enable_gqa=True)`` over a dense fp16
  cache ``[S, 8, context, 128]`` (the baseline);
* ``fused-<scheme>``: ``runtime.kernels.attention.decode_attention`` over the paged cache
  (blocks scattered through the pool by a random block table, built by the quantize-on-write
  kernel); ``fused-fp16`` is the same kernel over an unquantized paged cache. ``fused-<scheme>``
  is the default launch configuration (what the runtime runs); ``fused-<scheme>@t<tile>w<warps>s<stages>``
  rows time the other configurations in ``SWEEP`` (``--no-sweep`` skips them);
* ``dequant-sdpa-<scheme>``: what transformers' ``QuantizedCache`` does at every step: the
  quantized blocks are dequantized into a fresh fp16 copy with PyTorch ops (``kvquant``), then
  SDPA; ``dequant-triton-sdpa-<scheme>`` makes that copy with our Triton dequantize kernel
  instead (the best that approach can do).

Method (as bench/kernels.py): each timed sample runs the op once per cache copy, over enough
copies (layers) that together they are three times the L2 cache, so the cache streams from
memory as in a model; the sample runs as one CUDA graph (decode steps will, and eager launches
would time Python); the median per-call time over ``--samples`` samples is reported. GB/s counts
the bytes each path must read (cache data, scales and zero points, residual, query) and write
(output; the dequantize paths also write and read their fp16 copy), against the device's copy
bandwidth (``evals.diagnose.measure_ceilings``) measured in the same run. Each fused result is
checked against SDPA over the same dequantized cache before it is timed.

Results: ``bench/results/gpu/attention-<device>-<commit>.json``, with device, versions, commit, the
raw numbers, and issue 15's targets evaluated on them (``TARGETS``, ``TARGET_BW_FRACTION``).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.results_file import write_result
from bench.gpu import device_slug, l2_bytes, median_seconds_per_call, refuse_without_cuda

ROOT = Path(__file__).resolve().parent.parent


Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
BATCHES = [1, 8, 32]
CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768]
SCHEMES = ["fp16", "int8", "int4"]  # kvquant names: int4 = int4-g64-r128 (KIVI keys), int8 per token
# issue 15's H100 targets at the longest context (32k): speed-up over sdpa-fp16 by scheme and batch
# (None: any batch), and the fraction of copy bandwidth the quantized kernels reach at batch 32
TARGETS = {("int4", 32): 3.0, ("int4", 1): 2.5, ("int8", None): 1.8}
TARGET_BW_FRACTION = 0.8
# launch configurations (tokens per tile, warps, pipeline stages) timed beside the default one
SWEEP = [(16, 4, 3), (32, 4, 3), (32, 8, 2), (64, 4, 2), (64, 8, 3)]
SMOKE = dict(batches=[1, 2], contexts=[64, 160], q_heads=8, kv_heads=2, head_dim=64, block="-g16-r32")


def copies_for(nbytes: int, device: torch.device, cap: int = 128) -> int:
    """Cache copies (layers) to cycle through so that together they exceed the L2 cache 3 times."""
    if device.type != "cuda":
        return 1  # --smoke
    return max(1, min(cap, math.ceil(3 * l2_bytes(device) / max(nbytes, 1))))


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# ------------------------------------------------------------------------------------- caches


def build_paged(scheme, k, v, seed: int):
    """The paged cache of ``k, v`` [S, H, L, D]: random block table, filled by the write kernel."""
    from runtime.kernels import attention as kernels
    from runtime.kernels.kv_reference import PagedKV
    from runtime.cache import KVCache

    S, H, L, D = k.shape
    cache = KVCache(1, S, H, D, L, k.dtype, k.device, scheme=scheme)
    gen = torch.Generator().manual_seed(seed)
    cache.block_table.copy_(torch.randperm(cache.block_table.numel(), generator=gen).view_as(cache.block_table))
    paged = PagedKV.from_cache(cache, 0)
    kernels.write_kv(paged, torch.zeros(S, dtype=torch.int32, device=k.device), k, v)
    return paged


def paged_bytes(paged, length: int) -> int:
    """Bytes one decode step reads from a paged cache: the sequences' full blocks and residual rows."""
    from kvquant.quantize import block_bytes

    S, H, B, D = paged.residual_k.shape
    full, rest = divmod(length, B)
    return S * H * (full * block_bytes(paged.scheme, D, paged.dtype) + 2 * rest * D * paged.residual_k.element_size())


def torch_dequantize(paged, length: int):
    """transformers' quantized-cache step: every block dequantized into a fresh fp16 copy with
    PyTorch ops (kvquant's one implementation), then the residual appended."""
    from kvquant import dequantize_blocks

    B = paged.block_size
    full = length // B
    ids = paged.block_table[:, :full].long()  # [S, n]
    out = []
    for keys in (True, False):
        blocks = paged.pool(keys).map(lambda t: t[ids])  # [S, n, H, ...]
        x = dequantize_blocks(blocks, paged.scheme, keys, paged.head_dim, paged.dtype)  # [S, H, n*B, D]
        out.append(torch.cat([x, paged.residual(keys)[:, :, : length - full * B]], dim=2))
    return out


# --------------------------------------------------------------------------------------- cases


def bench_case(batch: int, context: int, schemes: list, shape: dict, samples: int, device,
               sweep: list = ()) -> list[dict]:
    from kvquant import parse_kv
    from runtime.kernels import attention as kernels

    hq, hkv, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    gen = torch.Generator(device=device).manual_seed(batch * 100003 + context)
    k = torch.randn(batch, hkv, context, d, device=device, generator=gen).half()
    k[..., :: d // 8] += 4.0  # a few key channels with a persistent offset, as in LLMs
    v = torch.randn(batch, hkv, context, d, device=device, generator=gen).half()
    q = torch.randn(batch, hq, d, device=device, generator=gen).half()
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    io_bytes = 2 * nbytes(q)  # query in, output out
    rows = []

    def record(path, scheme, seconds, graphed, read_write_bytes, **extra):
        rows.append({"batch": batch, "context": context, "path": path, "scheme": scheme, "us": seconds * 1e6,
                     "bytes": read_write_bytes, "gb_per_s": read_write_bytes / seconds / 1e9, "cuda_graph": graphed,
                     **extra})

    dense_bytes = nbytes(k, v)
    n = copies_for(dense_bytes, device)
    dense = [(k, v)] + [(k.clone(), v.clone()) for _ in range(n - 1)]
    q4 = q[:, :, None]
    t, graphed = median_seconds_per_call(
        [lambda kv=kv: F.scaled_dot_product_attention(q4, kv[0], kv[1], enable_gqa=True) for kv in dense],
        samples, device)
    record("sdpa-fp16", "fp16", t, graphed, dense_bytes + io_bytes, copies=n)
    del dense

    for name in schemes:
        scheme = parse_kv(name + shape.get("block", ""))
        paged = build_paged(scheme, k, v, seed=context)
        cache_bytes = paged_bytes(paged, context)
        n = copies_for(cache_bytes, device)
        copies = [paged] + [build_paged(scheme, k, v, seed=context + i) for i in range(1, n)]

        # correctness first: the kernel against SDPA over the same cache, dequantized
        dk, dv = kernels.dequantize_cache(paged, lens, context)
        want = F.scaled_dot_product_attention(q4, dk, dv, enable_gqa=True)[:, :, 0]
        got = kernels.decode_attention(q, paged, lens, max_seq_len=context)
        err = float((got.float() - want.float()).abs().max())
        del dk, dv

        t, graphed = median_seconds_per_call(
            [lambda p=p: kernels.decode_attention(q, p, lens, max_seq_len=context) for p in copies], samples, device)
        record(f"fused-{name}", scheme.name, t, graphed, cache_bytes + io_bytes, copies=n, max_abs_err=err,
               config="default")
        for tile, warps, stages in sweep:
            t, graphed = median_seconds_per_call(
                [lambda p=p: kernels.decode_attention(q, p, lens, max_seq_len=context, tile=tile, num_warps=warps,
                                                      num_stages=stages) for p in copies], samples, device)
            record(f"fused-{name}@t{tile}w{warps}s{stages}", scheme.name, t, graphed, cache_bytes + io_bytes,
                   copies=n, config={"tile": tile, "num_warps": warps, "num_stages": stages})
        if name != "fp16":
            fresh_copy = 2 * dense_bytes  # the fp16 copy is written, then SDPA reads it
            t, graphed = median_seconds_per_call(
                [lambda p=p: F.scaled_dot_product_attention(q4, *kernels.dequantize_cache(p, lens, context),
                                                            enable_gqa=True) for p in copies], samples, device)
            record(f"dequant-triton-sdpa-{name}", scheme.name, t, graphed, cache_bytes + fresh_copy + io_bytes,
                   copies=n)
            try:
                t, graphed = median_seconds_per_call(
                    [lambda p=p: F.scaled_dot_product_attention(q4, *torch_dequantize(p, context), enable_gqa=True)
                     for p in copies[:1]], max(3, samples // 5), device)
                record(f"dequant-sdpa-{name}", scheme.name, t, graphed, cache_bytes + fresh_copy + io_bytes, copies=1,
                       note="one cache copy: PyTorch's dequantize temporaries dwarf the L2")
            except torch.cuda.OutOfMemoryError:
                rows.append({"batch": batch, "context": context, "path": f"dequant-sdpa-{name}", "scheme": scheme.name,
                             "error": "out of memory"})
        del copies, paged
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = next(r["us"] for r in rows if r["path"] == "sdpa-fp16")
    for r in rows:
        if "us" in r:
            r["speedup_vs_sdpa_fp16"] = base / r["us"]
    return rows


def evaluate_targets(rows: list[dict], copy_bw: float) -> list[dict]:
    out = []
    longest = max(r["context"] for r in rows)
    for (name, batch), want in TARGETS.items():
        for r in rows:
            if r["path"] == f"fused-{name}" and r["context"] == longest and batch in (None, r["batch"]):
                out.append({"target": f"{name} >= {want}x sdpa-fp16 at context {longest}, batch {r['batch']}",
                            "measured": round(r["speedup_vs_sdpa_fp16"], 3), "met": r["speedup_vs_sdpa_fp16"] >= want})
    for r in rows:
        if r["path"] in ("fused-int4", "fused-int8") and r["batch"] == 32 and r["context"] == longest:
            frac = r["gb_per_s"] * 1e9 / copy_bw
            out.append({"target": f"{r['path']} >= {TARGET_BW_FRACTION:.0%} of copy bandwidth at batch 32, "
                                  f"context {longest}", "measured": round(frac, 3), "met": frac >= TARGET_BW_FRACTION})
    return out


def table(rows: list[dict], copy_bw: float) -> str:
    lines = ["| batch | context | path | µs | GB/s | % copy bw | vs sdpa-fp16 | max abs err |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "us" not in r:
            lines.append(f"| {r['batch']} | {r['context']} | {r['path']} | {r['error']} | | | | |")
            continue
        err = f"{r['max_abs_err']:.1e}" if "max_abs_err" in r else ""
        lines.append(f"| {r['batch']} | {r['context']} | {r['path']} | {r['us']:.1f} | {r['gb_per_s']:.0f} | "
                     f"{100 * r['gb_per_s'] * 1e9 / copy_bw:.0f}% | {r['speedup_vs_sdpa_fp16']:.2f}x | {err} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", nargs="*", type=int, default=BATCHES)
    ap.add_argument("--contexts", nargs="*", type=int, default=CONTEXTS)
    ap.add_argument("--schemes", nargs="*", default=SCHEMES, choices=["fp16", "int8", "int4", "int2", "fp8"])
    ap.add_argument("--samples", type=int, default=30, help="timed samples per case (median reported)")
    ap.add_argument("--out", type=Path, help="default: bench/results/gpu/attention-<device>-<commit>.json")
    ap.add_argument("--no-sweep", action="store_true", help="time only the default launch configuration")
    ap.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes: tests this script")
    args = ap.parse_args(argv)

    shape = {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM}
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
        device = torch.device("cpu")
        shape.update(q_heads=SMOKE["q_heads"], kv_heads=SMOKE["kv_heads"], head_dim=SMOKE["head_dim"],
                     block=SMOKE["block"])
        args.batches, args.contexts, args.samples = SMOKE["batches"], SMOKE["contexts"], 1
        args.out = args.out or Path(tempfile.mkdtemp()) / "attention-smoke.json"
        device_name, copy_bw = "cpu (Triton interpreter: times mean nothing)", 1e9
    else:
        refuse_without_cuda("bench/attention.py",
                            " (--smoke checks the script itself on CPU, with meaningless times.)")
        from evals.diagnose import measure_ceilings

        device = torch.device("cuda")
        device_name = torch.cuda.get_device_name(device)
        copy_bw = measure_ceilings(device, torch.float16)["copy_bytes_per_s"]
    from evals.provenance import commit

    code_version = commit()  # read before the run, so later commits cannot mislabel it
    import triton

    rows = []
    for batch in args.batches:
        for context in args.contexts:
            rows += bench_case(batch, context, args.schemes, shape, args.samples, device,
                               sweep=[] if args.no_sweep or args.smoke else SWEEP)
            print(f"batch {batch} context {context}: done", file=sys.stderr, flush=True)
    result = {
        "device": device_name, "commit": code_version, "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "shape": {**shape, "dtype": "float16", "new_tokens_per_sequence": 1},
        "copy_bytes_per_s": copy_bw, "l2_bytes": l2_bytes(device),
        "method": "median over samples of one CUDA graph running the op once per cache copy (copies exceed 3x "
                  "L2); GB/s = bytes the path must read and write / time; copy bandwidth from "
                  "evals.diagnose.measure_ceilings in the same run",
        "rows": rows, "targets": [] if args.smoke else evaluate_targets(rows, copy_bw),
    }
    out = args.out or ROOT / "bench" / "results" / "gpu" / f"attention-{device_slug(device_name)}-{code_version}.json"
    write_result(out, result)
    if args.smoke:
        print("SMOKE RUN: the Triton interpreter on CPU; these times say nothing about speed")
    print(table(rows, copy_bw))
    for t in result["targets"]:
        print(f"{'met' if t['met'] else 'NOT met'}: {t['target']} (measured {t['measured']})")


if __name__ == "__main__":
    main()
