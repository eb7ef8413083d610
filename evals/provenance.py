"""Where a number came from: device, library versions, commit. Every result lowbit writes carries these.

``provenance()`` is the one block every JSON result embeds (``lowbit eval``, ``plan``,
``diagnose``, speed runs); ``lowbit report`` refuses a run that lacks it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
# Bumped when the layout of a run's JSON changes; ``lowbit report`` names older runs.
RUN_FORMAT = 2


def lowbit_version() -> str:
    """The installed distribution's version (evals sits below lowbit, so it asks the metadata, not the package)."""
    try:
        return importlib.metadata.version("lowbit")
    except importlib.metadata.PackageNotFoundError:  # a bare source tree on PYTHONPATH, never installed
        return "unknown"


def versions() -> dict[str, str]:
    import safetensors
    import transformers

    return {
        "lowbit": lowbit_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
    }


@functools.lru_cache(maxsize=1)
def commit() -> str:
    """The short commit of the lowbit source tree, ``-dirty`` when it has uncommitted changes;
    ``unknown`` outside a git checkout (an installed wheel)."""
    try:
        sha = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                                      stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO, stderr=subprocess.DEVNULL).returncode != 0
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (else what ``platform`` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: str | torch.device = "cpu") -> dict:
    """What ran the numbers: the accelerator's name, or the CPU and how many cores torch used."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": props.name, "memory_bytes": props.total_memory,
                "capability": f"{props.major}.{props.minor}"}
    # the vector level ATen dispatches to (AVX2, AVX512, ...): a figure from one level says nothing of another
    return {"type": "cpu", "name": cpu_name(), "capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(),
            "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "platform": platform.platform()}


def describe_device(info: dict) -> str:
    if info.get("type") == "cuda":
        return f"{info['name']} (CUDA)"
    return f"CPU {info.get('name', '?')}, {info.get('threads', '?')} threads"


def provenance(device: str | torch.device = "cpu") -> dict:
    """The block every result carries: format version, device, versions, commit."""
    return {"format": RUN_FORMAT, "device": device_info(device), "versions": versions(), "commit": commit()}
