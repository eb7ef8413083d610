"""Execution: the forwards a step runs, their inputs, the CUDA graphs, and sampling.

The scheduler (``runtime.scheduler``) decides what runs; :class:`Executor` runs it without
asking the device anything. A prefill packs the step's prompt chunks end to end into one
forward (``attention.PackedBatch``); a decode forward takes every decoding sequence, each at
its own position (``attention.SequenceBatch``), its inputs (token ids, start positions,
lengths) packed on the host and sent in one copy, or replays the CUDA graph captured for its
batch-size bucket. The block table changes only when a sequence crosses a block boundary
(``KVCache.reserve``), so a steady decode step has no host-device sync before the read of
the sampled tokens (:func:`sample_tokens`). ``Model.generate`` runs its steps here too, so the
plain runtime and the engine launch the same kernels.
"""

from __future__ import annotations

import torch

from runtime.attention import PackedBatch, SequenceBatch
from runtime.cache import KVCache


class Executor:
    """The forwards over ``cache`` on one attention backend (``kernels``: the chosen
    ``runtime.attention_backends`` backend; a bool from older callers: True the Triton kernels, False
    the cache's choice without them), decode steps through CUDA graphs when ``cuda_graphs``."""

    def __init__(self, decoder, cache: KVCache, kernels, cuda_graphs: bool = False):
        self.decoder, self.cache, self.kernels = decoder, cache, kernels
        self.graphs = DecodeGraphs(decoder, cache) if cuda_graphs else None  # at start-up: free slots only

    def prefill(self, slots: list[int], starts: list[int], token_ids: list[list[int]]) -> torch.Tensor:
        """Tokens ``token_ids[i]`` of the sequence in row ``slots[i]`` at positions ``starts[i] ..``,
        all in one forward (their blocks reserved); logits [n, V] of each one's last token."""
        batch = PackedBatch(self.cache, slots, starts, token_ids, self.kernels)
        with torch.inference_mode():
            return self.decoder.forward_packed(batch.input_ids, batch.positions, batch, batch.logits_at)

    def decode(self, tokens: list[int], starts: list[int], busy_rows: list[int] = ()) -> torch.Tensor:
        """One token for each sequence in rows ``0 .. n-1`` (``tokens[i]`` at position ``starts[i]``,
        its block reserved); logits [n, V]. ``busy_rows``: rows holding a sequence, which a CUDA
        graph's padding rows must not write."""
        block = self.cache.block_size
        fills = any((s + 1) % block == 0 for s in starts)  # the block-write launch only when a block fills
        graph = self.graphs and self.graphs.for_step(len(starts), fills, busy_rows)
        with torch.inference_mode():
            if graph is not None:
                return graph.run(tokens, starts)[:, -1]
            ids, starts_t, lengths = step_inputs(tokens, starts, self.cache.device)
            batch = SequenceBatch(self.cache, 0, starts, self.kernels, starts_t, lengths, max(starts) + 1, fills)
            return self.decoder(ids, batch, starts_t, last_only=True)[:, -1]


