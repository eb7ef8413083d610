"""Whether W4 prefill on CPU keeps up with float32: the int4 weight-only kernel against a dequantized
bf16 scratch weight and a dense bf16 matmul (``Int4Slots``' path from ``dequantize_rows()`` rows),
and the same for W8 (``Int8Channels``: the int8 kernel against its codes cast into the scratch).

    flock /tmp/lowbit-bench.lock python -m bench.cpu_prefill [--shapes smollm2-135m,llama-1b]
    flock /tmp/lowbit-bench.lock python -m bench.cpu_prefill --compare [--isas native,avx2] [--threads 2]

``--compare`` (issue 42: the measured CPU plan, runtime/cpu_plan.py): prefills of ``--tokens``
(default 64,256,1024 with it) at batch 1 of the float32 model and, per W4 scheme (g64 asymmetric,
g32 symmetric), the W4 model *before* (``LOWBIT_CPU_PLAN=bf16``: the fixed bf16 scratch path and bf16
float leftovers, as before the plan) and *after* (the plan measured at first use into a fresh cache
folder; its timing seconds and table are recorded), alternating round by round, wall and process CPU
seconds (medians of ``--rounds``), at ``--threads``. Each ``--isas`` entry runs in a child process:
``native`` as the CPU is, ``avx2`` with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` (an
AVX2-only CPU as far as ATen and oneDNN go: no bf16 GEMM hardware); each records its capability.

Per Linear (the decoder's shapes, W4 g64 and W8 per channel, random codes): process CPU ms at 1
thread, medians of ``--repeats``: dequantizing the int4 weight natively into the reused scratch
(runtime/native/int4_weights.cpp) and by the PyTorch ops into a fresh buffer (the path before it);
then at M rows the int4 kernel, the native scratch path (dequantize + bf16 F.linear), the int8
kernel, the int8 scratch path (cast + F.linear) and a float32 F.linear. End to end: a prefill of
``--tokens`` at batch 1 (a forward filling a fresh cache, ``bench.cpu_decode.prefill_seconds``
under process CPU time) of W4 as shipped (``Int4Slots.dequantize_rows()``), W4 before
the native dequantizer (``LOWBIT_NATIVE=0``: the PyTorch ops from ``DEQUANTIZE_ROWS``), W4 with the
kernel at every M, and the float32 model, alternating round by round; models as
``bench.cpu_decode.random_model`` builds them. Raw JSON with device, versions, commit and load
averages under bench/results/cpu/.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads, as the lowbit CLI does

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.cpu_decode import SHAPES, prefill_seconds, random_model  # noqa: E402
from bench.results_file import write_result  # noqa: E402
from evals.provenance import commit, cpu_name, versions  # noqa: E402
from runtime import cpu_linear, cpu_plan  # noqa: E402
from runtime.linear import plan_keys  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GROUP = 64
COMPARE_SCHEMES = {"w4-g64-asym": dict(bits=4, group_size=64, symmetric=False),
                   "w4-g32-sym": dict(bits=4, group_size=32, symmetric=True)}
ISAS = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def cpu_ms(fn, repeats: int) -> float:
    fn()  # warm-up: first calls allocate and pick kernels
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return 1e3 * statistics.median(times)


def int4_slots(n: int, k: int, g: torch.Generator) -> cpu_linear.Int4Slots:
    u = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    return cpu_linear.Int4Slots(torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1),
                                (torch.rand(k // GROUP, n, 2, generator=g) * 0.01).bfloat16(), GROUP, None, 4)


def linear_rows(shape: str, rows: list[int], repeats: int) -> list[dict]:
    """Int4 and int8 kernels vs their scratch paths vs float32 per distinct Linear shape of the decoder."""
    cfg = SHAPES[shape]
    h, i, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"] * cfg["head_dim"]
    out = []
    for n, k in sorted({(h, h), (kv, h), (i, h), (h, i)}):
        g = torch.Generator().manual_seed(n + k)
        slots = int4_slots(n, k, g)
        w8 = cpu_linear.Int8Channels.build(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
                                           torch.rand(n, generator=g) * 0.01, None)
        dense = slots.dequantized().float()
        native = cpu_linear.native.load("int4_weights")
        row = {"shape": shape, "n": n, "k": k, "native": native is not None,
               "dequantize_native_ms": cpu_ms(lambda: slots.dequantized(cpu_linear.scratch(k, n)), repeats)}
        with native_off():
            row["dequantize_torch_ms"] = cpu_ms(slots.dequantized, repeats)
        row["dequantize_native_ns_per_weight"] = 1e6 * row["dequantize_native_ms"] / (n * k)
        for m in rows:
            a = torch.randn(m, k, generator=g).bfloat16()
            row[f"m{m}"] = {
                "int4_kernel_ms": cpu_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    a, slots.packed, GROUP, slots.scale_zeros), repeats),
                "int4_scratch_ms": cpu_ms(lambda: F.linear(a, slots.dequantized(cpu_linear.scratch(k, n))), repeats),
                "int8_kernel_ms": cpu_ms(lambda: torch.ops.aten._weight_int8pack_mm(a, w8.q, w8.scales), repeats),
                "int8_scratch_ms": cpu_ms(lambda: F.linear(a, cpu_linear.scratch(n, k).copy_(w8.q)) * w8.scales,
                                          repeats),
                "float32_ms": cpu_ms(lambda: F.linear(a.float(), dense), repeats)}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


@contextmanager
def native_off():
    """The PyTorch paths, as with LOWBIT_NATIVE=0 (runtime.native reads it on every call)."""
    before = os.environ.get("LOWBIT_NATIVE")
    os.environ["LOWBIT_NATIVE"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["LOWBIT_NATIVE"]
        else:
            os.environ["LOWBIT_NATIVE"] = before


def prefill_cpu_seconds(model, tokens: int) -> float:
    return prefill_seconds(model, tokens, clock=time.process_time)


def prefill_rows(shape: str, tokens: list[int], rounds: int) -> list[dict]:
    """W4 as shipped, before the native dequantizer, with the kernel at every M, and float32, per prompt
    length (CPU seconds, medians)."""
    models = {"w4": random_model(SHAPES[shape], quantized=True), "float32": random_model(SHAPES[shape], quantized=False)}
    never = 1 << 30
    variants = {"w4_native": ("w4", True, None),
                "w4_before": ("w4", False, cpu_linear.DEQUANTIZE_ROWS),
                "w4_kernel": ("w4", True, never), "float32": ("float32", True, never)}
    out = []
    for v in variants:  # warm-up: every path's first calls (the scratch grows, kernels are picked)
        run_variant(models, variants[v], max(tokens))
    for n in tokens:
        samples = {v: [] for v in variants}
        for _ in range(rounds):
            for v in variants:
                samples[v].append(run_variant(models, variants[v], n))
        row = {"shape": shape, "tokens": n, **{f"{v}_s": statistics.median(s) for v, s in samples.items()},
               "load_average": os.getloadavg()[0]}
        for v in ("w4_native", "w4_before", "w4_kernel"):
            row[f"{v}_over_float32"] = row[f"{v}_s"] / row["float32_s"]
        print(json.dumps(row), flush=True)
        out.append(row)
    del models
    gc.collect()
    return out


def run_variant(models: dict, variant: tuple, tokens: int) -> float:
    """CPU seconds of one prefill of ``tokens`` by ``variant`` (model, native on, int4 scratch rows:
    None as shipped)."""
    name, native, threshold = variant
    names = ("NATIVE_DEQUANTIZE_ROWS", "AMX_DEQUANTIZE_ROWS", "DEQUANTIZE_ROWS")
    shipped = {n: getattr(cpu_linear, n) for n in names}
    for n in names:
        setattr(cpu_linear, n, shipped[n] if threshold is None else threshold)
    try:
        with plan_mode("bf16"):  # these variants are the bf16 scratch's thresholds (before runtime/cpu_plan.py)
            if native:
                return prefill_cpu_seconds(models[name], tokens)
            with native_off():
                return prefill_cpu_seconds(models[name], tokens)
    finally:
        for n in names:
            setattr(cpu_linear, n, shipped[n])


@contextmanager
def environ(**values):
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def plan_mode(mode: str):
    """``LOWBIT_CPU_PLAN`` for the calls inside (read on every prefill call)."""
    return environ(**{cpu_plan.MODE_ENV: mode})


@contextmanager
def scheme_as(scheme: dict):
    """bench.cpu_decode.random_model quantizes with its module's SCHEME: this one inside."""
    from bench import cpu_decode

    before = cpu_decode.SCHEME
    cpu_decode.SCHEME = scheme
    try:
        yield
    finally:
        cpu_decode.SCHEME = before


