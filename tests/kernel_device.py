"""Where the attention-kernel tests run: compiled on CUDA, else in the Triton interpreter on CPU.
The interpreter is chosen when triton and each kernel are imported, so importing this first (as
tests/conftest.py does for a whole session) also serves a test module run on its own."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from runtime.kernels import attention as kernels  # noqa: E402

DEVICE = torch.device("cpu" if kernels.interpreting() else "cuda")
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("no GPU, and triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
