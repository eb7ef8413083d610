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

# The suite compares the runtime with references at float32 precision, so quantized Linears on CPU
# run the dense reference; tests/test_cpu_linear.py runs PyTorch's CPU kernels (bf16 activations).
os.environ.setdefault("LOWBIT_CPU_KERNELS", "0")


@pytest.fixture(scope="session")
def sass_reports(tmp_path_factory) -> list[dict]:
    """Every kernel case of bench/sass.py compiled for sm_90a, once per session (Triton's own
    ptxas and cuobjdump: no GPU needed; compiled, so the interpreter is off in the child)."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this triton build has no NVIDIA backend (ptxas, cuobjdump)")
    root = Path(__file__).resolve().parent.parent
    out = tmp_path_factory.mktemp("sass") / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    run = subprocess.run([sys.executable, str(root / "bench" / "sass.py"), "--arch", "sm_90a", "--json", str(out)],
                         capture_output=True, text=True, env=env, cwd=root, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())["reports"]
