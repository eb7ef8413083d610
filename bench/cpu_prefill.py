"""Whether W4 prefill on CPU keeps up with float32: the int4 weight-only kernel against a dequantized
bf16 scratch weight and a dense bf16 matmul (``Int4Slots``' path from ``DEQUANTIZE_ROWS`` rows).

    flock /tmp/lowbit-bench.lock python -m bench.cpu_prefill [--shapes smollm2-135m,llama-1b]

Per Linear (the decoder's shapes, W4 g64, random codes): process CPU ms at 1 thread of the kernel,
of the scratch path (dequantize + F.linear) and of a float32 F.linear, at M rows, medians of
``--repeats``. End to end: a prefill of ``--tokens`` at batch 1 (a forward filling a fresh cache,
``bench.cpu_decode.prefill_seconds`` under process CPU time), W4 with the scratch path on
(``DEQUANTIZE_ROWS`` as shipped) and off (the kernel at every M), and the float32 model, alternating
round by round; models as ``bench.cpu_decode.random_model`` builds them. Raw JSON with device,
versions, commit and load averages under bench/results/cpu/.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads, as the lowbit CLI does

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.cpu_decode import SHAPES, prefill_seconds, random_model  # noqa: E402
from bench.results_file import write_result  # noqa: E402
from evals.provenance import commit, cpu_name, versions  # noqa: E402
from runtime import cpu_linear  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GROUP = 64


def cpu_ms(fn, repeats: int) -> float:
    fn()  # warm-up: first calls allocate and pick kernels
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return 1e3 * statistics.median(times)


def linear_rows(shape: str, rows: list[int], repeats: int) -> list[dict]:
    """Kernel vs scratch vs float32 per distinct Linear shape of the decoder."""
    cfg = SHAPES[shape]
    h, i, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"] * cfg["head_dim"]
    out = []
    for n, k in sorted({(h, h), (kv, h), (i, h), (h, i)}):
        g = torch.Generator().manual_seed(n + k)
        u = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
        slots = cpu_linear.Int4Slots(torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1),
                                     (torch.rand(k // GROUP, n, 2, generator=g) * 0.01).bfloat16(), GROUP, None, 4)
        dense = slots.dequantized().float()
        row = {"shape": shape, "n": n, "k": k, "dequantize_ms": cpu_ms(slots.dequantized, repeats)}
        for m in rows:
            a = torch.randn(m, k, generator=g).bfloat16()
            row[f"m{m}"] = {
                "kernel_ms": cpu_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    a, slots.packed, GROUP, slots.scale_zeros), repeats),
                "scratch_ms": cpu_ms(lambda: F.linear(a, slots.dequantized()), repeats),
                "float32_ms": cpu_ms(lambda: F.linear(a.float(), dense), repeats)}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def prefill_cpu_seconds(model, tokens: int) -> float:
    return prefill_seconds(model, tokens, clock=time.process_time)


def prefill_rows(shape: str, tokens: list[int], rounds: int) -> list[dict]:
    """W4 with and without the scratch path, and float32, per prompt length (CPU seconds, medians)."""
    models = {"w4": random_model(SHAPES[shape], quantized=True), "float32": random_model(SHAPES[shape], quantized=False)}
    shipped = cpu_linear.DEQUANTIZE_ROWS
    variants = {"w4_scratch": ("w4", shipped), "w4_kernel": ("w4", 1 << 30), "float32": ("float32", shipped)}
    out = []
    try:
        for n in tokens:
            samples = {v: [] for v in variants}
            for v, (name, threshold) in variants.items():  # warm-up: both paths' first calls
                cpu_linear.DEQUANTIZE_ROWS = threshold
                prefill_cpu_seconds(models[name], 2 * shipped)
            for _ in range(rounds):
                for v, (name, threshold) in variants.items():
                    cpu_linear.DEQUANTIZE_ROWS = threshold
                    samples[v].append(prefill_cpu_seconds(models[name], n))
            row = {"shape": shape, "tokens": n, **{f"{v}_s": statistics.median(s) for v, s in samples.items()},
                   "load_average": os.getloadavg()[0]}
            row["w4_kernel_over_float32"] = row["w4_kernel_s"] / row["float32_s"]
            row["w4_scratch_over_float32"] = row["w4_scratch_s"] / row["float32_s"]
            print(json.dumps(row), flush=True)
            out.append(row)
    finally:
        cpu_linear.DEQUANTIZE_ROWS = shipped
    del models
    gc.collect()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m,llama-1b")
    ap.add_argument("--rows", default="1,8,16,32,64,128,512", help="activation rows of the per-Linear timing")
    ap.add_argument("--tokens", default="128,512", help="prompt lengths of the end-to-end prefill")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu" / "cpu-prefill.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = {"commit": commit(), "device": f"cpu: {cpu_name()}", "threads": 1, "versions": versions(),
              "dequantize_rows": cpu_linear.DEQUANTIZE_ROWS, "protocol": __doc__.split("\n\n", 2)[2].strip(),
              "command": "python -m bench.cpu_prefill " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
              "load_average_start": os.getloadavg(), "linears": [], "prefill": []}
    rows, tokens = [int(m) for m in args.rows.split(",")], [int(t) for t in args.tokens.split(",")]
    for shape in args.shapes.split(","):
        result["linears"] += linear_rows(shape, rows, args.repeats)
        if not args.skip_prefill:
            result["prefill"] += prefill_rows(shape, tokens, args.rounds)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
