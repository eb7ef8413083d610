"""Speed by phase, measured with the runtime: prefill (TTFT, prompt tokens/s) and decode (ITL, tokens/s).

A request is a batch of ``batch`` prompts of ``prompt_len`` random token ids (the
same length, so no padding skews the count), prefilled in one forward through the
runtime's KV cache, then decoded greedily for ``output_len - 1`` more steps:

* TTFT: from submitting the prompts to the first token of every sequence
  (the prefill forward and the sampling of its last position);
* ITL: the time of each later step (one new token for every sequence);
* prefill tokens/s = batch * prompt_len / TTFT; decode tokens/s = batch / mean ITL;
* peak memory of the request: on CUDA the most torch had allocated; on CPU the
  process's peak resident set (weights, cache, activations and the interpreter),
  its high-water mark reset before the request (Linux ``/proc/self/clear_refs``).

Each configuration runs once untimed first (allocator and kernel warm-up), then
``repeats`` times; the reported numbers are medians over the repeats.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from runtime.units import sync

PROTOCOL = ("random token ids (seed 0), batch of equal-length prompts prefilled in one forward through the "
            "runtime KV cache, greedy decode; TTFT = prefill + first sampling; ITL = one decode step for the batch; "
            "one warm-up run, medians over repeats")


@dataclass(frozen=True)
class Workload:
    prompt_len: int
    output_len: int
    batch: int = 1

    def __post_init__(self):
        for key in ("prompt_len", "output_len", "batch"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be at least 1, got {getattr(self, key)}")


@dataclass(frozen=True)
class PhaseTiming:
    workload: Workload
    kv: str
    ttft_s: float
    itl_s: float  # median over steps and repeats; 0 when output_len == 1
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    repeats: int
    peak_memory_bytes: int | None = None  # None where the platform cannot say

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(d.pop("workload"))
        return d


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    except OSError:
        pass


def peak_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


@torch.inference_mode()
def run_request(model, prompt_ids: torch.Tensor, output_len: int, scheme=None) -> tuple[float, list[float], torch.Tensor]:
    """Prefill ``prompt_ids`` [B, P] and decode greedily; return TTFT and per-step ITLs in seconds, and
    the generated ids [B, output_len]."""
    batch, prompt_len = prompt_ids.shape
    cache = model.new_cache(prompt_len + output_len, batch, scheme)  # None: the model's own scheme
    ids = prompt_ids.to(model.device)
    sync(model.device)
    start = time.perf_counter()
    token = model.decoder(ids, cache, 0)[:, -1].argmax(-1, keepdim=True)
    sync(model.device)
    ttft = time.perf_counter() - start
    itls, pos, tokens = [], prompt_len, [token]
    for _ in range(output_len - 1):
        step = time.perf_counter()
        token = model.decoder(token, cache, pos)[:, -1].argmax(-1, keepdim=True)
        sync(model.device)
        itls.append(time.perf_counter() - step)
        tokens.append(token)
        pos += 1
    return ttft, itls, torch.cat(tokens, dim=1).cpu()


def random_prompts(model, workload: Workload, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.decoder.cfg.vocab_size, (workload.batch, workload.prompt_len), generator=g)


def measure(model, workload: Workload, scheme=None, repeats: int = 1) -> PhaseTiming:
    """Time both phases of ``workload`` on ``model`` (a :class:`runtime.Model`)."""
    limit = model.max_positions
    if workload.prompt_len + workload.output_len > limit:
        raise ValueError(f"prompt {workload.prompt_len} + output {workload.output_len} tokens exceed the model's "
                         f"context ({limit} positions)")
    prompts = random_prompts(model, workload)
    run_request(model, prompts[:, : min(workload.prompt_len, 16)], min(workload.output_len, 2), scheme)  # warm-up
    ttfts, itls = [], []
    reset_peak_memory(model.device)
    for _ in range(repeats):
        ttft, steps, _ = run_request(model, prompts, workload.output_len, scheme)
        ttfts.append(ttft)
        itls += steps
    peak = peak_memory(model.device)
    ttft = statistics.median(ttfts)
    itl = statistics.median(itls) if itls else 0.0
    name = (scheme or model.kv_scheme).name
    return PhaseTiming(workload, name, ttft, itl, workload.batch * workload.prompt_len / ttft,
                       workload.batch / itl if itl else 0.0, repeats, peak)


def sweep(model, workloads, scheme=None, repeats: int = 1, progress=None) -> list[PhaseTiming]:
    out = []
    for w in workloads:
        t = measure(model, w, scheme, repeats)
        if progress:
            progress(t)
        out.append(t)
    return out


def parse_lengths(text: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def workloads(prompt_lens, output_lens, batches) -> list[Workload]:
    return [Workload(p, o, b) for b in batches for p in prompt_lens for o in output_lens]


def timing_table(timings: list[PhaseTiming]) -> str:
    lines = [f"{'batch':>5} {'prompt':>6} {'output':>6} {'kv':<14} {'TTFT ms':>9} {'prefill tok/s':>14} "
             f"{'ITL ms':>8} {'decode tok/s':>13} {'peak MB':>8}"]
    for t in timings:
        w = t.workload
        lines.append(f"{w.batch:>5} {w.prompt_len:>6} {w.output_len:>6} {t.kv:<14} {t.ttft_s * 1e3:>9.1f} "
                     f"{t.prefill_tokens_per_s:>14,.0f} {t.itl_s * 1e3:>8.1f} {t.decode_tokens_per_s:>13,.1f} "
                     f"{(t.peak_memory_bytes or 0) / 1e6:>8.0f}")
    return "\n".join(lines)
