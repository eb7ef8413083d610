"""The layer-by-layer calibration pipeline (DESIGN.md, "Calibration pipeline").

Capture the inputs of decoder layer 0; then for each layer: run it on the
calibration inputs while hooks gather each Linear's input Hessian (and, for
AWQ, the activations its search needs), let the method rewrite the layer's
weights, quantize every planned Linear, and run the layer again with the
quantized weights to produce the next layer's inputs. Only the current layer
sits on the compute device, and after every layer the state needed to resume
is written to a work directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from quant.affine import QuantScheme
from quant.format import QuantizedWeight


class StopForward(Exception):
    """Raised by the hook that captures layer 0's inputs: nothing past it needs to run."""


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The stack of decoder layers: ``model.model.layers`` in the Llama family, else the
    longest ModuleList of identical blocks (the pipeline is generic over decoder layers)."""
    inner = getattr(model, "model", None)
    if isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
        return inner.layers
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len({type(c) for c in m}) == 1]
    if not lists:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return max(lists, key=len)


@dataclass
class LayerInputs:
    """Hidden states entering a layer, batch by batch, and the keyword arguments
    (attention mask, rotary embeddings) the model passes with them."""

    hidden: list[torch.Tensor]
    kwargs: list[dict]


def capture_inputs(model, layers, samples: torch.Tensor, batch_size: int, device) -> LayerInputs:
    hidden, kwargs = [], []

    def grab(module, args, kw):
        hidden.append(args[0] if args else kw.pop("hidden_states"))
        kwargs.append({k: v for k, v in kw.items() if k not in ("past_key_values", "use_cache")})
        raise StopForward

    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for batch in samples.split(batch_size):
            try:
                model(batch.to(device), use_cache=False)
            except StopForward:
                pass
    finally:
        handle.remove()
    return LayerInputs(hidden, kwargs)


def run_layer(layer, inputs: LayerInputs) -> list[torch.Tensor]:
    outs = []
    for h, kw in zip(inputs.hidden, inputs.kwargs):
        out = layer(h, **kw)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return outs


class HessianCollector:
    """Accumulates ``H = 2/n Σ xᵀx`` per Linear. Linears fed the very same tensor
    (q/k/v, gate/up) share one product instead of computing it again."""

    def __init__(self, names: list[str]):
        self.H: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = {}
        self._last_input: torch.Tensor | None = None  # held, so its memory cannot be reused
        self._last_product: torch.Tensor | None = None
        self.names = names

    def hook(self, name: str):
        def fn(module, args):
            x_in = args[0]
            if x_in is not self._last_input:
                x = x_in.detach()
                if not torch.isfinite(x).all():
                    raise ValueError(f"{name}: its calibration inputs contain NaN or Inf (the model overflows before it)")
                x = x.reshape(-1, x.shape[-1]).float()
                self._last_input, self._last_product = x_in, x.T @ x
            x = x_in.reshape(-1, x_in.shape[-1])
            n = x.shape[0]
            if name not in self.H:
                self.H[name] = torch.zeros_like(self._last_product)
                self.count[name] = 0
            total = self.count[name] + n
            # running mean keeps the scale independent of the number of samples
            self.H[name].mul_(self.count[name] / total).add_(self._last_product, alpha=2.0 / total)
            self.count[name] = total

        return fn


# A layer method gets the layer, its inputs, its plan (local Linear name -> scheme) and
# the Hessians of those Linears' inputs; it returns the quantized weights of those
# Linears and per-Linear stats. It may rewrite float weights first, as AWQ does.
LayerMethod = Callable[[torch.nn.Module, LayerInputs, dict, dict], tuple[dict, dict]]


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
) -> tuple[dict[str, QuantizedWeight], dict[str, dict]]:
    """Quantize the planned Linears inside the decoder layers, one layer at a time.

    With ``work_dir``, progress is saved after every layer; ``resume`` continues
    from it if it was made by the same ``run_id`` (the recipe), else refuses.

    Returns quantized weights and stats keyed by full module name. The model's
    float weights end up as the method left them (AWQ's scales folded in, the
    quantized Linears holding their dequantized values).
    """
    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    device = torch.device(device)
    home = next(layers[0].parameters()).device
    for name, module in model.named_children():  # embeddings and friends join the first step
        if module is not getattr(model, "lm_head", None):
            module.to(device)
    layers.to(home)

    quantized: dict[str, QuantizedWeight] = {}
    stats: dict[str, dict] = {}
    with torch.no_grad():
        layers[0].to(device)
        inputs = capture_inputs(model, layers, samples, batch_size, device)
        layers[0].to(home)
        done = 0
        if resume and work_dir is not None and (work_dir / "progress.json").exists():
            done, stats, hidden = load_progress(work_dir, layers, prefix, plan, quantized, device, run_id)
            inputs = LayerInputs(hidden, inputs.kwargs)
        bar = tqdm(range(done, len(layers)), desc="quantizing layers", unit="layer", disable=not progress,
                   initial=done, total=len(layers))
        for i in bar:
            layer = layers[i].to(device)
            local = {n[len(f"{prefix}.{i}."):]: s for n, s in plan.items() if n.startswith(f"{prefix}.{i}.")}
            collector = HessianCollector(list(local))
            handles = [layer.get_submodule(n).register_forward_pre_hook(collector.hook(f"{prefix}.{i}.{n}"))
                       for n in local]
            try:
                run_layer(layer, inputs)
            finally:
                for h in handles:
                    h.remove()
            hessians = {n: collector.H[f"{prefix}.{i}.{n}"] for n in local}
            layer_q, layer_stats = method(layer, inputs, local, hessians)
            for n, qw in layer_q.items():
                linear = layer.get_submodule(n)
                linear.weight.data = qw.dequantize(linear.weight.dtype).to(linear.weight.device)
            inputs = LayerInputs(run_layer(layer, inputs), inputs.kwargs)
            for n in local:
                quantized[f"{prefix}.{i}.{n}"] = layer_q[n]
                stats[f"{prefix}.{i}.{n}"] = layer_stats[n]
            if work_dir is not None:
                save_progress(work_dir, i, layer, local, layer_q, inputs.hidden, stats, run_id)
            layers[i].to(home)
    return quantized, stats


# ------------------------------------------------------------------ resuming

def _layer_file(work_dir: Path, i: int) -> Path:
    return work_dir / f"layer{i:05d}.safetensors"


def save_progress(work_dir: Path, i: int, layer, local_plan: dict, layer_q: dict, hidden: list, stats: dict,
                  run_id: str) -> None:
    """After layer ``i``: its float tensors (as the method left them), its quantized
    weights, the next layer's inputs, and the stats so far. Each file lands by rename."""
    work_dir.mkdir(parents=True, exist_ok=True)
    skip = {f"{n}.weight" for n in local_plan}
    tensors = {f"float.{k}": v.detach().contiguous().cpu() for k, v in layer.state_dict().items() if k not in skip}
    for n, qw in layer_q.items():
        tensors.update(qw.to_tensors(f"quant.{n}", qw.scale.dtype))
    for name, payload in ((_layer_file(work_dir, i).name, tensors),
                          ("hidden.safetensors", {f"h{j}": h.contiguous().cpu() for j, h in enumerate(hidden)})):
        save_file(payload, work_dir / f"{name}.tmp")
        (work_dir / f"{name}.tmp").replace(work_dir / name)
    (work_dir / "progress.json.tmp").write_text(json.dumps({"done": i + 1, "run_id": run_id, "stats": stats}))
    (work_dir / "progress.json.tmp").replace(work_dir / "progress.json")


