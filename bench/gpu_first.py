"""The first call of a GPU run (issue 43): the W4 engine against fp16 first, then where its time goes.

    python -m bench.gpu_first --commit SHA                 # on the lent GPU: <= 9 minutes, one device call
    python -m bench.gpu_first --smoke                      # CPU + Triton interpreter, tiny shapes (CI)
    python -m bench.gpu_first --count                      # restricted tuning counted here, no GPU

The device call (carry ``.gpu-cache``, built by ``make gpu-cache``: the quantized-matmul kernels
compiled for sm_90a; without it they compile there):

    run(command="PYTHONUNBUFFERED=1 python3 -m bench.gpu_first --commit <SHA>", carry=[".gpu-cache"],
        timeout_s=600)                                     # <SHA>: written out, there is no git there

Steps, in order, each a child process with its own time budget (bench/gpu_check.py's runner: a
step cut at its budget keeps what it reported), the results JSON rewritten after every row
(``--out``, default ``bench/results/gpu/first-<device>-<commit>.json``, and a copy in ``$OUT``):

  env          device, versions, copy bandwidth and matmul ceilings (gpu_stages.environment); the
               carried Triton cache unpacked into TRITON_CACHE_DIR, its key parts against this
               machine's, a replay of some of its kernels (hits: no new entry)
  precompile   only if env found no usable cache: the matmul kernels compiled over every core
  engine       fp16 vs W4 g128 engine, Llama-3-8B shape (random weights), batch 1, 512-token prompt,
               128 new tokens, 3 repeats: TTFT, ITL mean/p50/p99, start-up; one prefill, one decode
               step (graph) and one eager decode step profiled (per-kernel device time)
  prefill      bench/kernels.py on the engine's 4 Linear shapes, M = 512 and 4096: every tuner
               candidate (tuner_ms, dense ones included), dense path, dequantize alone, cuBLAS fp16
  small-m      the same at M = 4, 8, 16
  attention    decode attention at 32k, batch 1 and 32, fp16/int8/int4 caches, splits x1, x2, x4, x8
               of the default, against fp16 SDPA
  batch32      fp16 vs W4 engine at batch 32 (prompt 512, 128 tokens), only if time is left

Every step records the Triton cache's entries before and after it (new ones by kernel name: what
the carried cache missed). Engines tune only the row buckets their steps take (``Engine(tune_rows=
...)``; ``step_rows``): batch 1 with 512-token prompts, 8 tunings where every bucket to 4096 was 96
(``--count``). The correctness checks (gpu_check's stages) are a second device call.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # `python bench/gpu_first.py`: bench/ off the path (its kernels.py shadows the `kernels`
    # package transformers looks for), the repository root on it for `bench.*`
    here = Path(__file__).resolve().parent
    sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != here]

from bench import gpu_cache, gpu_check, gpu_stages  # noqa: E402
from bench.gpu_first_plan import (BATCH32, CONTEXT, ENGINE, PREFILL_ROWS, SMALL_ROWS, SMOKE_ENGINE,  # noqa: E402,F401
                                  SPLIT_FACTORS, compile_tasks_of_run, engine_shapes, step_rows, tune_rows,
                                  tuning_counts)

TOTAL_S = 540  # 9 minutes of steps: a 10-minute device command with start-up and transfers around it
CACHE_DIR = Path(tempfile.gettempdir()) / "lowbit-triton-cache"  # TRITON_CACHE_DIR of every step
PROBE_TASKS = 6  # carried kernels replayed by the env step to prove hits


# ---------------------------------------------------------------------------------- steps


def watching_cache(step):
    """``step`` with the Triton cache's entries counted before and after it (new ones by kernel)."""
    def run(smoke: bool, shard=(0, 1), report=None) -> dict:
        cache = Path(os.environ.get("TRITON_CACHE_DIR", CACHE_DIR))
        before = gpu_cache.entries(cache)

        def with_cache(result: dict) -> dict:
            after = gpu_cache.entries(cache)
            new = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
            return {**result, "triton_cache": {"dir": str(cache), "before": sum(before.values()),
                                               "after": sum(after.values()), "new_by_kernel": new}}

        result = step(smoke, report=(lambda r: report(with_cache(r))) if report else None)
        return with_cache(result)
    return run


