"""lowbit's int4 decode product at each instruction-set level (runtime/native: one build per level)
against aten's int4 kernel, on weights streamed from memory as a model's decode reads them.

    flock /tmp/lowbit-bench.lock python -m bench.cpu_int4_levels [--rows 1,8] [--threads 1]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m bench.cpu_int4_levels  # AVX2's layout and aten

Per shape (SmolLM2-135M's 576x576, 1536x576, 576x1536 and a 1B model's 2048x2048, 8192x2048,
2048x8192 Linears, W4 g64 random nibbles in ``_convert_weight_to_int4pack_for_cpu``'s layout for
this process: blocks of 64 on AVX-512, of 32 under ``ATEN_CPU_CAPABILITY=avx2``) and rows M:
``aten._weight_int4pack_mm_for_cpu``; lowbit's ``avx2`` path in the avx2 level's build; its
``avx512`` (AVX512-BF16) path in the avx512bf16 build, where this CPU runs it and the layout is
AVX-512's. Each call reads the next of enough copies of the weight to span twice the last-level
cache, so every call streams its packed bytes from memory (as a decode step's 30 layers do). The
variants alternate within each repeat; a sample is enough calls for ~``--sample-ms``; medians of
``--repeats``. One thread: process CPU time; more: wall. GB/s: packed weight plus scale_zeros bytes
over the median. Raw JSON with the CPU, its capability, native levels, commit and load averages
under bench/results/cpu/.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads, as the lowbit CLI does

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.cpu_int4_gemm import measure  # noqa: E402
from bench.results_file import write_result  # noqa: E402
from evals.provenance import commit, cpu_name, versions  # noqa: E402
from runtime import cpu_int4_layout, native  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GROUP = 64
SHAPES = {  # (out_features, in_features)
    "smollm2-135m": [(576, 576), (1536, 576), (576, 1536)],
    "llama-1b": [(2048, 2048), (8192, 2048), (2048, 8192)],
}


def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports (32 MB where it reports none)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        text = (index / "size").read_text().strip() if (index / "size").exists() else ""
        if text[:-1].isdigit():
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1))
    return max(sizes, default=32 << 20)


def cpu_model() -> dict:
    """/proc/cpuinfo's model name, family and model of the first CPU (empty off Linux)."""
    fields = {}
    path = Path("/proc/cpuinfo")
    for line in path.read_text().splitlines() if path.exists() else []:
        key, _, value = line.partition(":")
        if not line.strip():
            break
        if key.strip() in ("model name", "cpu family", "model"):
            fields[key.strip()] = value.strip()
    return fields


def kernels() -> dict[str, tuple]:
    """name -> (module, path number) of each lowbit variant this CPU runs."""
    out = {}
    if "avx2" in native.cpu_levels():
        out["avx2"] = (native.load("int4_gemm", level="avx2"), native.MATMUL_PATHS.index("avx2"))
    if "avx512bf16" in native.cpu_levels():
        out["avx512"] = (native.load("int4_gemm", level="avx512bf16"), native.MATMUL_PATHS.index("avx512"))
    return {name: kernel for name, kernel in out.items() if kernel[0] is not None}


def variants(n: int, k: int, rows: int, copies: int, lowbit: dict, g: torch.Generator) -> dict:
    """The callables to time: each call multiplies by the next copy of the weight."""
    layout = cpu_int4_layout.int4_layout()
    weights = []
    for _ in range(copies):
        u = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
        weights.append((torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1),
                        (torch.rand(k // GROUP, n, 2, generator=g) * 0.01).bfloat16()))
    a = torch.randn(rows, k, generator=g).bfloat16()

    def rotating(call):
        state = {"i": 0}

        def fn():
            packed, scale_zeros = weights[state["i"]]
            state["i"] = (state["i"] + 1) % copies
            return call(packed, scale_zeros)
        return fn

    fns = {"aten": rotating(lambda packed, sz: torch.ops.aten._weight_int4pack_mm_for_cpu(a, packed, GROUP, sz))}
    for name, (module, path) in lowbit.items():
        if name == "avx512" and (layout.block_n, layout.halves) != (64, True):
            continue  # AVX-512's blocks only
        fns[name] = rotating(lambda packed, sz, module=module, path=path: module.int4_linear(
            a, packed, GROUP, sz, layout.block_n, layout.halves, path, 0))
    reference = torch.ops.aten._weight_int4pack_mm_for_cpu(a, *weights[0][:1], GROUP, weights[0][1]).float()
    for name, (module, path) in lowbit.items():  # a wrong product is no result
        if name in fns:
            got = module.int4_linear(a, weights[0][0], GROUP, weights[0][1], layout.block_n, layout.halves, path, 0)
            assert torch.allclose(got.float(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item()), name
    return fns


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--threads", default="1")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sample-ms", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=None,
                        help="default bench/results/cpu/cpu-int4-levels-<aten capability>.json")
    args = parser.parse_args()
    capability = torch.backends.cpu.get_cpu_capability()
    out = args.out or ROOT / f"bench/results/cpu/cpu-int4-levels-{capability.lower()}.json"
    lowbit = kernels()
    if not lowbit:
        raise SystemExit("no level of the native int4 kernel builds or runs here (see the warnings above)")
    llc = last_level_cache_bytes()
    layout = cpu_int4_layout.int4_layout()
    result = {"device": cpu_name(), "cpu_model": cpu_model(), "versions": versions(), "commit": commit(), "command": " ".join(
        ["python -m bench.cpu_int4_levels", *os.sys.argv[1:]]), "cpu_capability": capability,
        "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY"), "native_levels": native.cpu_levels(),
        "layout": {"block_n": layout.block_n, "halves": layout.halves}, "group": GROUP, "llc_bytes": llc,
        "load_average_start": os.getloadavg(), "protocol": __doc__.split("\n\n", 2)[2], "runs": []}
    g = torch.Generator().manual_seed(0)
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        clock = "cpu_ms" if threads == 1 else "wall_ms"
        for shape in args.shapes.split(","):
            for n, k in SHAPES[shape]:
                nbytes = n * k // 2 + (k // GROUP) * n * 4
                copies = max(2, -(-2 * llc // nbytes))
                for rows in [int(r) for r in args.rows.split(",")]:
                    times = measure(variants(n, k, rows, copies, lowbit, g), args.repeats, args.sample_ms)
                    for t in times.values():
                        t["gb_per_s"] = nbytes / t[clock] / 1e6
                    result["runs"].append({"threads": threads, "clock": clock, "shape": shape, "n": n, "k": k,
                                           "rows": rows, "copies": copies, "bytes": nbytes, "times": times})
                    print(f"{threads}t {n:5d}x{k:<5d} M={rows:<2d} x{copies:<3d}", "  ".join(
                        f"{name} {t[clock]:.3f} ms {t['gb_per_s']:.1f} GB/s" for name, t in times.items()), flush=True)
    write_result(out, result)


if __name__ == "__main__":
    main()
