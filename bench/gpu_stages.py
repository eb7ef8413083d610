"""The stages of bench/gpu_check.py, each a function ``(smoke, shard, report) -> dict`` run in its
own child process, and the headline table made from their results.

A stage's dict has ``passed`` (it ran and what it checks held) and its raw data. Speed stages
pass when their benchmark ran (each checks its kernels' output before timing them); whether the
speed met its target is a headline, reported beside, never hidden in ``passed``. ``report(dict)``
saves what the stage has so far (after each case, shape, batch or row): a stage cut at its budget
keeps it. ``shard=(i, n)``: the i-th of n processes that split a stage's cases (``merge_shards``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what the benches and the runtime import; on the lent GPU machine only its image's packages exist
RUNTIME_MODULES = ["runtime", "runtime.kernels.quant_matmul", "runtime.kernels.attention", "evals.serving",
                   "evals.diagnose", "lowbit.cli", "bench.kernels", "bench.attention", "bench.correctness"]
GPU_TEST_FILES = ["tests/test_kernels_linear.py", "tests/test_kernels_tuning.py", "tests/test_kernels_attention.py",
                  "tests/test_small_ops.py", "tests/test_engine.py", "tests/test_engine_prefill.py",
                  "tests/test_runtime.py", "tests/test_kernels_dense.py"]
# Packages the runtime never needs and the lent GPU machine's image lacks: what each is for. The env
# stage lists the absent ones; tests that need one skip (pytest.importorskip) and the tests stage
# reports them. (greenlet, for one, is imported only when a calibration pass runs.)
OPTIONAL_PACKAGES = {"greenlet": "calibration (GPTQ, AWQ, SignRound)", "gguf": "the bundled GGUF default model",
                     "lm_eval": "task accuracy (lowbit eval --tasks)", "compressed_tensors": "the interchange tests",
                     "starlette": "lowbit serve"}


def interpret_if(smoke: bool) -> None:
    """A smoke stage runs the kernels in the Triton interpreter: set before they are imported. Any
    other run compiles them (gpu_check never passes TRITON_INTERPRET to a real stage)."""
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"


def interpreter_problem(triton_version: str | None = None, numpy_version: str | None = None) -> str | None:
    """Why the Triton interpreter cannot run here (so --smoke cannot), or None. Triton 3.6's keeps
    ``program_id`` as a 1-element array under numpy >= 2.4, and every kernel fails (the lent GPU
    machine: triton 3.6.0, numpy 2.5.2)."""
    import numpy
    import triton

    triton_version, numpy_version = triton_version or triton.__version__, numpy_version or numpy.__version__

    def release(v):
        return tuple(int(p) for p in re.findall(r"\d+", v)[:2])

    if release(triton_version) <= (3, 6) and release(numpy_version) >= (2, 4):
        return (f"the Triton {triton_version} interpreter fails under numpy {numpy_version} (>= 2.4): "
                "--smoke checks this script on a CPU machine (CI does); on this one run the stages compiled")
    return None


def absent_packages() -> dict:
    """The OPTIONAL_PACKAGES this machine lacks: name -> what needs it."""
    return {name: need for name, need in OPTIONAL_PACKAGES.items() if importlib.util.find_spec(name) is None}


def stack_versions() -> dict:
    """What every result here is read with: torch (and its CUDA), Triton, transformers, numpy, python."""
    import numpy
    import torch
    import transformers
    import triton

    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": transformers.__version__, "numpy": numpy.__version__, "python": platform.python_version()}


def commit() -> str:
    if os.environ.get("LOWBIT_COMMIT"):
        return os.environ["LOWBIT_COMMIT"]
    from evals.provenance import commit as git_commit

    return git_commit()


def device_name(smoke: bool) -> str:
    import torch

    if smoke or not torch.cuda.is_available():
        return "cpu-smoke" if smoke else "no-cuda-device"
    return torch.cuda.get_device_name(0)


# ------------------------------------------------------------------------------- environment


def nvidia_smi() -> dict:
    fields = ["driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem", "power.draw",
              "power.limit", "temperature.gpu", "utilization.gpu", "memory.used"]
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip().splitlines()[0]
        return dict(zip(fields, (v.strip() for v in out.split(","))))
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        return {"error": f"nvidia-smi: {e}"}


def missing_imports() -> dict:
    """Module -> the error importing it, for each runtime/bench module that does not import here."""
    missing = {}
    for name in RUNTIME_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing[name] = f"{type(e).__name__}: {e}"
    return missing


def environment(smoke: bool, shard=(0, 1), report=None) -> dict:
    import torch

    from evals.diagnose import measure_ceilings
    from evals.provenance import device_info

    interpret_if(smoke)
    device = torch.device("cpu" if smoke else "cuda")
    info = {"commit": commit(), "device": device_info(device), "versions": stack_versions(),
            "absent_packages": absent_packages()}
    if info["absent_packages"]:
        print("absent here (the runtime does not need them; tests that do are skipped): "
              + "; ".join(f"{name} ({need})" for name, need in info["absent_packages"].items()))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["device"].update(sm_count=props.multi_processor_count, l2_bytes=getattr(props, "L2_cache_size", None))
        info["nvidia_smi"] = nvidia_smi()
    missing = missing_imports()
    if missing:
        packages = sorted({re.sub(r".*No module named '([^'.]+).*", r"\1", e) for e in missing.values()})
        info["carry"] = (f"missing on this machine: {', '.join(packages)}. Carry them as wheels: here, "
                         f"`make gpu-wheels PACKAGES=\"{' '.join(packages)}\"`, then name .whl in the device call's "
                         "carry and install them first (see the device tool's README).")
        print(info["carry"])
    ceilings = measure_ceilings(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    print(f"copy {ceilings['copy_bytes_per_s'] / 1e9:.0f} GB/s, matmul {ceilings['matmul_flops_per_s'] / 1e12:.1f} "
          f"TFLOP/s ({ceilings['method']})")
    return {"passed": not missing, **info, "missing_imports": missing, "ceilings": ceilings}


# ------------------------------------------------------------------------------- correctness


def _correctness(check: str, smoke: bool, shard: tuple[int, int], report) -> dict:
    interpret_if(smoke)
    from bench import correctness

    result = getattr(correctness, check)(smoke=smoke, shard=shard, on_result=report)
    print(f"{check}: {result['cases'] - len(result['failed'])}/{result['cases']} cases passed")
    for failure in result["failed"][:10]:
        print(f"  FAILED {json.dumps(failure, default=str)}")
    return result


def weights(smoke: bool, shard=(0, 1), report=None) -> dict:
    return _correctness("check_weights", smoke, shard, report)


def attention(smoke: bool, shard=(0, 1), report=None) -> dict:
    return _correctness("check_attention", smoke, shard, report)


def engine(smoke: bool, shard=(0, 1), report=None) -> dict:
    return _correctness("check_engine", smoke, shard, report)


def tests(smoke: bool, shard=(0, 1), report=None) -> dict:
    """The CUDA-capable test files, run compiled on the GPU (CI runs them in the interpreter; a
    smoke run only collects them): this shard's files one pytest each, reported as each ends."""
    i, n = shard
    files = [f for f in GPU_TEST_FILES if (ROOT / f).exists()][i::n]
    parts = []
    for file in files:
        parts.append(run_pytest([file], collect_only=smoke))
        if report:
            report(merge_shards(parts))
    result = merge_shards(parts) if parts else {"passed": True, "counts": {}, "files": []}
    result["absent_packages"] = absent_packages()
    if result.get("skipped_for_absent_packages"):
        print(f"skipped for absent packages: {sum(s['tests'] for s in result['skipped_for_absent_packages'])} "
              f"({', '.join(sorted(result['absent_packages']))})")
    return result


