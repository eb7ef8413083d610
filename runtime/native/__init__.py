"""lowbit's own CPU kernels: C++ sources in this directory, compiled on first use for the CPU they
run on and cached, as Triton compiles the CUDA kernels at first launch.

PyTorch's CPU ops cover a quantized model's matmuls (``runtime.cpu_linear``), but not what fuses
unpacking low-bit codes into the work that reads them: dequantizing a 4-bit weight for a prefill
matmul took 6-8 ns per weight through a chain of tensor ops (each a pass over memory), and decode
attention over an INT4 cache wrote every code out as a float before the products read it. A kernel
here does such a pass once, in registers.

Each kernel is an optional backend: :func:`load` returns the compiled module, or None when it
cannot be built here (no C++ compiler or ninja, a failed build, ``LOWBIT_NATIVE=0``), with the
reason printed once per process; callers then keep their PyTorch path, which stays the reference
the tests compare against. Builds go to ``$LOWBIT_NATIVE_CACHE`` (default
``~/.cache/lowbit/native``), one directory per torch version and flags, a folder per kernel in it;
torch's JIT rebuilds when a source changes and takes a file lock, so concurrent processes build once.

Flags: ``-O3`` and the vector extensions PyTorch itself dispatches to on this CPU
(``torch.backends.cpu.get_cpu_capability()``), never ``-march=native`` (a native build of llama.cpp
died with SIGILL on a virtual machine whose CPU reported more than it ran).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from functools import lru_cache
from pathlib import Path

import torch

SOURCES = Path(__file__).parent
VECTOR_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


def enabled() -> bool:
    """Whether native kernels may be used (``LOWBIT_NATIVE=0`` turns them off: the PyTorch paths)."""
    return os.environ.get("LOWBIT_NATIVE", "1") != "0"


def flags() -> list[str]:
    """Compiler flags for this CPU (see the module docstring), and OpenMP where torch's ``at::parallel_for``
    runs on it: that template is compiled into each kernel (ATen/ParallelOpenMP.h), and without
    ``-fopenmp`` it calls its function once on the whole range, one thread. Linked, it shares torch's
    libgomp.so.1 (one OpenMP runtime: ``torch.set_num_threads`` holds for the kernels too)."""
    openmp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    return ["-O3", "-fno-math-errno", *VECTOR_FLAGS.get(torch.backends.cpu.get_cpu_capability(), []), *openmp]


def build_directory() -> Path:
    """Where this torch version's builds with this CPU's flags and these shared headers live (torch's
    JIT rebuilds when a kernel's .cpp changes, not when a header it includes does)."""
    root = Path(os.environ.get("LOWBIT_NATIVE_CACHE", Path.home() / ".cache" / "lowbit" / "native"))
    digest = hashlib.sha256(" ".join([torch.__version__, *flags()]).encode())
    for header in sorted(SOURCES.glob("*.h")):
        digest.update(header.read_bytes())
    key = digest.hexdigest()[:12]
    return root / f"torch-{torch.__version__.replace('+', '-')}-{key}"


def load(name: str):
    """The compiled module of ``runtime/native/<name>.cpp`` (built on first use), or None with the
    reason warned once when native kernels are off or cannot be built here."""
    if not enabled():
        return None
    return _build(name)


@lru_cache(maxsize=None)
def _build(name: str):
    reason = _missing_tool()
    if reason is None:
        try:
            from torch.utils.cpp_extension import load as jit_load

            # one folder per kernel: torch's JIT keeps one build.ninja and one lock per folder, and a
            # process waiting on another kernel's build there imported a module never built
            directory = build_directory() / name
            directory.mkdir(parents=True, exist_ok=True)
            return jit_load(f"lowbit_{name}", [str(SOURCES / f"{name}.cpp")], extra_cflags=flags(),
                            extra_ldflags=[f for f in flags() if f == "-fopenmp"],
                            build_directory=str(directory), verbose=False)
        except Exception as error:  # a compiler error, a missing header: the PyTorch path still works
            reason = f"building it failed ({type(error).__name__}: {str(error).strip().splitlines()[-1][:300]})"
    warnings.warn(f"lowbit's native CPU kernel {name!r} is not used: {reason}; the slower PyTorch path "
                  "runs instead (set LOWBIT_NATIVE=0 to silence this)", RuntimeWarning, stacklevel=3)
    return None


# A matmul kernel's paths (common.h's Path), slowest first: each kernel reports the fastest one that
# runs on this CPU and OS (``best_path()``), and runs any slower one it is asked for (tests, benches).
MATMUL_PATHS = ("portable", "avx512", "amx")


@lru_cache(maxsize=None)
def matmul_kernel(name: str):
    """A matmul kernel's module and the number of its fastest path here, or None when it cannot be
    built (looked up once: a decode step calls it for every Linear). Whether native kernels are
    switched on is the caller's check (:func:`enabled`), so the answer does not depend on when it
    was first asked."""
    module = _build(name)
    return None if module is None else (module, module.best_path())


def matmul_paths(name: str) -> list[str]:
    """The paths of a matmul kernel that run here, slowest first (empty: it cannot be built)."""
    kernel = matmul_kernel(name)
    return [] if kernel is None else list(MATMUL_PATHS[:kernel[1] + 1])


def forced_path(name: str, path: str) -> int:
    """The number of ``path`` for a kernel asked to run it, or a ValueError naming those that run here."""
    here = matmul_paths(name)
    if path not in here:
        raise ValueError(f"{name} path {path!r} cannot run here (this CPU's paths: {here})")
    return MATMUL_PATHS.index(path)


def _missing_tool() -> str | None:
    """Why nothing can be compiled here (no C++ compiler, no ninja), or None."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not on PATH; install g++ or clang, or set CXX)"
    try:
        from torch.utils.cpp_extension import verify_ninja_availability

        verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed (pip install ninja)"
    return None
