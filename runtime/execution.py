"""How the engine runs a forward: which cache rows it reads and writes, its inputs, its CUDA graphs.

The scheduler (``runtime.engine``) decides what runs; this module runs it without asking the
device anything. A decode step's inputs (token ids, start positions, lengths) are packed on the
host and go to the device in one copy; the block table changes only when a sequence crosses a
block boundary (``KVCache.take_blocks``), so a steady decode step has no host-device sync
before its logits come back.
"""

from __future__ import annotations

import itertools
import warnings

import torch
import torch.nn.functional as F

from kvquant import KVScheme
from runtime.cache import KVCache
from runtime.kernels import kv_reference as ref
from runtime.model import attention_mask


def step_inputs(tokens: list[int], starts: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [n, 1], starts [n], lengths after the step [n])`` on ``device``, int32, from one
    host tensor: one host-to-device copy for the whole step."""
    host = torch.tensor([tokens, starts, [s + 1 for s in starts]], dtype=torch.int32)
    packed = host.to(device, non_blocking=True)
    return packed[0, :, None], packed[1], packed[2]


class SequenceBatch:
    """Rows ``first .. first+count`` of the cache, sequence ``i`` writing at ``starts[i]``: what
    one forward of the engine reads and writes. ``runtime.model.Attention`` hands it each
    layer's new keys and values (``attend``).

    ``kernels``: the Triton ops over views of the cache tensors (GPU; the interpreter in tests).
    Otherwise each sequence stores its keys and values, reads back all of its cache dequantized
    and runs SDPA, exactly as the plain runtime (``KVCache.update`` + SDPA) does.
    ``starts_tensor`` and ``lengths``: ``starts`` on the device, and ``starts + T`` (decode:
    given by the caller, so no layer computes them).
    """

    def __init__(self, cache: KVCache, first: int, starts: list[int], kernels: bool,
                 starts_tensor: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
                 max_seq_len: int | None = None):
        self.cache, self.first, self.starts, self.kernels = cache, first, starts, kernels
        self.count = len(starts)
        self.starts_tensor = starts_tensor if starts_tensor is not None else torch.tensor(
            starts, dtype=torch.int32, device=cache.device)
        self.lengths = lengths
        self.max_seq_len = max_seq_len

    def attend(self, layer: int, q, k, v, mask, window):
        if self.kernels:
            rows = slice(self.first, self.first + self.count)
            start = self.starts[0] if k.shape[2] > 1 else None  # prefill: one sequence, start known on the host
            return kernel_attention(self.cache, layer, rows, self.starts_tensor, q, k, v, window, self.max_seq_len,
                                    start, self.lengths)
        return torch.cat([reference_attention(self.cache, layer, self.first + i, self.starts[i], q[i:i + 1], k[i],
                                              v[i], window) for i in range(self.count)])


class PackedBatch:
    """Prefill chunks of several sequences in one forward, packed end to end (no padding: every
    GEMM of the forward runs on exactly the prompt tokens, M = their sum, and each sequence's
    attention is causal from its own start, so no [T, S] mask has to hide padding).

    Sequence ``i`` (cache row ``slots[i]``) brings tokens ``token_ids[i]`` at positions
    ``starts[i] ..``. The token ids, their positions and the index of each sequence's last token
    (the only logits sampling needs) go to the device in one copy. ``attend`` stores each
    sequence's keys and values in its row and attends over its own cache, on the kernels or the
    reference: the computation a one-sequence forward does, so the same values.
    """

    def __init__(self, cache: KVCache, slots: list[int], starts: list[int], token_ids: list[list[int]],
                 kernels: bool):
        self.cache, self.slots, self.starts, self.kernels = cache, slots, starts, kernels
        ends = list(itertools.accumulate(len(t) for t in token_ids))
        self.bounds = list(zip([0] + ends[:-1], ends))
        n = ends[-1]
        positions = [s + j for s, ids in zip(starts, token_ids) for j in range(len(ids))]
        host = torch.tensor([i for ids in token_ids for i in ids] + positions + [e - 1 for e in ends],
                            dtype=torch.int32)
        packed = host.to(cache.device, non_blocking=True)
        self.input_ids, self.positions, self.logits_at = packed[:n], packed[n:2 * n], packed[2 * n:]

    def attend(self, layer: int, q, k, v, mask, window):
        """``q`` [1, Hq, N, D], ``k``/``v`` [1, Hk, N, D] packed; the attention [1, Hq, N, D]."""
        out = []
        for slot, start, (a, b) in zip(self.slots, self.starts, self.bounds):
            qi, ki, vi = q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]
            if self.kernels:
                rows = slice(slot, slot + 1)
                out.append(kernel_attention(self.cache, layer, rows, self.positions[a:a + 1], qi, ki, vi, window,
                                            start + b - a, start))
            else:
                out.append(reference_attention(self.cache, layer, slot, start, qi, ki[0], vi[0], window))
        return torch.cat(out, dim=2)


def kernel_attention(cache: KVCache, layer: int, rows: slice, starts, q, k, v, window, max_seq_len, start,
                     lengths=None):
    """The Triton kernels over cache ``rows`` in place (``kv_reference.paged_attention``)."""
    from runtime.kernels.attention import KERNEL_OPS

    c = cache
    paged = ref.PagedKV(c.pool[layer]["k"], c.pool[layer]["v"], c.residual_k[layer][rows], c.residual_v[layer][rows],
                        c.block_table[rows], c.scheme)
    mask = None if start is None else attention_mask(k.shape[2], start + k.shape[2], window, q.device)
    return ref.paged_attention(paged, starts, q, k, v, mask, window, KERNEL_OPS, max_seq_len=max_seq_len,
                               start=start, lengths=lengths)


def reference_attention(cache: KVCache, layer: int, slot: int, start: int, q, k, v, window):
    """One sequence (``q`` [1, Hq, T, D], ``k``/``v`` [Hk, T, D]): store, read its cache back
    dequantized, SDPA, as the plain runtime (``KVCache.update`` + SDPA) does."""
    T = k.shape[1]
    keys, values = cache.write_sequence(layer, slot, start, k, v)
    mask = attention_mask(T, start + T, window, q.device)
    return F.scaled_dot_product_attention(q, keys[None], values[None], attn_mask=mask,
                                          enable_gqa=q.shape[1] != keys.shape[0])


class DecodeGraph:
    """One decode step for ``batch`` rows captured in a CUDA graph: static token, position and
    length inputs, the attention kernels over views of the cache (no host sync, no allocation at
    replay). Rows past the live sequences are padding: free slots written at position 0 and ignored.

    ``capture=False`` runs the same padded step eagerly on the static inputs: what the tests run
    (in the Triton interpreter) to check everything but the capture itself."""

    def __init__(self, decoder, cache: KVCache, batch: int, capture: bool = True):
        device = cache.device
        self.batch = batch
        self.inputs = torch.zeros(3, batch, dtype=torch.int32, device=device)  # ids, starts, lengths
        self.inputs[2] = 1
        ids, starts, lengths = self.inputs[0, :, None], self.inputs[1], self.inputs[2]
        view = SequenceBatch(cache, 0, [0] * batch, kernels=True, starts_tensor=starts, lengths=lengths)
        self.step = lambda: decoder(ids, view, starts, last_only=True)
        self.graph = None
        if capture:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side), torch.inference_mode():  # warm-up: Triton autotuning and compilation
                for _ in range(2):
                    self.step()
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), torch.inference_mode():
                self.logits = self.step()

    def run(self, tokens: list[int], starts: list[int]) -> torch.Tensor:
        """Logits [n, 1, V] of the live rows; the inputs go in with one copy (padding: id 0 at 0)."""
        n, pad = len(starts), self.batch - len(starts)
        host = torch.tensor([tokens + [0] * pad, starts + [0] * pad, [s + 1 for s in starts] + [1] * pad],
                            dtype=torch.int32)
        self.inputs.copy_(host, non_blocking=True)
        if self.graph is None:
            return self.step()[:n]
        self.graph.replay()
        return self.logits[:n]


def warm_matmul_tuning(decoder, largest_m: int) -> int:
    """Tune every quantized layer's GEMM for each M bucket up to ``largest_m`` now (CUDA), so no
    request pays a tuning stall; returns how many (layer, M) pairs were asked. Nothing to do
    where the layers run the dense reference (CPU)."""
    from runtime.linear import QuantLinear

    layers = [m for m in decoder.modules() if isinstance(m, QuantLinear) and m._kernel is not None]
    if not layers:
        return 0
    from runtime.kernels.quant_matmul import choose_config

    sizes = [1 << i for i in range(max(largest_m, 1).bit_length())] + [largest_m]
    dtype = next(decoder.parameters()).dtype
    for m in layers:
        for M in sizes:
            choose_config(M, m._kernel, dtype, m._kernel.qweight.device)
    return len(layers) * len(sizes)


def kernels_for(scheme: KVScheme, head_dim: int, dtype: torch.dtype, device: torch.device,
                attention: str = "auto") -> bool:
    """Whether the engine runs the Triton attention kernels: ``auto`` on CUDA when they take this
    cache (else the reference, with a warning), ``triton`` always (an error if they cannot;
    on CPU it needs the interpreter), ``reference`` never."""
    if attention not in ("auto", "triton", "reference"):
        raise ValueError(f"attention must be auto, triton or reference, got {attention!r}")
    if attention == "reference" or (attention == "auto" and device.type != "cuda"):
        return False
    from runtime.kernels.attention import unsupported_reason

    reason = unsupported_reason(scheme, head_dim, dtype, device)
    if reason is None:
        return True
    if attention == "triton":
        raise ValueError(f"KV cache {scheme.name}: the Triton attention kernels do not support {reason}")
    warnings.warn(f"KV cache {scheme.name}: no attention kernel for {reason} on {device}; the engine runs the "
                  "PyTorch reference per sequence (correct, slow)")
    return False
