"""What the paged-cache Triton kernels share (decode attention in ``attention.py``, the
quantize-on-write in ``kv_write.py``): which caches they take, and the launch helpers."""

from __future__ import annotations

import torch
import triton.language as tl

from kvquant import KVScheme
from runtime.kernels.kv_reference import PagedKV

TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def unsupported_reason(scheme: KVScheme, head_dim: int, dtype: torch.dtype, device=None) -> str | None:
    """Why the kernels cannot serve this cache, or None when they can: the ``triton`` attention
    backend's refusal (``runtime/attention_backends/triton.py``), which the choice of backend reads;
    the kernels themselves check it again at launch (:func:`require_supported`)."""
    family = scheme.definition
    if not family.kernels:
        return f"the {family.name} family (it declares no Triton kernel)"
    c = family.kernel_constants(scheme)
    B, G = scheme.block_size, c["G"]
    if dtype not in TL_DTYPES:
        return f"model dtype {dtype} (the kernels take float16, bfloat16 and float32)"
    if not (pow2(head_dim) and 16 <= head_dim <= 256):
        return f"head_dim {head_dim} (the kernels take powers of two from 16 to 256)"
    if not (pow2(B) and B >= 16):
        return f"block size (residual) {B} (the kernels take powers of two >= 16)"
    if G is not None and not (pow2(G) and G >= 16):
        return f"group_size {G} (the kernels take powers of two >= 16)"
    if c["FP8"] and device is not None and torch.device(device).type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 9):
            return "FP8 on a GPU older than compute capability 8.9"
    return None


def supported(scheme: KVScheme, head_dim: int, dtype: torch.dtype, device=None) -> bool:
    return unsupported_reason(scheme, head_dim, dtype, device) is None


def require_supported(paged: PagedKV) -> None:
    reason = unsupported_reason(paged.scheme, paged.head_dim, paged.dtype, paged.residual_k.device)
    if reason:
        raise ValueError(f"KV cache scheme {paged.scheme.name}: the Triton attention kernels do not support {reason}; "
                         "use runtime.kernels.kv_reference instead")


def scheme_constants(paged: PagedKV) -> dict:
    """The constexprs the scheme's family declares (``KVFamily.kernel_constants``), with the block
    and head sizes; G is the whole head where the family groups nothing."""
    c = paged.scheme.definition.kernel_constants(paged.scheme)
    return dict(B=paged.scheme.block_size, D=paged.head_dim, G=c["G"] or paged.head_dim,
                BITS=c["BITS"], FP8=c["FP8"], KIVI=c["KIVI"])


def placeholder(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Schemes without scale or zero still pass a pointer (never read)."""
    return like if t is None else t