def merge_shards(parts: list[dict]) -> dict:
    """One stage result from its shards' (or a tests shard's files'): passed only if every part
    passed; lists joined, counts and cases added, the worst error kept, each part's error kept."""
    if len(parts) == 1:
        return parts[0]
    merged = {"passed": all(p.get("passed") for p in parts)}
    for part in parts:
        for key, value in part.items():
            if key in ("passed", "wall_s", "budget_s", "output_tail"):
                continue
            if isinstance(value, list):
                merged[key] = merged.get(key, []) + value
            elif key == "cases":
                merged[key] = merged.get(key, 0) + value
            elif key == "counts":
                merged[key] = {k: merged.get(key, {}).get(k, 0) + value.get(k, 0)
                               for k in {**merged.get(key, {}), **value}}
            elif key in ("worst_rel_error", "exit_code"):
                merged[key] = max(merged.get(key, value), value)
            elif key == "error":
                merged[key] = (merged[key] + "\n" if key in merged else "") + value
            else:
                merged.setdefault(key, value)
    if "failed" in merged:
        merged["failed"] = merged["failed"][:20]
    return merged


def run_pytest(files: list[str], collect_only: bool = False, args: tuple = (), env: dict | None = None) -> dict:
    """pytest on ``files``: pass/fail, counts, failures, and each skip with its reason (those naming
    an OPTIONAL_PACKAGES package apart: skipped for what this machine lacks, not failed)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-m", "not slow", *files, *args]
    if collect_only:
        cmd.append("--collect-only")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in proc.stdout:  # streamed: a stage cut at its budget still shows how far pytest got
        print(line, end="", flush=True)
        lines.append(line)
    proc.wait()
    text = "".join(lines)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|tests? collected)", text)}
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.M)
    skips = [{"tests": int(n), "reason": reason}  # pytest folds equal reasons into one line
             for n, reason in re.findall(r"^SKIPPED \[(\d+)\] (.+)$", text, flags=re.M)]
    absent = [s for s in skips if any(re.search(rf"\b{name}\b", s["reason"]) for name in OPTIONAL_PACKAGES)]
    return {"passed": proc.returncode == 0, "exit_code": proc.returncode, "counts": counts, "failures": failures,
            "skipped": skips, "skipped_for_absent_packages": absent, "files": files, "collect_only": collect_only}


# ------------------------------------------------------------------------------------- speed


def precompile(stage: str) -> dict | None:
    """The stage's quantized-matmul compiles done first, in parallel processes
    (``bench.gpu_compiles.precompile``); whatever goes wrong there, the stage compiles them itself."""
    from bench import gpu_compiles

    try:
        result = gpu_compiles.precompile(stage)
    except Exception as e:  # noqa: BLE001 - a failed head start costs its time, nothing else
        result = {"stage": stage, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(f"precompile: {json.dumps(result)}", flush=True)
    return result


def merged_kernel_record(record: dict | None, part: dict) -> dict:
    """``part`` (one bench/kernels.py run) added to ``record`` (None: it becomes the record): its
    rows and wall time, and the ratios over all rows recomputed."""
    from bench import kernels

    if record is None:
        record = part
    else:
        record["results"] += part["results"]
        record["wall_s"] += part["wall_s"]
    record["ratios"] = kernels.ratios(record["results"])
    return record


def bench_record(run) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        run(out)
        return json.loads(out.read_text())


def kernel_speed(smoke: bool, shard=(0, 1), report=None) -> dict:
    """bench/kernels.py one shape at a time (each run measures the ceilings again, ~1 s), so a cut
    stage keeps the shapes it finished; ratios and targets over all of them."""
    from bench import gpu_compiles, kernels

    head_start = None if smoke else precompile("kernel-speed")
    record = None
    for shape in [None] if smoke else kernels.SHAPES:
        argv = ["--smoke"] if smoke else ["--shapes", shape, "--ms", *map(str, gpu_compiles.KERNEL_SPEED_ROWS),
                                          "--samples", "20"]
        record = merged_kernel_record(record, bench_record(lambda out: kernels.main([*argv, "--out", str(out)])))
        record["targets"] = [] if smoke else kernels.targets(record["results"], record["ceilings"])
        if report:
            report({"passed": True, "versions": stack_versions(), "precompile": head_start, "record": record})
    return {"passed": True, "versions": stack_versions(), "precompile": head_start, "record": record}


def attention_speed(smoke: bool, shard=(0, 1), report=None) -> dict:
    """bench/attention.py one (batch, context) at a time, with its launch-configuration sweep (five
    configurations beside the default): a cut stage keeps the cases it finished."""
    from bench import attention as bench_attention

    record = None
    cases = [None] if smoke else [(b, c) for b in (1, 32) for c in (8192, 32768)]
    for case in cases:
        argv = ["--smoke"] if smoke else ["--batches", str(case[0]), "--contexts", str(case[1]), "--samples", "20"]
        part = bench_record(lambda out: bench_attention.main([*argv, "--out", str(out)]))
        if record is None:
            record = part
        else:
            record["rows"] += part["rows"]
        record["targets"] = [] if smoke else bench_attention.evaluate_targets(record["rows"],
                                                                             record["copy_bytes_per_s"])
        if report:
            report({"passed": True, "versions": stack_versions(), "record": record})
    return {"passed": True, "versions": stack_versions(), "record": record}


def engine_speed(smoke: bool, shard=(0, 1), report=None) -> dict:
    """lowbit bench's serving run: transformers' baseline first (a minute's work at most, and every
    'ahead of transformers' headline needs it), then fp16, W4, W4 + INT4 KV, each row saved as it
    ends (the W4 engine's start-up tunes every Linear at 24 M buckets: the long part)."""
    interpret_if(smoke)
    from evals import serving

    common = dict(smoke=smoke, batches=(1, 32), prompt_lens=(512,), output_len=128, arrivals=0, prefill_chunk=4096)
    baseline = serving.run(configs=(), baseline=True, **common)
    transformers_rows, head_start = baseline["transformers"], None

    def save(record):
        record["transformers"] = transformers_rows
        if report:
            report({"passed": True, "versions": stack_versions(), "precompile": head_start, "record": record})

    save(baseline)
    head_start = None if smoke else precompile("engine-speed")
    record = serving.run(configs=tuple(serving.CONFIGS), baseline=False, on_row=save, **common)
    record["transformers"] = transformers_rows
    print(serving.table(record))
    return {"passed": True, "versions": stack_versions(), "precompile": head_start, "record": record}
