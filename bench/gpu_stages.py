"""The stages of bench/gpu_check.py, each a function ``(smoke) -> dict`` run in its own child
process, and the headline table made from their results.

A stage's dict has ``passed`` (it ran and what it checks held) and its raw data. Speed stages
pass when their benchmark ran (each checks its kernels' output before timing them); whether the
speed met its target is a headline, reported beside, never hidden in ``passed``.
"""

from __future__ import annotations

import importlib
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
GPU_TEST_FILES = ["tests/test_kernels_linear.py", "tests/test_kernels_attention.py", "tests/test_small_ops.py",
                  "tests/test_engine.py", "tests/test_engine_prefill.py", "tests/test_runtime.py"]


def interpret_if(smoke: bool) -> None:
    """A smoke stage runs the kernels in the Triton interpreter: set before they are imported."""
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"


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
    import transformers
    import triton

    from evals.diagnose import measure_ceilings
    from evals.provenance import device_info

    interpret_if(smoke)
    device = torch.device("cpu" if smoke else "cuda")
    info = {"commit": commit(), "device": device_info(device),
            "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
                         "transformers": transformers.__version__, "python": platform.python_version()}}
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
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-m", "not slow", *files]
    if smoke:
        cmd.append("--collect-only")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(proc.stdout[-6000:], proc.stderr[-2000:])
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|tests? collected)", proc.stdout)}
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, flags=re.M)
    return {"passed": proc.returncode == 0, "exit_code": proc.returncode, "counts": counts, "failures": failures,
            "files": files, "collect_only": smoke}


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
    return {"passed": True, "record": record}


def attention_speed(smoke: bool) -> dict:
    from bench import attention as bench_attention

    argv = ["--smoke"] if smoke else ["--batches", "1", "32", "--contexts", "8192", "32768", "--samples", "20"]
    record = _bench_record(lambda out: bench_attention.main([*argv, "--no-sweep", "--out", str(out)]))
    return {"passed": True, "record": record}


def engine_speed(smoke: bool) -> dict:
    interpret_if(smoke)
    from evals import serving

    record = serving.run(smoke=smoke, configs=tuple(serving.CONFIGS), batches=(1, 32), prompt_lens=(512,),
                         output_len=128, arrivals=0, baseline=True, prefill_chunk=4096)
    print(serving.table(record))
    return {"passed": True, "record": record}


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
            out[name] = [{"target": "ceilings", "measured": f"copy {c['copy_bytes_per_s'] / 1e9:.0f} GB/s, matmul "
                                                            f"{c['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s", "met": None}]
        elif name in ("weights", "attention", "engine"):
            good = s["cases"] - len(s["failed"])
            worst = f", worst rel. error {s['worst_rel_error']:.1e}" if "worst_rel_error" in s else ""
            out[name] = [{"target": "cases correct", "measured": f"{good}/{s['cases']}{worst}", "met": s["passed"]}]
        elif name == "tests":
            out[name] = [{"target": "pytest", "measured": ", ".join(f"{n} {k}" for k, n in s["counts"].items()),
                          "met": s["passed"]}]
        elif name in ("kernel-speed", "attention-speed"):
            out[name] = s["record"].get("targets", [])
        elif name == "engine-speed":
            out[name] = _engine_headlines(s["record"], copy_bw)
    return out


def summary_table(record: dict, names: list[str]) -> str:
    lines = [f"gpu_check on {record['device']}, commit {record['commit']}"
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
