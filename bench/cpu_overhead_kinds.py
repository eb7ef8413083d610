"""Where a CPU decode step's time goes, by kind of work: each piece's own time (its callees of
another kind taken out), measured by wrapping the runtime's functions for the run.

Used by ``bench.cpu_overhead`` (the breakdown rows); the wrapping is this file's only job.
Kinds: the decoder's Linears (quantized, float, lm_head), norms (with the residual add), RoPE
(the step's table, applying it), the MLP's activation and its dtype conversions, attention's
math (SDPA / ``cpu_attention.decode_attention``), the cache's bookkeeping (checks, pages, the
store of the new keys and values), the glue of each module (Python, views, transposes), the
embedding, and for an engine step the scheduler, the executor's inputs and sampling. Each call
of a wrapped function costs the wrapper about a microsecond: ``wrapped_step_ms`` beside the plain
step says how much the accounting itself added.
"""

from __future__ import annotations

import collections
import contextlib
import time

import torch

# (module, qualified attribute, kind): class methods wrapped on the class, functions where they are read
WRAPPED = (
    ("runtime.linear", "QuantLinear.forward", "linears (quantized)"),
    ("runtime.norms", "RMSNorm.add_forward", "norms (+ residual add)"),
    ("runtime.norms", "RMSNorm.forward", "norms (+ residual add)"),
    ("runtime.model", "Decoder.rope", "rope (cos/sin table)"),
    ("runtime.model", "Attention.rope_joined", "rope (apply)"),
    ("runtime.model", "Attention.project", "attention glue"),
    ("runtime.model", "Attention.forward", "attention glue"),
    ("runtime.model", "MLP.forward", "mlp activation + conversions"),
    ("runtime.model", "Block.forward", "block glue"),
    ("runtime.model", "Decoder.embed", "embedding"),
    ("runtime.model", "Decoder.head", "decoder glue"),
    ("runtime.model", "Decoder.forward", "decoder glue"),
    ("runtime.attention", "as_batch", "decoder glue"),
    ("runtime.attention", "WholeCache.attend", "attention glue"),
    ("runtime.attention", "SequenceBatch.attend", "attention glue"),
    ("runtime.attention", "decode_attention", "attention math"),
    ("runtime.attention", "sdpa", "attention math"),
    ("runtime.attention", "residual_attention", "attention math"),
    ("runtime.kernels.kv_reference", "PagedKV.from_cache", "cache bookkeeping"),
    ("runtime.cache_lockstep", "LockstepCache.prepare_write", "cache bookkeeping"),
    ("runtime.cache", "PagedCache.store", "cache bookkeeping"),
    ("runtime.cache", "KVCache.store_sequence", "cache bookkeeping"),
    ("runtime.cache", "KVCache.store_decode", "cache bookkeeping"),
    ("runtime.execution", "Executor.decode", "engine: executor inputs"),
    ("runtime.execution", "sample_tokens", "engine: sampling"),
    ("runtime.engine", "Engine.step", "engine: step host work"),
    ("runtime.engine", "Engine._emit", "engine: step host work"),
    ("runtime.scheduler", "Scheduler.decode_batch", "engine: scheduler"),
    ("runtime.scheduler", "Scheduler.decoded", "engine: scheduler"),
    ("runtime.scheduler", "Scheduler.promote", "engine: scheduler"),
    ("runtime.scheduler", "Scheduler.admit", "engine: scheduler"),
    ("runtime.scheduler", "Scheduler.prefill_batch", "engine: scheduler"),
)


class Accounts:
    """Self time per kind (process CPU and wall nanoseconds) and calls, kept by a stack of the
    wrapped calls in progress: a call's time less its wrapped callees' goes to its kind."""

    def __init__(self):
        self.cpu, self.wall, self.calls = collections.Counter(), collections.Counter(), collections.Counter()
        self.stack: list[list[int]] = []

    def clear(self) -> None:
        self.cpu.clear(), self.wall.clear(), self.calls.clear()

    def wrap(self, f, kind: str):
        def timed(*args, **kwargs):
            cpu, wall = time.process_time_ns(), time.perf_counter_ns()
            self.stack.append([0, 0])
            try:
                return f(*args, **kwargs)
            finally:
                d_cpu, d_wall = time.process_time_ns() - cpu, time.perf_counter_ns() - wall
                inner_cpu, inner_wall = self.stack.pop()
                self.cpu[kind] += d_cpu - inner_cpu
                self.wall[kind] += d_wall - inner_wall
                self.calls[kind] += 1
                if self.stack:
                    self.stack[-1][0] += d_cpu
                    self.stack[-1][1] += d_wall
        return timed


@contextlib.contextmanager
def accounting(decoder):
    """Wrap :data:`WRAPPED` (where the running code has it) and the decoder's own Linears (per
    instance: lm_head apart); yields the :class:`Accounts`; everything restored on exit."""
    import importlib

    accounts, undo = Accounts(), []
    for module_name, qualified, kind in WRAPPED:
        owner = importlib.import_module(module_name)
        *path, name = qualified.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is None or name not in vars(owner):
            continue  # not in this version of the code (a before/after run)
        original = vars(owner)[name]
        if isinstance(original, classmethod):
            setattr(owner, name, classmethod(accounts.wrap(original.__func__, kind)))
        else:
            setattr(owner, name, accounts.wrap(original, kind))
        undo.append((owner, name, original))
    from runtime.cpu_linear import NarrowLinear

    for module in decoder.modules():
        if module is decoder.lm_head:
            kind = "lm_head"
        elif type(module) in (torch.nn.Linear, NarrowLinear):
            kind = "linears (float)"
        else:
            continue
        module.forward = accounts.wrap(module.forward, kind)  # nn.Module.__call__ reads the instance's
        undo.append((module, "forward", None))
    try:
        yield accounts
    finally:
        for owner, name, original in reversed(undo):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def per_step(accounts: Accounts, steps: int, total_cpu_ns: int, total_wall_ns: int) -> dict:
    """Milliseconds per step by kind (largest first), and what no wrapped call took ("other")."""
    kinds = {k: {"cpu_ms": accounts.cpu[k] / steps / 1e6, "wall_ms": accounts.wall[k] / steps / 1e6,
                 "calls": accounts.calls[k] / steps} for k in sorted(accounts.cpu, key=lambda k: -accounts.cpu[k])}
    kinds["other (unwrapped)"] = {"cpu_ms": (total_cpu_ns - sum(accounts.cpu.values())) / steps / 1e6,
                                  "wall_ms": (total_wall_ns - sum(accounts.wall.values())) / steps / 1e6, "calls": 0}
    return kinds