@contextmanager
def plan_seconds(total: list):
    """Adds the wall seconds cpu_plan spends timing candidates (first use) to ``total[0]``."""
    real = cpu_plan.measure

    def timed(*args):
        start = time.perf_counter()
        try:
            return real(*args)
        finally:
            total[0] += time.perf_counter() - start

    cpu_plan.measure = timed
    try:
        yield
    finally:
        cpu_plan.measure = real


def prefill_times(model, tokens: int) -> tuple[float, float]:
    """(wall, process CPU) seconds of one prefill (``bench.cpu_decode.prefill_seconds``'s forward)."""
    cpu = time.process_time()
    wall = prefill_seconds(model, tokens)
    return wall, time.process_time() - cpu


def compare_rows(shape: str, tokens: list[int], rounds: int, schemes: list[str], before_max: int) -> dict:
    """The float32 model against each W4 scheme before and after the plan, per prompt length ("before"
    up to ``before_max`` tokens: under the AVX2 emulation it runs 20x the float model's time)."""
    cfg = SHAPES[shape]
    out = {"prefill": [], "plans": []}
    float_model = random_model(cfg, quantized=False)
    for scheme in schemes:
        spent = [0.0]
        with scheme_as(COMPARE_SCHEMES[scheme]), plan_seconds(spent):
            with plan_mode("bf16"):
                before = random_model(cfg, quantized=True)
            with plan_mode("measure"):
                after = random_model(cfg, quantized=True)  # the plan decides the float leftovers' dtype
                table = cpu_plan.table_rows(plan_keys(after.decoder))  # times every shape not yet timed
        print(cpu_plan.table_text(table), flush=True)
        out["plans"].append({"shape": shape, "scheme": scheme, "plan_seconds": spent[0], "table": table,
                             "lm_head_dtype": str(after.decoder.lm_head.weight.dtype)})
        variants = {"float32": (float_model, "measure"), "before": (before, "bf16"), "after": (after, "measure")}
        for model, mode in variants.values():  # warm-up: first calls allocate the scratch and pick kernels
            with plan_mode(mode):
                prefill_times(model, min(tokens))
        for n in tokens:
            samples = {v: [] for v in variants if v != "before" or n <= before_max}
            for _ in range(rounds):
                for v in samples:
                    model, mode = variants[v]
                    with plan_mode(mode):
                        samples[v].append(prefill_times(model, n))
            row = {"shape": shape, "scheme": scheme, "tokens": n, "rounds": rounds, "load_average": os.getloadavg()[0]}
            for v, s in samples.items():
                row[f"{v}_wall_s"] = statistics.median(w for w, _ in s)
                row[f"{v}_cpu_s"] = statistics.median(c for _, c in s)
            for v in ("before", "after")[n > before_max:]:
                row[f"{v}_over_float32_wall"] = row[f"{v}_wall_s"] / row["float32_wall_s"]
                row[f"{v}_over_float32_cpu"] = row[f"{v}_cpu_s"] / row["float32_cpu_s"]
            print(json.dumps(row), flush=True)
            out["prefill"].append(row)
        del before, after
        gc.collect()
    return out


