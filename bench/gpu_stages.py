"""The stages of bench/gpu_check.py, each a function ``(smoke) -> dict`` run in its own child
process, and the headline table made from their results.

A stage's dict has ``passed`` (it ran and what it checks held) and its raw data. Speed stages
pass when their benchmark ran (each checks its kernels' output before timing them); whether the
speed met its target is a headline, reported beside, never hidden in ``passed``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
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
                  "tests/test_runtime.py"]
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


def environment(smoke: bool) -> dict:
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


def _correctness(check: str, smoke: bool) -> dict:
    interpret_if(smoke)
    from bench import correctness

    result = getattr(correctness, check)(smoke=smoke)
    print(f"{check}: {result['cases'] - len(result['failed'])}/{result['cases']} cases passed")
    for failure in result["failed"][:10]:
        print(f"  FAILED {json.dumps(failure, default=str)}")
    return result


def weights(smoke: bool) -> dict:
    return _correctness("check_weights", smoke)


def attention(smoke: bool) -> dict:
    return _correctness("check_attention", smoke)


def engine(smoke: bool) -> dict:
    return _correctness("check_engine", smoke)


def tests(smoke: bool) -> dict:
    """The CUDA-capable test files, run compiled on the GPU (CI runs them in the interpreter; a
    smoke run only collects them)."""
    files = [f for f in GPU_TEST_FILES if (ROOT / f).exists()]
    result = run_pytest(files, collect_only=smoke)
    result["absent_packages"] = absent_packages()
    if result["skipped_for_absent_packages"]:
        print(f"skipped for absent packages: {sum(s['tests'] for s in result['skipped_for_absent_packages'])} "
              f"({', '.join(sorted(result['absent_packages']))})")
    return result


def run_pytest(files: list[str], collect_only: bool = False, args: tuple = (), env: dict | None = None) -> dict:
    """pytest on ``files``: pass/fail, counts, failures, and each skip with its reason (those naming
    an OPTIONAL_PACKAGES package apart: skipped for what this machine lacks, not failed)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-m", "not slow", *files, *args]
    if collect_only:
        cmd.append("--collect-only")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    print(proc.stdout[-6000:], proc.stderr[-2000:])
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|tests? collected)", proc.stdout)}
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, flags=re.M)
    skips = [{"tests": int(n), "reason": reason}  # pytest folds equal reasons into one line
             for n, reason in re.findall(r"^SKIPPED \[(\d+)\] (.+)$", proc.stdout, flags=re.M)]
    absent = [s for s in skips if any(re.search(rf"\b{name}\b", s["reason"]) for name in OPTIONAL_PACKAGES)]
    return {"passed": proc.returncode == 0, "exit_code": proc.returncode, "counts": counts, "failures": failures,
            "skipped": skips, "skipped_for_absent_packages": absent, "files": files, "collect_only": collect_only}


# ------------------------------------------------------------------------------------- speed


def _bench_record(run) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        run(out)
        return json.loads(out.read_text())


def kernel_speed(smoke: bool) -> dict:
    from bench import kernels

    argv = ["--smoke"] if smoke else ["--ms", "1", "16", "4096", "--samples", "20"]
    record = _bench_record(lambda out: kernels.main([*argv, "--out", str(out)]))
    return {"passed": True, "versions": stack_versions(), "record": record}


def attention_speed(smoke: bool) -> dict:
    from bench import attention as bench_attention

    argv = ["--smoke"] if smoke else ["--batches", "1", "32", "--contexts", "8192", "32768", "--samples", "20"]
    record = _bench_record(lambda out: bench_attention.main([*argv, "--no-sweep", "--out", str(out)]))
    return {"passed": True, "versions": stack_versions(), "record": record}


def engine_speed(smoke: bool) -> dict:
    interpret_if(smoke)
    from evals import serving

    record = serving.run(smoke=smoke, configs=tuple(serving.CONFIGS), batches=(1, 32), prompt_lens=(512,),
                         output_len=128, arrivals=0, baseline=True, prefill_chunk=4096)
    print(serving.table(record))
    return {"passed": True, "versions": stack_versions(), "record": record}


# ---------------------------------------------------------------------------------- headlines

ENGINE_TARGETS = {"w4_itl_vs_fp16": 2.8, "w4_int4kv_itl_vs_fp16": 3.0, "bandwidth_floor_fraction": 0.7}


