"""Session setup shared by the test modules."""

import os

import torch

# Triton kernels are tested in the Triton interpreter on machines without a GPU. The interpreter
# is picked when triton and each kernel are imported, and transformers imports triton as a side
# effect, so the variable has to be set before any test module is collected. Without CUDA no
# compiled Triton kernel can run anyway, so this changes nothing else; with CUDA it is left
# alone and the kernel tests run compiled on the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