def compare_child(args) -> dict:
    """One ISA's comparison, in this (child) process: what it ran on, then every shape's rows."""
    import tempfile

    torch.set_num_threads(args.threads)
    result = {"isa": args.isa_child, "capability": torch.backends.cpu.get_cpu_capability(),
              "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""), "fast_bf16": cpu_plan.fast_bf16(),
              "threads": torch.get_num_threads(), "prefill": [], "plans": []}
    with tempfile.TemporaryDirectory() as cache, environ(**{cpu_plan.CACHE_ENV: cache}):
        for shape in args.shapes.split(","):
            rows = compare_rows(shape, [int(t) for t in args.tokens.split(",")], args.rounds, args.schemes.split(","),
                                args.before_max_tokens)
            result["prefill"] += rows["prefill"]
            result["plans"] += rows["plans"]
    return result


def compare(args) -> dict:
    """Each ISA in a child process (ATen and oneDNN read their ISA variables once, at load)."""
    import subprocess
    import sys
    import tempfile

    runs = []
    for isa in args.isas.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, "-m", "bench.cpu_prefill", "--compare", "--isa-child", isa, "--child-out", f.name,
                   "--shapes", args.shapes, "--tokens", args.tokens, "--rounds", str(args.rounds),
                   "--schemes", args.schemes, "--threads", str(args.threads),
                   "--before-max-tokens", str(args.before_max_tokens)]
            print(f"# {isa}: {' '.join(cmd[1:])}", flush=True)
            subprocess.run(cmd, env={**os.environ, **ISAS[isa]}, cwd=ROOT, check=True)
            runs.append(json.loads(Path(f.name).read_text()))
    return {"runs": runs}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m,llama-1b")
    ap.add_argument("--rows", default="1,8,16,32,64,128,256,512", help="activation rows of the per-Linear timing")
    ap.add_argument("--tokens", default=None, help="prompt lengths of the end-to-end prefill "
                    "(default 16,64,128,512; with --compare 64,256,1024)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--compare", action="store_true", help="float32 vs W4 before/after the CPU plan (issue 42)")
    ap.add_argument("--isas", default="native,avx2", help="with --compare: " + ", ".join(ISAS))
    ap.add_argument("--schemes", default=",".join(COMPARE_SCHEMES), help="with --compare")
    ap.add_argument("--threads", type=int, default=2, help="with --compare (the per-Linear timing runs 1)")
    ap.add_argument("--before-max-tokens", type=int, default=1 << 30, help="with --compare: the 'before' "
                    "variant only up to this prompt length (0: not run)")
    ap.add_argument("--isa-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None,
                    help="default bench/results/cpu/cpu-prefill.json (--compare: cpu-prefill-plan.json)")
    args = ap.parse_args()
    args.tokens = args.tokens or ("64,256,1024" if args.compare else "16,64,128,512")
    if args.compare:
        return main_compare(args)
    args.out = args.out or ROOT / "bench" / "results" / "cpu" / "cpu-prefill.json"
    torch.set_num_threads(1)
    result = {"commit": commit(), "device": f"cpu: {cpu_name()}", "threads": 1, "versions": versions(),
              "native_dequantize_rows": cpu_linear.NATIVE_DEQUANTIZE_ROWS,
              "amx_dequantize_rows": cpu_linear.AMX_DEQUANTIZE_ROWS,
              "dequantize_rows": cpu_linear.DEQUANTIZE_ROWS, "int8_dequantize_rows": cpu_linear.INT8_DEQUANTIZE_ROWS, "protocol": __doc__.split("\n\n", 2)[2].strip(),
              "command": "python -m bench.cpu_prefill " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
              "load_average_start": os.getloadavg(), "linears": [], "prefill": []}
    rows, tokens = [int(m) for m in args.rows.split(",")], [int(t) for t in args.tokens.split(",")]
    for shape in args.shapes.split(","):
        result["linears"] += linear_rows(shape, rows, args.repeats)
        if not args.skip_prefill:
            result["prefill"] += prefill_rows(shape, tokens, args.rounds)
    write_result(args.out, result)


def main_compare(args) -> None:
    if args.isa_child:
        args.child_out.write_text(json.dumps(compare_child(args), default=str))
        return
    result = {"commit": commit(), "device": f"cpu: {cpu_name()}", "cpu": cpu_name(), "cpu_flags": sorted(
        f for f in cpu_plan.cpu_info()[1] if f.startswith(("avx", "amx", "fma"))), "versions": versions(),
        "threads": args.threads, "protocol": __doc__.split("``--compare``", 1)[1].strip(),
        "command": "python -m bench.cpu_prefill --compare " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if k in ("shapes", "tokens", "rounds", "schemes", "threads", "isas", "before_max_tokens")),
        "load_average_start": os.getloadavg(), **compare(args)}
    write_result(args.out or ROOT / "bench" / "results" / "cpu" / "cpu-prefill-plan.json", result)


if __name__ == "__main__":
    main()