def _engine_headlines(record: dict, copy_bw: float | None) -> list[dict]:
    batch1 = {r["config"]: r for r in record["engine"] if r.get("batch") == 1 and "mode" not in r}
    out = []

    def itl(config):
        r = batch1.get(config)
        return r and r["itl_s"]["mean"]

    for config, key in (("w4g128", "w4_itl_vs_fp16"), ("w4g128+kv-int4", "w4_int4kv_itl_vs_fp16")):
        if itl(config) and itl("fp16"):
            ratio = itl("fp16") / itl(config)
            out.append({"target": f"{config} batch-1 ITL >= {ENGINE_TARGETS[key]}x faster than fp16 "
                                  f"(prompt {batch1[config]['prompt_len']})",
                        "measured": round(ratio, 3), "met": ratio >= ENGINE_TARGETS[key]})
    for config, r in batch1.items():
        if copy_bw and r.get("bytes_per_step") and r["itl_s"]["mean"]:
            frac = r["bytes_per_step"] / copy_bw / r["itl_s"]["mean"]
            goal = ENGINE_TARGETS["bandwidth_floor_fraction"]
            out.append({"target": f"{config} batch-1 ITL >= {goal:.0%} of the bandwidth floor",
                        "measured": round(frac, 3), "met": frac >= goal})
    hf = {(r["batch"], r["prompt_len"]): r["output_tokens_per_s"] for r in record.get("transformers", [])}
    for r in record["engine"]:
        base = hf.get((r.get("batch"), r.get("prompt_len")))
        if base:
            ratio = r["output_tokens_per_s"] / base
            out.append({"target": f"{r['config']} batch {r['batch']} prompt {r['prompt_len']} ahead of "
                                  "transformers fp16 (tok/s)",
                        "measured": round(ratio, 3), "met": ratio > 1.0})
    return out


def headlines(stages: dict) -> dict:
    """Per stage: the lines of the table (targets with measured values, or check counts)."""
    copy_bw = stages.get("env", {}).get("ceilings", {}).get("copy_bytes_per_s")
    out = {}
    for name, s in stages.items():
        if "error" in s:
            out[name] = [{"target": "stage ran", "measured": s["error"].strip().splitlines()[-1][:160], "met": False}]
        elif name == "env":
            c = s["ceilings"]
            v = s["versions"]
            out[name] = [{"target": "ceilings", "measured": f"copy {c['copy_bytes_per_s'] / 1e9:.0f} GB/s, matmul "
                                                            f"{c['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s", "met": None},
                         {"target": "stack", "measured": f"torch {v['torch']}, triton {v['triton']}, "
                                                         f"numpy {v['numpy']}", "met": None},
                         {"target": "absent optional packages",
                          "measured": ", ".join(s.get("absent_packages", {})) or "none", "met": None}]
        elif name in ("weights", "attention", "engine"):
            good = s["cases"] - len(s["failed"])
            worst = f", worst rel. error {s['worst_rel_error']:.1e}" if "worst_rel_error" in s else ""
            out[name] = [{"target": "cases correct", "measured": f"{good}/{s['cases']}{worst}", "met": s["passed"]}]
        elif name == "tests":
            absent = sum(skip["tests"] for skip in s.get("skipped_for_absent_packages", []))
            out[name] = [{"target": "pytest", "measured": ", ".join(f"{n} {k}" for k, n in s["counts"].items())
                          + (f" ({absent} for absent {', '.join(s['absent_packages'])})" if absent else ""),
                          "met": s["passed"]}]
        elif name == "kernel-speed":
            out[name] = s["record"].get("targets", []) + _peer_headlines(s["record"])
        elif name == "attention-speed":
            out[name] = s["record"].get("targets", [])
        elif name == "engine-speed":
            out[name] = _engine_headlines(s["record"], copy_bw)
        if "versions" in s and name in out:  # a speed figure is read with the stack that made it
            for line in out[name]:
                line["versions"] = f"torch {s['versions']['torch']}, triton {s['versions']['triton']}"
    return out


def _peer_headlines(record: dict) -> list[dict]:
    """Per row count M: our speed-up over cuBLAS fp16 and over PyTorch's int4 kernel, as the geometric
    mean over the shapes where both ran (no target: the peer is there to read ours against)."""
    lines = []
    for M in sorted({r["M"] for r in record.get("ratios", [])}):
        for peer in ("torch_fp16", "torch_int4"):
            got = [r[f"vs_{peer}"] for r in record["ratios"] if r["M"] == M and r.get(f"vs_{peer}")]
            if got:
                mean = math.exp(sum(math.log(v) for v in got) / len(got))
                lines.append({"target": f"M={M} vs {peer.replace('_', '-')} (geomean of {len(got)} shapes)",
                              "measured": round(mean, 3), "met": None})
    return lines


def summary_table(record: dict, names: list[str]) -> str:
    versions = next((s["versions"] for s in record["stages"].values() if "versions" in s), None)
    lines = [f"gpu_check on {record['device']}, commit {record['commit']}"
             + (f", torch {versions['torch']}, triton {versions['triton']}" if versions else "")
             + (" (SMOKE: CPU interpreter, no timing means anything)" if record.get("smoke") else ""),
             f"{'stage':<16} {'result':<6} {'wall':>7}  headline",
             "-" * 100]
    for name in names:
        s = record["stages"][name]
        heads = record["headlines"].get(name) or [{"target": "no targets (smoke, or none measured)",
                                                   "measured": "-", "met": None}]
        for i, h in enumerate(heads):
            met = "" if h["met"] is None else ("  [met]" if h["met"] else "  [NOT met]")
            left = f"{name:<16} {'pass' if s.get('passed') else 'FAIL':<6} {s['wall_s']:>6.0f}s" if i == 0 else " " * 31
            measured = f"{h['measured']:.3g}" if isinstance(h["measured"], float) else h["measured"]
            lines.append(f"{left}  {h['target']}: {measured}{met}")
    return "\n".join(lines)
