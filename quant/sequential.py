"""The layer-by-layer calibration pipeline (ARCHITECTURE.md, "Calibration").

Capture the inputs of decoder layer 0; then for each layer: let the method
rewrite the layer's float weights if it does (AWQ's scales), then run the layer
once over the calibration batches in lockstep (:func:`lockstep_pass`): each
planned Linear is quantized from the Hessian of the inputs that reach it, in the
order the forward reaches them, and the layer's outputs with quantized weights
become the next layer's inputs. Only the current layer sits on the compute
device, and after every layer the state needed to resume is written to a work
directory.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from quant import distributed
from quant.affine import QuantScheme
from quant.architectures import decoder_layers
from quant.format import QuantizedWeight
from quant.gram import add_gram, mirror_upper
from quant.models import LazyLayers
from quant.progress import load_progress, save_progress


def _greenlet():
    """greenlet, imported when a calibration pass runs: importing lowbit (the CLI, the runtime's
    benchmarks) must work where only the runtime's packages are installed, e.g. a GPU machine."""
    import greenlet

    return greenlet


class StopForward(Exception):
    """Raised by the recorder of the last layer's inputs: nothing past it needs to run."""


@dataclass
class LayerInputs:
    """Hidden states entering a layer, batch by batch, and the keyword arguments
    (attention mask, rotary embeddings) the model passes with them."""

    hidden: list[torch.Tensor]
    kwargs: list[dict]
    # the float model's output of this layer batch by batch (its own stream, from float inputs),
    # when the method learns against it; None: the float layer on ``hidden`` is the reference
    target: list[torch.Tensor] | None = None


def capture_inputs(model, layers, samples: torch.Tensor, batch_size: int, device) -> tuple[LayerInputs, list]:
    """Layer 0's inputs for this rank's shard of the samples (all of them in one process), and
    every layer's keyword arguments batch by batch: families whose
    layers differ (Gemma's local and global layers: their own masks and RoPE) get each its own.
    Each layer's forward is swapped for a recorder that passes the hidden states through
    unchanged, so no layer's weights are needed (the arguments do not depend on them)."""
    hidden, kwargs = [], [[] for _ in layers]

    def recorder(i: int):
        def record(*args, **kw):
            h = args[0] if args else kw.pop("hidden_states")
            if i == 0:
                hidden.append(h)
            kwargs[i].append({k: v for k, v in kw.items() if k not in ("past_key_values", "use_cache")})
            if i == len(layers) - 1:
                raise StopForward
            return h

        return record

    for i, layer in enumerate(layers):
        layer.forward = recorder(i)  # an instance attribute: the class's forward comes back when it is deleted
    try:
        for batch in distributed.current().shard(samples, batch_size):
            try:
                model(batch.to(device), use_cache=False)
            except StopForward:
                pass
    finally:
        for layer in layers:
            del layer.forward
    return LayerInputs(hidden, kwargs[0]), kwargs


def run_layer(layer, inputs: LayerInputs) -> list[torch.Tensor]:
    """``layer`` (a decoder layer, or any module inside one) on every batch, as its weights stand."""
    outs = []
    for h, kw in zip(inputs.hidden, inputs.kwargs):
        out = layer(h, **kw)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return outs


class _Batch:
    """One calibration batch's forward through a layer, as a coroutine the lockstep pass
    pauses and resumes. Greenlets, not threads: every batch runs on the pipeline's own OS
    thread, one at a time (with a thread per batch, the GPTQ steps between them ran slower)."""

    def __init__(self, forward: Callable[[], torch.Tensor]):
        self.state: tuple = ("new", None)  # ("paused", Linear name) | ("done", output)
        # q/k/v (gate/up) read one tensor: the first of them to see it adds its xᵀx, the rest share it
        self.last_input: torch.Tensor | None = None
        self.last_reader: str | None = None

        def run():
            out = forward()
            self.state = ("done", out[0] if isinstance(out, tuple) else out)

        self.coroutine = _greenlet().greenlet(run)

    def pause(self, name: str) -> None:
        """Inside the batch's forward: wait at Linear ``name`` until the pass resumes it."""
        self.state = ("paused", name)
        self.coroutine.parent.switch()

    def step(self) -> tuple:
        """Run the batch until it pauses or ends (its exceptions propagate to the caller)."""
        self.coroutine.switch()
        return self.state

    def close(self) -> None:
        """Unwind a batch that has not finished (its pass failed elsewhere)."""
        if self.coroutine:  # started and not dead
            self.coroutine.throw(_greenlet().GreenletExit)


