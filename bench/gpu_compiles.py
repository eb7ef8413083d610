"""What the quantized matmul compiles and tunes in each gpu_check stage, counted without a GPU.

    python -m bench.gpu_compiles [--stages weights,engine,kernel-speed,engine-speed]
    python -m bench.gpu_compiles --stages kernel-speed --offline 8    # with .venv-triton36's python too

On the lent GPU the stages' time went to compiling (Triton JIT, ptxas) and to the autotuner, which
times every candidate configuration of each (M bucket, shape) once. Here nothing compiles, so the
kernels' launches are recorded instead of run: ``quant_matmul``'s real ``launch`` computes every
constexpr and argument, and a stand-in for ``JITFunction.run`` keeps the key Triton compiles per (the kernel,
its constexprs, num_warps/num_stages, and for each other integer whether it is 1 or divisible by 16,
Triton's specialization; tensors by dtype). ``tunes_on`` is forced on and ``matmul_tuning.tune``
replaced by one that launches each candidate once (as the timing does) and returns the default. Each
stage's GEMMs come from its own code: ``check_weights`` runs as the stage runs it (CPU tensors, the
kernels recorded, its errors meaningless); the engine stages' shapes are their models' quantized
Linears (built on the meta device) at every M bucket their Engine tunes at start-up. Attention, KV
writes and the fused small ops are not counted here (a few kernels per KV scheme and model).

``precompile(stage)`` (on a GPU; the speed stages call it first) compiles the same launches in
parallel processes, each launch once with Triton's ``warmup`` (compile, no run) on meta tensors,
into Triton's on-disk cache, where the stage's own tuning then finds them: compiling is one CPU
core a process, and the tuner would compile its candidates one after another. ``--offline N``
checks that without a GPU: N of a stage's launches compiled that way for sm_90a with a stand-in
driver (Triton's compiler and ptxas need no GPU), then the same launches on real tensors in a new
process, which must find every kernel in Triton's cache.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import time
from unittest import mock

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# gpu_check's kernel-speed rows: decode (M=1: the GEMV), a few rows (4: where the few-row GEMV is a
# candidate), 16 rows (issue 15's M=16 target), prefill
KERNEL_SPEED_ROWS = (1, 4, 16, 4096)


def compile_key(fn, args, kwargs) -> tuple:
    """The key Triton compiles ``fn`` once per: constexprs and launch options by value, every other
    argument by ``specialization``."""
    bound = {**dict(zip((p.name for p in fn.params), args)), **kwargs}
    constexprs = {p.name for p in fn.params if p.is_constexpr} | {"num_warps", "num_stages"}
    return fn.__name__, str(sorted((name, value if name in constexprs else specialization(value))
                                   for name, value in bound.items()))


def specialization(value):
    """What Triton compiles a non-constexpr argument for: an integer's 1 / divisible-by-16 (and
    64-bit) class, a tensor's dtype (every tensor here is 16-byte aligned), a descriptor's block."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return ("int", value == 1, value % 16 == 0, abs(value) >= 2**31)
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype))
    if hasattr(value, "block_shape"):
        return ("descriptor", str(value.base.dtype), tuple(value.block_shape))
    return type(value).__name__


