"""Saving a calibrated run's progress after every layer, and resuming from it (``--resume``).

A work directory beside the output holds, per finished layer, its float tensors as the layer
steps left them and its quantized weights (written by rank 0, which alone writes the
checkpoint), each rank's shard of the next layer's inputs, and ``progress.json``: how many
layers are done, the recipe that made them, the number of ranks, the stats so far.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from quant import distributed
from quant.format import QuantizedWeight


def _layer_file(work_dir: Path, i: int) -> Path:
    return work_dir / f"layer{i:05d}.safetensors"


def _hidden_file(work_dir: Path, i: int, world) -> Path:
    """Layer ``i``'s inputs on this rank: kept per layer, so a progress.json that is one layer
    behind (a run stopped between the two writes) still finds the inputs it names."""
    return work_dir / f"hidden{i:05d}-rank{world.rank}-of-{world.size}.safetensors"


def save_progress(work_dir: Path, i: int, layer, local_plan: dict, layer_q: dict, hidden: list, stats: dict,
                  run_id: str, reference: list | None = None) -> None:
    """After layer ``i``: its float tensors (as the method left them) and quantized weights (rank
    0), each rank's shard of the next layer's inputs (and of the float model's, ``reference``,
    when the method carries them), then, once every rank has saved, the stats so far and the
    count of finished layers (rank 0). Each file lands by rename."""
    world = distributed.current()
    work_dir.mkdir(parents=True, exist_ok=True)
    streams = {f"h{j}": h for j, h in enumerate(hidden)} | {f"f{j}": h for j, h in enumerate(reference or [])}
    files = [(_hidden_file(work_dir, i + 1, world), {k: h.contiguous().cpu() for k, h in streams.items()})]
    if world.main:
        skip = {f"{n}.weight" for n in local_plan}
        tensors = {f"float.{k}": v.detach().contiguous().cpu() for k, v in layer.state_dict().items() if k not in skip}
        for n, qw in layer_q.items():
            tensors.update(qw.to_tensors(f"quant.{n}", qw.scale.dtype))
        files.insert(0, (_layer_file(work_dir, i), tensors))
    for path, payload in files:
        save_file(payload, path.with_name(path.name + ".tmp"))
        path.with_name(path.name + ".tmp").replace(path)
    world.barrier()
    if world.main:
        state = {"done": i + 1, "run_id": run_id, "world_size": world.size, "stats": stats}
        (work_dir / "progress.json.tmp").write_text(json.dumps(state))
        (work_dir / "progress.json.tmp").replace(work_dir / "progress.json")
    # progress.json now names layer i or i + 1 (rank 0 may not have written it yet): older inputs are spent
    for old in range(i):
        _hidden_file(work_dir, old, world).unlink(missing_ok=True)


def _read_state(work_dir: Path, run_id: str, size: int) -> dict | None:
    """Rank 0's reading of progress.json: the state, None when there is none, or the refusal."""
    if not (work_dir / "progress.json").exists():
        return None
    state = json.loads((work_dir / "progress.json").read_text())
    if state.get("run_id") != run_id:
        return {"error": f"{work_dir} was made by a different recipe or model; delete it, or run without --resume"}
    if state.get("world_size", 1) != size:
        return {"error": f"{work_dir} was made by {state.get('world_size', 1)} rank(s), this run has {size}: each "
                         "rank's calibration inputs are saved there, so resume with the same number of ranks "
                         "(or run without --resume)"}
    return state


def load_progress(work_dir: Path, layers, prefix: str, plan: dict, quantized: dict, device,
                  run_id: str) -> tuple[int, dict, list, list | None] | None:
    """Restore the finished layers of an interrupted run; return (done, stats, next inputs, the
    float model's next inputs or None when the run carried none), or None when ``work_dir``
    holds no progress. The plan comes from the same recipe and model, so it
    names the same schemes. Only rank 0 restores the finished layers (it alone writes the
    checkpoint); every rank reads its own shard of the inputs."""
    world = distributed.current()
    state = world.broadcast_object(_read_state(work_dir, run_id, world.size) if world.main else None)
    if state is None:
        return None
    if "error" in state:
        raise ValueError(state["error"])
    done, stats = state["done"], state["stats"]
    for i in range(done if world.main else 0):
        tensors = load_file(_layer_file(work_dir, i))
        floats = {k[len("float."):]: v for k, v in tensors.items() if k.startswith("float.")}
        lazy = any(p.is_meta for p in layers[i].parameters())  # then the quantized weights stay on disk
        layers[i].load_state_dict(floats, strict=False, assign=lazy)
        layer_prefix = f"{prefix}.{i}."
        for full, scheme in plan.items():
            if not full.startswith(layer_prefix):
                continue
            local = full[len(layer_prefix):]
            qw = QuantizedWeight.from_tensors(tensors, f"quant.{local}", scheme)
            quantized[full] = qw
            linear = layers[i].get_submodule(local)
            if not lazy:
                linear.weight.data = qw.dequantize(linear.weight.dtype)
    hidden_path = _hidden_file(work_dir, done, world)
    if not hidden_path.exists():
        raise ValueError(f"rank {world.rank}: {hidden_path} is missing, so this rank cannot resume at layer {done}; "
                         "resume on the same machines with the same ranks, or run without --resume")
    streams = load_file(hidden_path)
    hidden = [streams[f"h{j}"].to(device) for j in range(sum(k.startswith("h") for k in streams))]
    reference = [streams[f"f{j}"].to(device) for j in range(sum(k.startswith("f") for k in streams))]
    return done, stats, hidden, reference or None
