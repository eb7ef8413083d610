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
``~/.cache/lowbit/native``), one directory per torch version, level and headers, a folder per kernel in it;
torch's JIT rebuilds when a source changes and takes a file lock, so concurrent processes build once.

Levels: each kernel is built once per instruction-set level it is asked at (:data:`LEVELS`: ``avx2``
AVX2+FMA+F16C, ``avx512`` F/BW/VL/DQ, ``avx512bf16`` + AVX512_BF16 and VBMI, ``amx`` + AMX-TILE/BF16/
INT8; ``portable`` the compiler's baseline, and the only level off x86), with that level's flags
(:data:`LEVEL_FLAGS`) and a folder of its own; every ``.cpp`` compiles at every level, its faster
sections behind common.h's ``LOWBIT_HAS_*``. :func:`load` picks the highest level this CPU *and OS*
run (:func:`cpu_levels`: CPUID, XGETBV's saved register state, Linux's AMX permission; a tiny probe,
cpu_level.cpp, compiled without torch), capped by ``LOWBIT_NATIVE_LEVEL`` (e.g. ``avx2`` on an
AVX-512 machine, as ``ATEN_CPU_CAPABILITY=avx2`` does for PyTorch), and ``load(name, level=...)``
builds any lower one (tests and benches run the AVX2 code on an AVX-512 machine). :func:`level`
says which level a plain :func:`load` gets (``lowbit doctor``, result files). Never
``-march=native`` (a native build of llama.cpp died with SIGILL on a virtual machine whose CPU
reported more than it ran).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from functools import lru_cache
from pathlib import Path

import torch

SOURCES = Path(__file__).parent
PROBE = SOURCES  # where cpu_level.cpp is (tests point SOURCES elsewhere)
LEVELS = ("portable", "avx2", "avx512", "avx512bf16", "amx")  # lowest first: common.h's Level
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
_AVX512BF16 = [*_AVX512, "-mavx512bf16", "-mavx512vbmi"]
LEVEL_FLAGS = {
    "portable": [],
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512bf16": _AVX512BF16,
    "amx": [*_AVX512BF16, "-mamx-tile", "-mamx-bf16", "-mamx-int8"],
}


def enabled() -> bool:
    """Whether native kernels may be used (``LOWBIT_NATIVE=0`` turns them off: the PyTorch paths)."""
    return os.environ.get("LOWBIT_NATIVE", "1") != "0"


def x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def flags(level: str | None = None) -> list[str]:
    """Compiler flags for ``level`` (default :func:`level`; see the module docstring), and OpenMP where
    torch's ``at::parallel_for`` runs on it: that template is compiled into each kernel
    (ATen/ParallelOpenMP.h), and without ``-fopenmp`` it calls its function once on the whole range,
    one thread. Linked, it shares torch's libgomp.so.1 (one OpenMP runtime: ``torch.set_num_threads``
    holds for the kernels too)."""
    openmp = ["-fopenmp"] if torch.backends.openmp.is_available() else []
    return ["-O3", "-fno-math-errno", *LEVEL_FLAGS[_known(level or _default_level())], *openmp]


def build_directory(level: str | None = None) -> Path:
    """Where this torch version's builds at ``level`` (default :func:`level`) with these shared headers
    live (torch's JIT rebuilds when a kernel's .cpp changes, not when a header it includes does)."""
    level = _known(level or _default_level())
    root = Path(os.environ.get("LOWBIT_NATIVE_CACHE", Path.home() / ".cache" / "lowbit" / "native"))
    digest = hashlib.sha256(" ".join([torch.__version__, *flags(level)]).encode())
    for header in sorted(SOURCES.glob("*.h")):
        digest.update(header.read_bytes())
    key = digest.hexdigest()[:12]
    return root / f"torch-{torch.__version__.replace('+', '-')}-{level}-{key}"


def cpu_levels() -> tuple[str, ...]:
    """The levels this CPU and OS run, lowest first (``("portable",)`` off x86, or where the probe
    cannot be built: no compiler)."""
    return LEVELS[:_cpu_level() + 1]


def level() -> str:
    """The level :func:`load` builds and loads by default: the highest of :func:`cpu_levels`, or
    ``LOWBIT_NATIVE_LEVEL`` where that is lower (a ValueError where it names no level)."""
    return _default_level()


def _default_level() -> str:  # level(), for the functions whose argument is named level
    here = cpu_levels()
    cap = os.environ.get("LOWBIT_NATIVE_LEVEL")
    if cap:
        return here[min(LEVELS.index(_known(cap, "LOWBIT_NATIVE_LEVEL")), len(here) - 1)]
    return here[-1]


def load(name: str, level: str | None = None):
    """The compiled module of ``runtime/native/<name>.cpp`` at ``level`` (default :func:`level`; built
    on first use), or None with the reason warned once when native kernels are off or cannot be built
    here. A level above this CPU's is a ValueError (its code would fault on the first instruction)."""
    if not enabled():
        return None
    return _build(name, _runnable(level))


def _known(level: str, what: str = "level") -> str:
    if level not in LEVELS:
        raise ValueError(f"{what} {level!r} is none of lowbit's native levels {LEVELS}")
    return level


def _runnable(level: str | None) -> str:
    """``level`` (default :func:`level`), checked to run on this CPU and OS."""
    if level is None:
        return _default_level()
    here = cpu_levels()
    if _known(level) not in here:
        raise ValueError(f"native level {level!r} cannot run on this CPU (it runs {here})")
    return level


@lru_cache(maxsize=None)
def _cpu_level() -> int:
    """common.h's cpu_level() through cpu_level.cpp, built once per source into the cache; 0 off x86 or
    without a compiler (load() then says why it builds nothing)."""
    if not x86() or _missing_tool() is not None:
        return 0
    source = PROBE / "cpu_level.cpp"
    digest = hashlib.sha256(source.read_bytes() + (PROBE / "common.h").read_bytes()).hexdigest()[:12]
    root = Path(os.environ.get("LOWBIT_NATIVE_CACHE", Path.home() / ".cache" / "lowbit" / "native"))
    library = root / f"cpu_level-{digest}.so"
    if not library.exists():
        root.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.tmp")  # renamed whole: a concurrent process never loads half
        try:
            subprocess.run([os.environ.get("CXX", "c++"), "-O2", "-shared", "-fPIC", str(source), "-o", str(partial)],
                           check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as error:
            warnings.warn(f"lowbit's CPU level probe did not build ({error.stderr.strip()[-300:]}); native "
                          "kernels build at the portable level", RuntimeWarning, stacklevel=2)
            return 0
        os.replace(partial, library)
    return int(ctypes.CDLL(str(library)).lowbit_cpu_level())


@lru_cache(maxsize=None)
def _build(name: str, level: str):
    reason = _missing_tool()
    if reason is None:
        try:
            from torch.utils.cpp_extension import load as jit_load

            # one folder per kernel and level: torch's JIT keeps one build.ninja and one lock per folder,
            # and a process waiting on another kernel's build there imported a module never built
            directory = build_directory(level) / name
            directory.mkdir(parents=True, exist_ok=True)
            # the level in the module's name: two levels of one kernel load side by side in a process
            return jit_load(f"lowbit_{name}_{level}", [str(SOURCES / f"{name}.cpp")], extra_cflags=flags(level),
                            extra_ldflags=[f for f in flags(level) if f == "-fopenmp"],
                            build_directory=str(directory), verbose=False)
        except Exception as error:  # a compiler error, a missing header: the PyTorch path still works
            reason = (f"building it at level {level} failed ({type(error).__name__}: "
                      f"{str(error).strip().splitlines()[-1][:300]})")
    warnings.warn(f"lowbit's native CPU kernel {name!r} is not used: {reason}; the slower PyTorch path runs "
                  "instead (set LOWBIT_NATIVE=0 to silence this)", RuntimeWarning, stacklevel=3)
    return None


# A matmul kernel's paths (common.h's Path), slowest first: each build reports the fastest one its level
# has and this process may run (``best_path()``), and runs any slower one it is asked for (tests,
# benches). ``avx2`` is what the avx2 and avx512 levels run; ``avx512`` is AVX512-BF16's.
MATMUL_PATHS = ("portable", "avx2", "avx512", "amx")


@lru_cache(maxsize=None)
def matmul_kernel(name: str, level: str | None = None):
    """A matmul kernel's module at ``level`` (default :func:`level`) and the number of its fastest path,
    or None when it cannot be built (looked up once: a decode step calls it for every Linear). Whether
    native kernels are switched on is the caller's check (:func:`enabled`), so the answer does not
    depend on when it was first asked."""
    module = _build(name, _runnable(level))
    return None if module is None else (module, module.best_path())


def matmul_paths(name: str, level: str | None = None) -> list[str]:
    """The paths of a matmul kernel that run here at ``level``, slowest first (empty: it cannot be built)."""
    kernel = matmul_kernel(name, level)
    return [] if kernel is None else list(MATMUL_PATHS[:kernel[1] + 1])


def forced_path(name: str, path: str, level: str | None = None) -> int:
    """The number of ``path`` for a kernel asked to run it, or a ValueError naming those that run here."""
    here = matmul_paths(name, level)
    if path not in here:
        raise ValueError(f"{name} path {path!r} cannot run here (this CPU's paths at level "
                         f"{level or _default_level()}: {here})")
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