@contextlib.contextmanager
def recording():
    """Inside: quant_matmul's kernels record instead of running, tuning counts its candidates and
    returns the default, and activations go by TMA where a Hopper GPU takes them. Yields the counts."""
    from triton.runtime.jit import JITFunction

    from runtime.kernels import matmul_tuning
    from runtime.kernels import quant_matmul as qm

    if qm.interpreting():
        raise RuntimeError("the kernels were imported for the Triton interpreter (TRITON_INTERPRET=1): nothing "
                           "would be recorded; run without it")
    counts = {"keys": set(), "tunings": 0, "candidates": 0, "calls": 0, "tasks": []}
    real_launch = qm.launch

    def recorded_launch(x2, kw, bias, out, config):
        """A launch that compiles something new becomes a precompile task (weight shape, rows, dtype,
        bias, configuration: what ``compile_tasks`` rebuilds it from)."""
        before = len(counts["keys"])
        real_launch(x2, kw, bias, out, config)
        if len(counts["keys"]) > before and kw.perm is None:
            spec = (kw.in_features, kw.out_features, kw.bits, kw.group_len, kw.zeros is None)
            counts["tasks"].append((spec, x2.shape[0], str(x2.dtype).removeprefix("torch."), bias is not None, config))

    def tune(M, kw, dtype, device, candidates, launch):
        counts["tunings"] += 1
        counts["candidates"] += len(candidates)
        x = torch.empty(M, kw.in_features, dtype=dtype, device=kw.qweight.device)
        out = torch.empty(M, kw.out_features, dtype=dtype, device=kw.qweight.device)
        for config in candidates:
            launch(x, kw, None, out, config)
        return candidates[0]

    def counted_quant_matmul(*args, **kwargs):
        counts["calls"] += 1
        return real_quant_matmul(*args, **kwargs)

    real_quant_matmul = qm.quant_matmul
    qm._TUNED.clear()
    qm._NO_CONFIGURATION.clear()
    def run(fn, *args, grid, warmup, **kwargs):  # every @triton.jit launch: recorded, not run
        counts["keys"].add(compile_key(fn, args, kwargs))

    with mock.patch.object(JITFunction, "run", run), mock.patch.object(qm, "tunes_on", lambda device: counts["tuning_on"]), \
            mock.patch.object(qm, "activations_by_tma", lambda x2, block_m, interpreted: block_m >= qm.TMA_MIN_BLOCK_M), \
            mock.patch.object(matmul_tuning, "tune", tune), mock.patch.object(qm, "launch", recorded_launch), \
            mock.patch.object(qm, "quant_matmul", counted_quant_matmul):
        counts["tuning_on"] = True
        yield counts
    qm._TUNED.clear()


def summary(counts: dict) -> dict:
    kernels = sorted({name for name, _ in counts["keys"]})
    return {"matmul_compiles": len(counts["keys"]),
            "by_kernel": {k: sum(1 for name, _ in counts["keys"] if name == k) for k in kernels},
            "tunings": counts["tunings"], "candidates_timed": counts["candidates"], "calls": counts["calls"],
            "tasks": counts["tasks"]}


def meta_linears(config: dict) -> list:
    """The kernel weights of a model's quantized Linears (joined as ``prepare`` joins them), on the
    meta device: the shapes without the memory."""
    from evals.serving import random_model  # noqa: F401 (the same factory the stages use)
    from quant.affine import QuantScheme
    from runtime.linear import QuantLinear
    from runtime.load import linear_factory, linear_names
    from runtime.model import Decoder, DecoderConfig

    cfg = DecoderConfig.from_hf(config)
    scheme = QuantScheme(bits=4, group_size=min(128, cfg.hidden_size), symmetric=False)
    names = [n for n in linear_names(cfg) if n != "lm_head"]
    with torch.device("meta"):
        decoder = Decoder(cfg, linear_factory({n: scheme for n in names}))
        decoder.join_projections()
    shapes = {}
    for module in decoder.modules():
        if isinstance(module, QuantLinear):
            shapes.setdefault((module.in_features, module.out_features), module)
    return [meta_kernel_weight(m) for m in shapes.values()]


def meta_kernel_weight(module):
    scheme = module.scheme
    return meta_weight(module.in_features, module.out_features, scheme.bits, scheme.group_len(module.in_features),
                       scheme.symmetric)


