"""Count what a piece of code asks of the device: host syncs, input copies and kernel launches.

Measured without a GPU: the code runs on CPU tensors (the Triton kernels in the interpreter),
and every PyTorch op it calls is seen twice, once as a Python-level function (a
``TorchFunctionMode``) and once as an ATen op (a ``TorchDispatchMode``):

* a **host sync** is a read of a tensor's values by the host: ``tolist``, ``item``, ``cpu``,
  ``numpy``, ``int()``/``bool()`` of a tensor (ATen ``_local_scalar_dense``), and the ops whose
  output size depends on values (``nonzero``, ``masked_select``, boolean indexing, ``unique``);
  on a GPU each waits for the queued work;
* an **input copy** is a tensor made from host data (``torch.tensor``, ``as_tensor``,
  ``from_numpy``): on a GPU, a host-to-device copy;
* a **launch** is an ATen op that would run a kernel (views, allocations without a fill and
  scalar reads excluded) or a Triton kernel launch (the JIT functions' ``run`` is wrapped, and
  what the interpreter does inside a kernel is not counted).

What this cannot see: an op that is a no-op on CPU but a kernel on a GPU (``.to(device)`` of a
CPU tensor; a dtype cast only where the CPU run uses the same dtype, so count in the model's GPU
dtype), and how many kernels one ATen op becomes in a CUDA library (one, in the counts here).
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

HOST_READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
SIZE_FROM_VALUES = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
                    aten.unique_consecutive.default, aten.repeat_interleave.Tensor, aten._local_scalar_dense.default}
INPUT_FACTORIES = {torch.tensor, torch.as_tensor, torch.from_numpy}
# casts and moves: counted here, at the Python level, because under inference_mode the ATen copy
# beneath them does not reach a dispatch mode; a cast that changes nothing returns its input
CASTS = {"to", "float", "half", "bfloat16", "double", "type_as", "contiguous"}
NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
             aten.new_empty_strided.default, aten.lift_fresh.default, aten.detach.default, aten.detach_.default,
             aten.alias.default, aten._local_scalar_dense.default, aten.set_.source_Storage, aten.resize_.default}


@dataclass
class DeviceWork:
    syncs: int = 0
    input_copies: int = 0
    aten_launches: int = 0
    triton_launches: int = 0
    ops: collections.Counter = field(default_factory=collections.Counter)  # what was counted, by name

    @property
    def launches(self) -> int:
        return self.aten_launches + self.triton_launches

    def to_dict(self) -> dict:
        return dict(syncs=self.syncs, input_copies=self.input_copies, launches=self.launches,
                    aten_launches=self.aten_launches, triton_launches=self.triton_launches,
                    ops=dict(sorted(self.ops.items())))


class _Counter(TorchFunctionMode):
    def __init__(self, work: DeviceWork):
        super().__init__()
        self.work, self.paused = work, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.paused:
            return func(*args, **(kwargs or {}))
        if name in HOST_READS:
            self.work.syncs += 1
            self.work.ops[f"sync:{name}"] += 1
            self.paused += 1  # the ATen op under it (_local_scalar_dense) is this same sync
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.paused -= 1
        if func in INPUT_FACTORIES:
            self.work.input_copies += 1
            self.work.ops[f"copy:{name}"] += 1
        if name in CASTS and args and isinstance(args[0], torch.Tensor):
            self.paused += 1
            try:
                out = func(*args, **(kwargs or {}))
            finally:
                self.paused -= 1
            if out is not args[0]:
                self.work.aten_launches += 1
                self.work.ops[f"cast:{name}"] += 1
            return out
        return func(*args, **(kwargs or {}))


class _AtenCounter(TorchDispatchMode):
    def __init__(self, counter: _Counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        work = self.counter.work
        if not self.counter.paused:
            if func in SIZE_FROM_VALUES or (func is aten.index.Tensor and _bool_index(args)):
                work.syncs += 1
                work.ops[f"sync:{func.__name__}"] += 1
            elif not func.is_view and func not in NO_KERNEL:
                work.aten_launches += 1
                work.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def _bool_index(args) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()))


def _triton_launchers():
    """The classes whose ``run`` launches a Triton kernel (compiled, and the interpreter's)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return (JITFunction, InterpretedFunction)


@contextlib.contextmanager
def count_device_work():
    """``with count_device_work() as work: ...``: ``work`` (a :class:`DeviceWork`) counts the block."""
    work = DeviceWork()
    counter = _Counter(work)
    patched = []
    for cls in _triton_launchers():
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            if not counter.paused and not kwargs.get("warmup"):
                work.triton_launches += 1
                work.ops[f"triton:{getattr(self, '__name__', None) or self.fn.__name__}"] += 1
            counter.paused += 1  # the interpreter's own tensor ops are the kernel, not launches
            try:
                return _original(self, *args, **kwargs)
            finally:
                counter.paused -= 1

        cls.run = run
        patched.append((cls, original))
    try:
        with counter, _AtenCounter(counter):
            yield work
    finally:
        for cls, original in patched:
            cls.run = original


def decode_step_counts(engine) -> dict:
    """One engine step that only decodes (every running request is past its prompt), counted:
    the whole step, and the launches inside each decoder layer (forward hooks on the blocks)."""
    if not engine.all_decoding or not engine.decoding:
        raise ValueError("decode_step_counts needs an engine whose running requests all decode and none waits")
    return dict(layer_counts(engine.model.decoder, engine.step), sequences=engine.decoding)


def generate_step_counts(model, tokens) -> dict:
    """The next decode step of ``model.generate`` (``tokens``: an iterator over its Generation,
    past the first token), counted as :func:`decode_step_counts` counts the engine's."""
    return dict(layer_counts(model.decoder, lambda: next(tokens)), sequences=1)


def layer_counts(decoder, step) -> dict:
    """What ``step()`` asks of the device, and the launches inside each of ``decoder``'s layers."""
    layers = decoder.model.layers
    per_layer = []
    with count_device_work() as work:
        marks = {}
        hooks = [layer.register_forward_pre_hook(lambda m, a: marks.__setitem__(m, work.launches)) for layer in layers]
        hooks += [layer.register_forward_hook(lambda m, a, out: per_layer.append(work.launches - marks[m]))
                  for layer in layers]
        try:
            step()
        finally:
            for h in hooks:
                h.remove()
    return dict(work.to_dict(), layers=len(layers), launches_per_layer=per_layer)