# quantize_linear(name, H) -> (quantized weight, stats): quantize Linear ``name`` of the layer
# given ``H = 2/n Σ xᵀx`` of the inputs it is about to receive (None when the pass gathers none).
# A weight of None leaves the Linear as it is: a pass that only measures (quant.budget).
QuantizeLinear = Callable[[str, torch.Tensor | None], tuple[QuantizedWeight, dict]]


def lockstep_pass(layer: torch.nn.Module, inputs: LayerInputs, plan: dict, quantize_linear: QuantizeLinear,
                  where: str = "", hessian: bool = True, together: tuple[tuple[str, ...], ...] = (),
                  min_rows: int = 1) -> tuple[dict, dict, list[torch.Tensor]]:
    """Quantize the planned Linears of ``layer`` in one forward over every calibration batch.

    The batches run in lockstep: a hook on each planned Linear adds the batch's input to the
    Linear's Hessian and pauses the batch there; when every batch has arrived, the Linear is
    quantized and its weight replaced by the dequantized result, and the batches go on
    through it. Each Linear therefore sees inputs that already passed through the quantized
    Linears before it (GPTQ's "true sequential" order), and the layer's outputs, the next
    layer's inputs, come out of the same forward: one pass per layer, not one to gather
    statistics and another to propagate. The pauses follow the layer's own forward, so any
    decoder layer works. Returns the quantized weights, their stats and the layer's outputs.
    ``where`` (the layer's module path and a dot) prefixes the Linear names in errors. Without
    ``hessian`` (the rounding method reads no statistics) the pass only pauses at each Linear.

    Across ranks (``quant.distributed``) each rank runs its own batches; a Hessian is summed over
    the ranks when the batches of all of them have reached its Linear. ``together`` lists Linears
    that read one input (q/k/v, gate/up): when the batches reach the first, all of them are
    quantized from its Hessian at once, spread over the ranks, each result broadcast from the rank
    that made it; the batches then pass the others without pausing (checked: same input tensor).
    A Linear whose inputs had fewer than ``min_rows`` rows over all ranks (a mixture-of-experts
    expert that the router sent few tokens, ``quant.moe``) gets no Hessian:
    ``quantize_linear(name, None)``.
    """
    world = distributed.current()
    partners = {n: [m for m in group if m != n] for group in together for n in group}
    ahead: dict[str, str] = {}  # Linear quantized with an earlier one -> that one (their input is shared)
    reduced: set[str] = set()  # gram_sum keys summed over the ranks
    gram_sum: dict[str, torch.Tensor] = {}  # Σ xᵀx of each distinct input, under the first Linear to read it
    rows: dict[str, int] = {}
    reads: dict[str, set] = {}  # Linear -> the key(s) of gram_sum holding its inputs
    readers: dict[str, set] = {}  # key of gram_sum -> the Linears that read it
    quantized: dict[str, QuantizedWeight] = {}
    stats: dict[str, dict] = {}

    def hook(name: str):
        def fn(module, args):
            if name in ahead and args[0] is not batch_of[_greenlet().getcurrent()].last_input:
                raise RuntimeError(f"{where}{name} was quantized with {where}{ahead.pop(name)} as reading the same "
                                   "input, but it reads another tensor (quant.architectures' scale pairs are wrong)")
            if name in quantized:  # a Linear called twice in one forward, or quantized ahead: already done
                return
            batch = batch_of[_greenlet().getcurrent()]  # hooks run inside a batch's forward
            x_in = args[0]
            if not hessian:  # no xᵀx whose diagonal would show NaN or Inf in the inputs: look at them
                if x_in is not batch.last_input and not torch.isfinite(x_in).all():
                    raise ValueError(f"{where}{name}: its calibration inputs contain NaN or Inf "
                                     "(the model overflows before it)")
                batch.last_input = x_in
                batch.pause(name)
                return
            if x_in is not batch.last_input:
                x = x_in.detach().reshape(-1, x_in.shape[-1]).float()
                if name not in gram_sum:
                    drop_finished_grams()
                    gram_sum[name] = torch.zeros(x.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
                add_gram(gram_sum[name], x)
                rows[name] = rows.get(name, 0) + x.shape[0]
                batch.last_input, batch.last_reader = x_in, name
            reads.setdefault(name, set()).add(batch.last_reader)
            readers.setdefault(batch.last_reader, set()).add(name)
            batch.pause(name)

        return fn

    def drop_finished_grams() -> None:
        """Free the xᵀx whose readers are all quantized. Only consecutive Linears share an input
        (the last one a batch saw), so a new input means no later Linear reads the older ones;
        a MoE layer holds one expert's statistics at a time, not all of them (quant.moe)."""
        for key in [k for k, names in readers.items() if k in gram_sum and names <= quantized.keys()]:
            del gram_sum[key]

    def hessian_of(name: str) -> torch.Tensor | None:
        if len(reads[name]) > 1:
            raise RuntimeError(f"{where}{name}: calibration batches fed it different tensors ({sorted(reads[name])})")
        key = reads[name].pop()
        if key not in reduced:  # every rank's batches have arrived: sum their xᵀx and rows
            world.sum_(gram_sum[key])
            rows[key] = world.total(rows[key])
            reduced.add(key)
        if rows[key] < min_rows:  # an expert the router sent (almost) no calibration token, on any rank
            return None
        H = mirror_upper(gram_sum[key]) * (2.0 / rows[key])
        if not torch.isfinite(H.diagonal()).all():  # diag(xᵀx) = Σ x²: NaN or Inf anywhere in x shows there
            raise ValueError(f"{where}{name}: its calibration inputs contain NaN or Inf (the model overflows before it)")
        return H

    def quantize(name: str) -> None:
        group = [name] + [n for n in partners.get(name, ()) if n in plan and n not in quantized]
        H = hessian_of(name) if hessian else None
        owner = world.owners({where + n: layer.get_submodule(n).weight.numel() for n in group})  # full names
        mine = {n: quantize_linear(n, H) for n in group if owner[where + n] == world.rank}
        for n in group:  # the same order on every rank
            qw, stats[n] = world.share_quantized(mine.get(n), owner[where + n])
            quantized[n] = qw
            if qw is not None:  # None: a pass that only measures (the bits budget) leaves the weight float
                linear = layer.get_submodule(n)
                linear.weight.data = qw.dequantize(linear.weight.dtype).to(linear.weight.device)
        ahead.update(dict.fromkeys(group[1:], name))

    handles = [layer.get_submodule(n).register_forward_pre_hook(hook(n)) for n in plan]
    batches = [_Batch(lambda h=h, kw=kw: layer(h, **kw)) for h, kw in zip(inputs.hidden, inputs.kwargs)]
    batch_of = {b.coroutine: b for b in batches}
    try:
        while True:
            states = [b.step() for b in batches]
            if all(kind == "done" for kind, _ in states):
                break
            waiting = {value if kind == "paused" else "the end" for kind, value in states}
            if len(waiting) > 1:
                raise RuntimeError(f"calibration batches took different paths through {where or 'the layer'} "
                                   f"(at {sorted(waiting)})")
            quantize(waiting.pop())
    finally:
        for b in batches:
            b.close()
        for h in handles:
            h.remove()
    missing = [n for n in plan if n not in quantized]
    if missing:
        raise ValueError(f"{', '.join(where + n for n in missing)}: never called in the layer's forward, so no calibration inputs reached it")
    return quantized, stats, [b.state[1] for b in batches]


# A layer method gets the layer, its inputs, its plan (local Linear name -> scheme) and its
# module path (for messages); it returns the quantized weights of those Linears, per-Linear stats, and the layer's outputs
# with the quantized weights (the next layer's inputs). It may rewrite float weights first,
# as AWQ does, and usually ends with :func:`lockstep_pass`.
LayerMethod = Callable[[torch.nn.Module, LayerInputs, dict, str], tuple[dict, dict, list]]


def quantize_sequential(
    model: torch.nn.Module,
    plan: dict[str, QuantScheme],
    samples: torch.Tensor,
    method: LayerMethod,
    device: str | torch.device = "cpu",
    batch_size: int = 8,
    work_dir: Path | None = None,
    resume: bool = False,
    run_id: str = "",
    progress: bool = True,
    lazy: LazyLayers | None = None,
    float_stream: bool = False,
) -> tuple[dict[str, QuantizedWeight], dict[str, dict]]:
    """Quantize the planned Linears inside the decoder layers, one layer at a time.

    With ``float_stream`` the float model's own hidden states are carried beside the quantized
    ones (one more copy of the calibration activations), and each layer's method gets the
    float model's output of that layer as ``inputs.target`` (AutoRound's reference).

    With ``work_dir``, progress is saved after every layer; ``resume`` continues
    from it if it was made by the same ``run_id`` (the recipe), else refuses.

    Returns quantized weights and stats keyed by full module name. The model's
    float weights end up as the method left them (AWQ's scales folded in, the
    quantized Linears holding their dequantized values). With ``lazy`` (a model from
    :func:`quant.models.load_lazily`), each layer is read from disk when its turn comes
    and its quantized Linears' float weights are dropped after it.
    """
    prefix, layers = decoder_layers(model)
    device = torch.device(device)
    home = torch.device("cpu") if lazy else next(layers[0].parameters()).device
    for name, module in model.named_children():  # embeddings and friends join the first step
        if module is not getattr(model, "lm_head", None) and module is not layers:
            move_data(module, device, skip=layers)

    def fetch(i: int) -> torch.nn.Module:
        if lazy:
            lazy.fill(layers[i], f"{prefix}.{i}.", device)
        return move_data(layers[i], device)

    def put_back(i: int, quantized_here) -> None:
        if lazy:
            lazy.release(layers[i], quantized_here)
        move_data(layers[i], home)

    quantized: dict[str, QuantizedWeight] = {}
    stats: dict[str, dict] = {}
    heap = _HeapTrim()
    with torch.no_grad():
        fetch(0)
        inputs, layer_kwargs = capture_inputs(model, layers, samples, batch_size, device)
        put_back(0, [])
        done = 0
        reference = list(inputs.hidden) if float_stream else None  # the float model's inputs to layer ``done``
        restored = load_progress(work_dir, layers, prefix, plan, quantized, device, run_id) if resume and work_dir else None
        if restored is not None:
            done, stats, hidden, saved_reference = restored
            reference = saved_reference if float_stream else None
            if float_stream and reference is None:
                raise ValueError(f"{work_dir} holds no float-model activations (made without signround.target: model?); "
                                 "run without --resume")
            inputs = LayerInputs(hidden, layer_kwargs[done])
        bar = tqdm(range(done, len(layers)), desc="quantizing layers", unit="layer",
                   disable=not progress or not distributed.current().main, initial=done, total=len(layers))
        for i in bar:
            layer = fetch(i)
            local = {n[len(f"{prefix}.{i}."):]: s for n, s in plan.items() if n.startswith(f"{prefix}.{i}.")}
            if reference is not None:  # the layer is still float here: its output on the float stream
                inputs.target = reference = run_layer(layer, LayerInputs(reference, inputs.kwargs))
            layer_q, layer_stats, hidden = method(layer, inputs, local, f"{prefix}.{i}.")
            inputs = LayerInputs(hidden, layer_kwargs[min(i + 1, len(layers) - 1)])
            for n in local:
                if distributed.current().main:  # the others write no checkpoint: keep no int8 copy of the model
                    quantized[f"{prefix}.{i}.{n}"] = layer_q[n]
                stats[f"{prefix}.{i}.{n}"] = layer_stats[n]
            if work_dir is not None:
                save_progress(work_dir, i, layer, local, layer_q, inputs.hidden, stats, run_id, reference)
            put_back(i, local)
            heap.after_layer()
    return quantized, stats


class _HeapTrim:
    """Hands the pages of freed heap blocks back to the system when resident memory creeps up
    (glibc on Linux; elsewhere nothing). Once large blocks have been freed, glibc serves the
    activations from its heap, and the small results each layer keeps split the freed space,
    so without this resident memory grows with every layer (bench/memory.py). Trimming after
    every layer would cost the time of faulting those pages in again each layer; trimming
    once the growth since the first layer passes a margin costs a fraction of that. (Known gap:
    the int8 results the pipeline keeps also grow; on a model whose results outgrow the margin,
    every later layer would trim. Counting them into the baseline is the fix, not yet made.)"""

    MARGIN = 256 << 20

    def __init__(self):
        try:
            self.trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            self.trim = None
        self.first = None  # resident memory after the first layer: one layer's footprint

    def after_layer(self) -> None:
        if self.trim is None:
            return
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        if self.first is None:
            self.first = resident
        elif resident > self.first + self.MARGIN:
            self.trim(0)


def move_data(module: torch.nn.Module, device: torch.device, skip: torch.nn.Module | None = None) -> torch.nn.Module:
    """``module.to(device)`` for the tensors that hold data: those left on the meta device (a
    lazily loaded model's layers, released weights) and those inside ``skip`` stay where they are."""
    skipped = {id(t) for t in skip.parameters()} | {id(t) for t in skip.buffers()} if skip is not None else set()
    return module._apply(lambda t: t if t.is_meta or id(t) in skipped else t.to(device))