def meta_weight(K: int, N: int, bits: int, group_len: int, symmetric: bool, scale_dtype=torch.float16,
                device: str = "meta"):
    """A kernel weight's layout (``weight_layout.KernelWeight``), on the meta device by default."""
    from runtime.kernels.weight_layout import KernelWeight

    groups = -(-K // group_len)
    tile_k = 16 * 32 // bits
    k_pad = -(-K // tile_k) * tile_k
    zeros = None if symmetric else torch.empty(groups, N, dtype=torch.int8, device=device)
    return KernelWeight(torch.empty(k_pad * bits // 32, N, dtype=torch.int32, device=device),
                        torch.empty(groups, N, dtype=scale_dtype, device=device), zeros, None, K, N, bits, group_len)


def engine_start_up(kernel_weights: list, largest_m: int, dtype=torch.float16, rows=None) -> None:
    """What ``runtime.execution.warm_matmul_tuning`` asks at an Engine's start-up (``rows``: its
    ``tune_rows``), and one launch of each bucket's configuration (as its first step of that many
    rows runs it)."""
    from runtime.execution import tuning_buckets
    from runtime.kernels.matmul_tuning import NoConfiguration
    from runtime.kernels.quant_matmul import choose_config, launch

    for kw in kernel_weights:
        for M in tuning_buckets(largest_m, rows):
            with contextlib.suppress(NoConfiguration):
                config = choose_config(M, kw, dtype, torch.device("meta"))
                x = torch.empty(M, kw.in_features, dtype=dtype, device="meta")
                launch(x, kw, None, torch.empty(M, kw.out_features, dtype=dtype, device="meta"), config)


def count_weights() -> dict:
    from bench import correctness

    with recording() as counts, mock.patch.object(correctness, "device_for", lambda smoke: torch.device("cpu")):
        correctness.check_weights(smoke=False)
    return summary(counts)


ENGINE_CHECK_LARGEST_M = 256  # check_engine's Engines: max(max_batch 4, prefill_chunk 256)


def count_engine(tuning: bool) -> dict:
    """The engine check's GEMMs: both models' Linears at every bucket up to its largest M (an
    Engine's start-up; with tuning off, each bucket's default configuration)."""
    from bench import correctness

    with recording() as counts:
        counts["tuning_on"] = tuning
        for _, config in correctness.engine_models(False):
            engine_start_up(meta_linears(config), ENGINE_CHECK_LARGEST_M)
    return summary(counts)


def count_kernel_speed() -> dict:
    from types import SimpleNamespace

    from bench import kernels
    from quant.affine import QuantScheme
    from runtime.kernels.quant_matmul import choose_config

    with recording() as counts:  # the stage's rows (KERNEL_SPEED_ROWS), W4 g128 asymmetric, fp16
        for shape in kernels.SHAPES:
            K, N = map(int, shape.split("x"))
            kw = meta_kernel_weight(SimpleNamespace(scheme=QuantScheme(4, 128, symmetric=False), in_features=K,
                                                    out_features=N))
            for M in KERNEL_SPEED_ROWS:
                choose_config(M, kw, torch.float16, torch.device("meta"))
    return summary(counts)


def count_engine_speed() -> dict:
    from evals.serving import LLAMA3_8B

    with recording() as counts:  # batches 1 and 32, prefill chunk 4096: the Engine tunes up to 4096
        engine_start_up(meta_linears(LLAMA3_8B), 4096)
    return summary(counts)


COUNTERS = {"weights": count_weights, "engine": lambda: count_engine(tuning=False),
            "engine-tuned": lambda: count_engine(tuning=True), "kernel-speed": count_kernel_speed,
            "engine-speed": count_engine_speed}


def compile_tasks(tasks: list, device: str = "meta") -> tuple[int, list[str]]:
    """In a worker process on the GPU machine: each task's launch with Triton's warmup (compile into
    the on-disk cache, run nothing). Returns how many compiled and the errors of the others."""
    from triton.runtime.jit import JITFunction

    from runtime.kernels import quant_matmul as qm

    real_run = JITFunction.run
    hopper = torch.cuda.get_device_capability()[0] >= 9 and qm.TensorDescriptor is not None
    done, errors = 0, []

    def run(fn, *args, grid, warmup, **kwargs):
        return real_run(fn, *args, grid=grid, warmup=True, **kwargs)

    with mock.patch.object(JITFunction, "run", run), \
            mock.patch.object(qm, "activations_by_tma", lambda x2, block_m, interpreted: hopper and
                              block_m >= qm.TMA_MIN_BLOCK_M):
        for (K, N, bits, group_len, symmetric), M, dtype, has_bias, config in tasks:
            dtype = getattr(torch, dtype)
            kw = meta_weight(K, N, bits, group_len, symmetric, dtype, device)
            x, out = (torch.empty(M, n, dtype=dtype, device=device) for n in (K, N))
            bias = torch.empty(N, dtype=dtype, device=device) if has_bias else None
            try:
                qm.launch(x, kw, bias, out, config)
                done += 1
            except Exception as e:  # noqa: BLE001 - the stage compiles it itself then: report, go on
                errors.append(f"{config}: {type(e).__name__}: {str(e)[:200]}")
    return done, errors


def precompile(stage: str, workers: int | None = None, timeout_s: float = 60) -> dict:
    """Compile what ``stage`` will compile in the quantized matmul, over ``workers`` processes (default:
    one per CPU, at most 16), into Triton's on-disk cache; gives up after ``timeout_s``."""
    started = time.time()
    tasks = COUNTERS[stage]()["tasks"]
    workers = max(1, min(workers or os.cpu_count() or 1, 16, len(tasks)))
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        parts = pool.map_async(compile_tasks, [tasks[i::workers] for i in range(workers)]).get(timeout_s)
    errors = [e for _, errs in parts for e in errs]
    return {"stage": stage, "tasks": len(tasks), "compiled": sum(done for done, _ in parts), "workers": workers,
            "wall_s": round(time.time() - started, 1), "errors": errors[:3], "error_count": len(errors)}


class StandInDriver:
    """What ``JITFunction.run`` asks of Triton's driver before it compiles, for sm_90a, on a machine
    without a GPU (the compiler and ptxas need none)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def offline(stage: str, limit: int) -> dict:
    """Without a GPU: ``limit`` of the stage's tasks (spread over its list) compiled for sm_90a the way
    ``compile_tasks`` does (warmup on meta tensors) into a fresh Triton cache, then the same launches
    on real CPU tensors in a fresh process, which must find every kernel in that cache."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        env.pop("TRITON_INTERPRET", None)
        runs = []
        for device in ("meta", "cpu"):
            code = f"from bench.gpu_compiles import offline_run; offline_run({stage!r}, {limit}, {device!r})"
            proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
            if proc.returncode:
                raise RuntimeError(proc.stderr[-3000:])
            runs.append({**json.loads(proc.stdout.strip().splitlines()[-1]), "cache_entries": len(os.listdir(cache))})
    return {"stage": stage, "compile": runs[0], "replay": runs[1], "replay_hit_cache":
            runs[1]["cache_entries"] == runs[0]["cache_entries"] and runs[1]["done"] == runs[0]["done"]}


def offline_run(stage: str, limit: int, device: str) -> None:
    from triton.runtime.driver import driver

    driver.set_active(StandInDriver())
    tasks = COUNTERS[stage]()["tasks"]
    tasks = tasks[::max(1, len(tasks) // limit)][:limit]
    with mock.patch.object(torch.cuda, "get_device_capability", lambda *args: (9, 0)):
        wall, cpu = time.perf_counter(), time.process_time()
        done, errors = compile_tasks(tasks, device)
    print(json.dumps({"device": device, "tasks": len(tasks), "done": done, "errors": errors[:3],
                      "wall_s": round(time.perf_counter() - wall, 2), "cpu_s": round(time.process_time() - cpu, 2)}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default=",".join(COUNTERS), help=f"comma-separated, of {', '.join(COUNTERS)}")
    ap.add_argument("--offline", metavar="N", type=int, help="instead: compile N of each stage's tasks for sm_90a "
                    "here (no GPU), then check real launches find them in Triton's cache")
    args = ap.parse_args(argv)
    if args.offline:
        print(json.dumps([offline(name, args.offline) for name in args.stages.split(",")], indent=1))
        return 0
    out = {name: {k: v for k, v in COUNTERS[name]().items() if k != "tasks"} for name in args.stages.split(",")}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