def load_progress(work_dir: Path, layers, prefix: str, plan: dict, quantized: dict, device,
                  run_id: str) -> tuple[int, dict, list]:
    """Restore the finished layers of an interrupted run; return (done, stats, next inputs).
    The plan comes from the same recipe and model, so it names the same schemes."""
    state = json.loads((work_dir / "progress.json").read_text())
    if state.get("run_id") != run_id:
        raise ValueError(f"{work_dir} was made by a different recipe or model; delete it, or run without --resume")
    done, stats = state["done"], state["stats"]
    for i in range(done):
        tensors = load_file(_layer_file(work_dir, i))
        floats = {k[len("float."):]: v for k, v in tensors.items() if k.startswith("float.")}
        layers[i].load_state_dict(floats, strict=False)
        layer_prefix = f"{prefix}.{i}."
        for full, scheme in plan.items():
            if not full.startswith(layer_prefix):
                continue
            local = full[len(layer_prefix):]
            qw = QuantizedWeight.from_tensors(tensors, f"quant.{local}", scheme)
            quantized[full] = qw
            linear = layers[i].get_submodule(local)
            linear.weight.data = qw.dequantize(linear.weight.dtype)
    hidden_file = load_file(work_dir / "hidden.safetensors")
    hidden = [hidden_file[f"h{j}"].to(device) for j in range(len(hidden_file))]
    return done, stats, hidden
