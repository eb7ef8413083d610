"""The KV budget: how many bytes the engine's cache takes and how many pages that buys.

Without ``kv_memory`` the budget is every slot at ``max_len`` (sliding layers' rings counted),
capped by :func:`default_budget`: on CUDA a share of the free GPU memory, on CPU a share of
the memory available at start-up (psutil; a fixed figure without it), so a CPU engine no longer
asks for ``max_batch`` full contexts whatever they cost. A cap that cannot hold even one
sequence of ``max_len`` is an error that says what to change.
"""

from __future__ import annotations

import torch

from kvquant import KVScheme
from kvquant.memory import layer_groups, residual_bytes
from kvquant.quantize import block_bytes
from runtime.units import parse_bytes

# Without kv_memory on CPU the budget is capped at this share of the memory available at start-up
# (psutil), or at CPU_FALLBACK_BYTES where psutil is not installed: max_batch full contexts of a
# small model already reach ~12 GB (SmolLM2-360M, 32 x 8192 tokens, fp16).
CPU_MEMORY_FRACTION = 0.5
CPU_FALLBACK_BYTES = 4 * 2**30
CUDA_MEMORY_FRACTION = 0.8  # of the free GPU memory: activations and CUDA graphs need the rest


def default_budget(device: torch.device) -> tuple[int, str]:
    """The most bytes a KV cache takes without ``kv_memory``, and where the figure comes from."""
    if device.type == "cuda":
        return int(CUDA_MEMORY_FRACTION * torch.cuda.mem_get_info(device)[0]), \
            f"{CUDA_MEMORY_FRACTION:.0%} of the free GPU memory"
    try:
        import psutil
    except ImportError:
        return CPU_FALLBACK_BYTES, f"{CPU_FALLBACK_BYTES / 2**30:.0f} GiB (psutil is not installed)"
    return int(CPU_MEMORY_FRACTION * psutil.virtual_memory().available), \
        f"{CPU_MEMORY_FRACTION:.0%} of the available memory"


def cache_size(model, scheme: KVScheme, kv_memory, max_batch: int, max_len: int) -> tuple[int, int]:
    """``(budget, pool pages)``: the slots' residual blocks come first, pages take the rest.
    Default budget: every slot at ``max_len`` (sliding layers' rings counted), capped by
    :func:`default_budget`; an error when that cap cannot hold one sequence of ``max_len``."""
    cfg = model.decoder.cfg
    groups = layer_groups(cfg.sliding_windows, max_len)
    page = groups.size * cfg.num_kv_heads * block_bytes(scheme, cfg.head_dim, model.dtype)
    per_slot = residual_bytes(scheme, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    if kv_memory is not None:
        budget = parse_bytes(kv_memory)
    else:
        pages = groups.pages(max_len, scheme.block_size)
        cap, source = default_budget(model.device)
        one = per_slot + pages * page
        if one * max_batch > cap and (cap - max_batch * per_slot) // page < pages:
            raise ValueError(
                f"the default KV budget ({cap:,} bytes: {source}) cannot hold one sequence of max_len {max_len:,} "
                f"tokens beside {max_batch} slots ({one:,} bytes each, {scheme.name}); pass kv_memory, or lower "
                f"max_len or max_batch")
        budget = min(max_batch * one, cap)
    blocks = (budget - max_batch * per_slot) // page
    if blocks < 1:
        raise ValueError(
            f"a KV budget of {budget:,} bytes holds no cache block beside {max_batch} slots' residual blocks "
            f"({per_slot:,} bytes each, {scheme.name}); raise kv_memory or lower max_batch")
    return budget, int(blocks)