def step_inputs(tokens: list[int], starts: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [n, 1], starts [n], lengths after the step [n])`` on ``device``, int32, from one
    host tensor: one host-to-device copy for the whole step."""
    host = torch.tensor([tokens, starts, [s + 1 for s in starts]], dtype=torch.int32)
    packed = host.to(device, non_blocking=True)
    return packed[0, :, None], packed[1], packed[2]


class DecodeGraph:
    """One decode step for ``batch`` rows captured in a CUDA graph: static token, position and
    length inputs, the attention kernels over views of the cache (no host sync, no allocation at
    replay). Rows past the live sequences are padding: free slots written at position 0 and ignored.

    ``fills``: whether the step writes filled blocks (a graph per bucket for steps where some
    sequence fills one, and one without that launch for the others: the host knows which).
    ``capture=False`` runs the same padded step eagerly on the static inputs: what the tests run
    (in the Triton interpreter) to check everything but the capture itself."""

    def __init__(self, decoder, cache: KVCache, batch: int, fills: bool = True, capture: bool = True):
        device = cache.device
        self.batch, self.fills = batch, fills
        self.inputs = torch.zeros(3, batch, dtype=torch.int32, device=device)  # ids, starts, lengths
        self.inputs[2] = 1
        ids, starts, lengths = self.inputs[0, :, None], self.inputs[1], self.inputs[2]
        view = SequenceBatch(cache, 0, [0] * batch, kernels=True, starts_tensor=starts, lengths=lengths,
                             fills=fills)
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


def tuning_buckets(largest_m: int, rows=None) -> tuple[int, ...]:
    """The GEMM row buckets (``quant_matmul.m_bucket``'s: every M up to its decode limit, then powers
    of two) an Engine tunes at start-up: by default every one a step can take (M = 1 ..
    ``largest_m``: a decode batch, a packed prefill); ``rows``, the row counts its steps will take
    (``Engine(tune_rows=...)``), only theirs: one sequence with 512-token prompts needs (1, 512), 2
    buckets a shape where the default tunes 24 (the rest are tuned when a step first meets them)."""
    from runtime.kernels.matmul_configs import m_bucket

    if rows is None:
        rows = range(1, max(largest_m, 1) + 1)
    bad = [M for M in rows if isinstance(M, bool) or not isinstance(M, int) or not 1 <= M <= largest_m]
    if bad:
        raise ValueError(f"tune_rows must be row counts in 1..{largest_m} (a step's rows: at most max_batch "
                         f"decoding sequences or prefill_chunk prompt tokens), got {bad}")
    return tuple(sorted({m_bucket(M) for M in rows}))


def warm_matmul_tuning(decoder, largest_m: int, rows=None) -> int:
    """Tune every quantized layer's GEMM for the M buckets of ``tuning_buckets(largest_m, rows)``
    now, so no request pays a tuning stall; returns how many (layer, bucket) pairs were asked
    (layers of one shape share a tuning). Nothing to do where the layers run the dense reference
    (CPU). A bucket with no configuration
    that runs and matches the reference is left to the layers' forward, which runs the reference
    for it with one warning (``QuantLinear.forward``)."""
    from runtime.linear import QuantLinear

    buckets = tuning_buckets(largest_m, rows)
    layers = [m for m in decoder.modules() if isinstance(m, QuantLinear)]
    dtype = next(decoder.parameters()).dtype
    return sum(m.tune(buckets, dtype) for m in layers)  # each layer's backend: only Triton tunes


class DecodeGraphs:
    """The captured decode steps: one per batch-size bucket and per kind of step (with or
    without the block write). ``for_step`` picks the smallest bucket that holds the step."""

    def __init__(self, decoder, cache: KVCache, capture: bool = True, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256)):
        self.buckets = sorted({min(b, cache.batch) for b in buckets})
        self.graphs = {(b, fills): DecodeGraph(decoder, cache, b, fills, capture)
                       for b in self.buckets for fills in (False, True)}

    def for_step(self, n: int, fills: bool, running_slots: list[int]) -> DecodeGraph | None:
        """The graph for ``n`` decoding sequences (rows 0 .. n-1), when its padding rows are free
        slots (a prefilling sequence in a higher row must not be written by padding)."""
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None or any(n <= slot < bucket for slot in running_slots):
            return None
        return self.graphs[bucket, fills]


def sample_tokens(logits: torch.Tensor, requests: list, rows: list[int]) -> list[int]:
    """The next token of each of ``requests`` (logits ``rows``): one read from the device."""
    from runtime.sampling import sample_params

    if not requests:
        return []
    if all(r.params.greedy for r in requests):
        best = logits.argmax(-1).tolist()
        return [best[i] for i in rows]
    logits = logits.float().cpu()  # one copy for every sampler
    return [sample_params(logits[i], r.params, r.generator) for i, r in zip(rows, requests)]