def env_step(smoke: bool, report=None) -> dict:
    """The environment (gpu_stages.environment), then the carried caches (``gpu_cache.carried``):
    unpacked, key parts compared with the build's, and PROBE_TASKS of the built cache's kernels
    replayed (compiled through warmup: a hit adds no entry)."""
    result = gpu_stages.environment(smoke)
    folder = Path(os.environ.get("LOWBIT_GPU_CACHE", gpu_cache.CACHE_TAR.parent))
    cache = Path(os.environ.get("TRITON_CACHE_DIR", CACHE_DIR))
    tars = gpu_cache.carried(folder)
    if not tars:
        result["carried_cache"] = {"usable": False, "why": f"no triton-*.tar.xz in {folder} (make gpu-cache, "
                                                           "and carry .gpu-cache in the device call)"}
        return result
    unpacked = [gpu_cache.unpack(tar, cache) for tar in tars]
    manifest = next((u["manifest"] for u in unpacked if u["manifest"]), None) or {}
    here = gpu_cache.key_parts()
    built = {**manifest.get("key_parts_here", {}), "triton_key_sha256": manifest.get("triton_key_sha256")}
    differ = [k for k in ("triton_key_sha256", "ptxas", "env_vars") if built.get(k) != here[k]]
    probe, done = {"skipped": "smoke: the interpreter compiles nothing"}, None
    tasks = [(tuple(s), M, dt, b, gpu_cache._config(c)) for s, M, dt, b, c in manifest.get("task_list", [])]
    tasks = tasks[::max(1, len(tasks) // PROBE_TASKS)][:PROBE_TASKS]
    if not smoke and tasks:
        from bench.gpu_compiles import compile_tasks

        before, t0 = gpu_cache.count(cache), time.time()
        done, errors = compile_tasks(tasks, "cuda")
        probe = {"tasks": len(tasks), "compiled_or_loaded": done, "errors": errors[:3],
                 "new_entries": gpu_cache.count(cache) - before, "wall_s": round(time.time() - t0, 2)}
    result["carried_cache"] = {
        "unpacked": [{k: v for k, v in u.items() if k != "manifest"} for u in unpacked],
        "key_parts_here": here, "differ_from_build": differ, "probe": probe,
        "built_at_commit": manifest.get("commit"),
        "kernels_source_same": manifest.get("kernels_source_sha256") == gpu_cache.kernels_source_hash(),
        "usable": bool(tasks) and probe.get("new_entries") == 0 and done == len(tasks)}
    print(f"carried cache: {sum(u['entries_after'] - u['entries_before'] for u in unpacked)} entries unpacked; "
          f"key parts differing from its build: {differ or 'none'}; probe {probe}", flush=True)
    return result


def precompile_step(smoke: bool, report=None) -> dict:
    """The run's matmul compiles over every core (gpu_compiles.compile_tasks in parallel processes):
    what the carried cache would have saved."""
    import multiprocessing

    from bench.gpu_compiles import compile_tasks

    tasks = [] if smoke else compile_tasks_of_run()
    workers = max(1, min(os.cpu_count() or 1, 16, len(tasks)))
    started = time.time()
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        parts = pool.map(compile_tasks, [tasks[i::workers] for i in range(workers)])
    return {"passed": True, "tasks": len(tasks), "compiled": sum(d for d, _ in parts), "workers": workers,
            "errors": [e for _, errs in parts for e in errs][:3], "wall_s": round(time.time() - started, 1)}


def engine_step(smoke: bool, report=None, case=None) -> dict:
    """fp16 then W4 g128 engines on one case (``ENGINE``): start-up, a warm-up request, the timed
    repeats, and (batch 1) one profiled prefill, decode step and eager decode step."""
    gpu_stages.interpret_if(smoke)
    from bench import gpu_first_engine

    return gpu_first_engine.compare(smoke, SMOKE_ENGINE if smoke else case or ENGINE, report)


def batch32_step(smoke: bool, report=None) -> dict:
    return engine_step(smoke, report, case=BATCH32 if not smoke else None)


def kernels_step(rows: tuple[int, ...]):
    """bench/kernels.py one engine shape at a time (a cut step keeps the shapes it finished)."""
    def run(smoke: bool, report=None) -> dict:
        from bench import kernels

        record = None
        for shape in [None] if smoke else engine_shapes():
            argv = ["--smoke"] if smoke else ["--shapes", shape, "--ms", *map(str, rows), "--samples", "10"]
            record = gpu_stages.merged_kernel_record(
                record, gpu_stages.bench_record(lambda out: kernels.main([*argv, "--out", str(out)])))
            if report:
                report({"passed": True, "versions": gpu_stages.stack_versions(), "record": record})
        return {"passed": True, "versions": gpu_stages.stack_versions(), "record": record}
    return run


def attention_step(smoke: bool, report=None) -> dict:
    gpu_stages.interpret_if(smoke)
    from bench import gpu_first_engine

    return gpu_first_engine.attention_splits(smoke, report)


def _stage(name: str, budget: int, fn) -> gpu_check.Stage:
    return gpu_check.Stage(f"bench.gpu_first:{name}", budget, watching_cache(fn))


STEPS = [_stage("env", 45, env_step), _stage("precompile", 60, precompile_step),
         _stage("engine", 200, engine_step), _stage("prefill", 90, kernels_step(PREFILL_ROWS)),
         _stage("small-m", 90, kernels_step(SMALL_ROWS)), _stage("attention", 60, attention_step),
         _stage("batch32", 150, batch32_step)]
BY_NAME = {s.name.split(":")[1]: s for s in STEPS}
IF_TIME_LEFT = {"batch32"}  # run only when its whole budget fits in what is left


# ------------------------------------------------------------------------------------ main


def run(args) -> dict:
    """Every step in order within TOTAL_S (scaled by --budget-scale), the record saved after each row."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(CACHE_DIR))
    device = gpu_stages.device_name(args.smoke)
    path = args.out or (Path(tempfile.gettempdir()) / "gpu-first-smoke.json" if args.smoke else
                        ROOT / "bench" / "results" / "gpu" / f"first-{_slug(device)}-{args.commit}.json")
    record = {"bench": "bench/gpu_first.py", "device": device, "commit": args.commit, "smoke": args.smoke,
              "note": "smoke: CPU + Triton interpreter, tiny shapes: no number in it means anything about speed"
              if args.smoke else "GPU run", "triton_cache_dir": os.environ["TRITON_CACHE_DIR"], "steps": {}}
    started = time.time()
    deadline = started + TOTAL_S * args.budget_scale
    print(f"gpu_first: {device}, commit {args.commit} -> {path}", flush=True)
    for stage in STEPS:
        name = stage.name.split(":")[1]
        left = deadline - time.time()
        budget = gpu_check.SMOKE_BUDGET_S if args.smoke else round(min(stage.budget_s * args.budget_scale, left))
        skip = _skip_reason(name, record, left, stage.budget_s * args.budget_scale, args)
        if skip:
            record["steps"][name] = {"skipped": skip}
            continue

        def partial(result, name=name):
            record["steps"][name] = {**result, "passed": False, "error": "still running when last saved"}
            gpu_check.save(record, path)

        record["steps"][name] = gpu_check.run_stage(stage, args, budget, partial)
        gpu_check.save(record, path)
    record["headlines"] = headlines(record["steps"])
    if os.environ.get("OUT") and not args.smoke:  # (xz of ~50 entries: seconds; skipped past the call's margin)
        record["gpu_made_cache"] = (pack_new_entries(Path(os.environ["OUT"]), started)
                                    if time.time() < deadline + 20 else {"skipped": "no time left in the call"})
    gpu_check.save(record, path)
    print(json.dumps(record["headlines"], indent=1))
    print(f"results: {path}")
    return record


def pack_new_entries(out: Path, since: float) -> dict:
    """The Triton cache entries this run compiled on the GPU (what the carried cache lacked: attention,
    KV writes, small ops, misses), packed into ``out`` (the device call's $OUT, which comes back):
    copied into .gpu-cache, the next run unpacks them with the rest. Exact keys: made where they run."""
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    target = out / "triton-gpu-made.tar.xz"
    new = [d for d in cache.iterdir() if d.is_dir() and d.stat().st_mtime >= since]
    if not new:
        return {"entries": 0}
    size = gpu_cache.pack(cache, target, since=since, preset=6)
    if size > 15 * 2**20:  # the device tool brings files back up to 16 MiB
        target.unlink()
        return {"entries": len(new), "dropped": f"{size} bytes: over what comes back"}
    return {"entries": len(new), "file": target.name, "bytes": size}


def _skip_reason(name: str, record: dict, left: float, budget: float, args) -> str | None:
    if args.steps and name not in args.steps:
        return "not in --steps"
    if name == "precompile" and (record["steps"].get("env", {}).get("carried_cache", {}).get("usable") or args.smoke):
        return "the carried Triton cache hit" if not args.smoke else "smoke"
    if not args.smoke and (left < 20 or (name in IF_TIME_LEFT and left < budget)):
        return f"{left:.0f} s left of the run's {TOTAL_S} s"
    return None


def headlines(steps: dict) -> dict:
    """W4 against fp16 (ITL, TTFT) per engine case, the goals beside them (issue 43)."""
    out = {}
    for name in ("engine", "batch32"):
        ratio = steps.get(name, {}).get("w4_vs_fp16")
        if ratio:
            out[name] = {**ratio, "goals": {"itl_speedup": ">= 2.0 (batch 1)", "ttft_ratio": "<= 1.05"}}
    return out


def _slug(device: str) -> str:
    from bench.gpu import device_slug

    return device_slug(device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes: checks the script")
    ap.add_argument("--count", action="store_true", help="count each step's tunings and compiles here (no GPU)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--steps", type=lambda s: set(s.split(",")), help=f"only these, of {', '.join(BY_NAME)}")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply the run's and each step's budget")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.count:
        counts = {k: {f: v for f, v in c.items() if f != "tasks"} for k, c in tuning_counts().items()}
        counts["run, each compile once"] = {"matmul_compiles": len(compile_tasks_of_run())}
        print(json.dumps(counts, indent=1))
        if args.out:
            import platform

            import torch
            import triton

            from bench.results_file import write_result
            from evals.provenance import device_info

            write_result(args.out, {"bench": "bench/gpu_first.py --count", "commit": gpu_stages.commit(),
                                    "device": device_info("cpu"), "versions": {  # (.venv-triton36 has no transformers)
                                        "torch": torch.__version__, "triton": triton.__version__,
                                        "python": platform.python_version()},
                                    "method": tuning_counts.__doc__, "counts": counts})
        return 0
    if args.smoke and gpu_check.smoke_refusal():
        ap.error(gpu_check.smoke_refusal())
    args.commit = args.commit or gpu_stages.commit()
    record = run(args)
    ran = [s for s in record["steps"].values() if "skipped" not in s]
    return 0 if all(s.get("passed") for s in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
