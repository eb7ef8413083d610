"""What one engine decode step asks of the device, counted on CPU: host syncs, input copies,
kernel launches (per layer and per step). Counts, not timings: no GPU is needed or used.

    python -m bench.step_counts [--layers 4] [--batch 1,8] [--kv fp16-r16,int4-g16-r16] [--json OUT]

The engine runs the CUDA path on CPU tensors: the Triton attention kernels and the fused small
ops in the Triton interpreter, the linear layers as one GEMM each (on a GPU: ``quant_matmul``,
one launch, plus a split-K reduction where its tuning picks one). ``lowbit_testing.counting`` says what
each count covers. Rows: the fused small ops on (what ``runtime.load`` picks on CUDA) and off
(PyTorch ops: what the decoder launched before them), and ``Model.generate``'s decode step
(one sequence, fused ops on), which runs the engine's step code. Writes
``bench/results/engine/step-counts-<commit>.json``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU
ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402

import runtime  # noqa: E402
from runtime import Engine, SamplingParams  # noqa: E402
from bench.results_file import write_result  # noqa: E402
from evals.provenance import commit  # noqa: E402
from lowbit_testing.counting import decode_step_counts, generate_step_counts  # noqa: E402


def count(model_dir: Path, kv: str, batch: int, fused: bool) -> dict:
    model = runtime.load(model_dir, kv=kv, dtype=torch.bfloat16)  # the GPU's dtype, so casts count
    model.decoder.use_kernels(fused)
    engine = Engine(model, max_batch=batch, max_len=128, attention="triton")
    for i in range(batch):
        engine.submit([3 + (i + j) % 100 for j in range(5 + 3 * i)], SamplingParams(max_tokens=40, ignore_eos=True))
    while not engine.all_decoding:
        engine.step()
    steps = {}  # whether some sequence fills a block this step -> its counts (the first such step)
    for _ in range(16):  # every sequence crosses a block boundary within 16 steps
        fills = any((r.computed + 1) % engine.cache.block_size == 0 for r in engine.scheduler.decoders())
        counts = decode_step_counts(engine)
        steps.setdefault(fills, counts)
    return summary(steps, kv=kv, batch=batch, runner="Engine", fused_small_ops=fused)


def count_generate(model_dir: Path, kv: str) -> dict:
    """``Model.generate``'s decode steps (one sequence) on the same path: its launches next to the engine's."""
    model = runtime.load(model_dir, kv=kv, dtype=torch.bfloat16)
    model.decoder.use_kernels(True)
    model.decoder.attention_kernels = True  # what runtime.load picks on CUDA
    tokens = iter(model.generate(list(range(3, 8)), max_new_tokens=20, stop_at_eos=False))
    next(tokens)
    steps = {}
    for position in range(5, 21):
        steps.setdefault((position + 1) % model.kv_scheme.block_size == 0, generate_step_counts(model, tokens))
    return summary(steps, kv=kv, batch=1, runner="Model.generate", fused_small_ops=True)


def summary(steps: dict, **row) -> dict:
    """One result row from the counts of a step without and with a block fill (``steps[fills]``):
    the worst of each count, and the launches per layer of each kind of step."""
    worst = max(steps.values(), key=lambda c: c["launches"])
    return dict(**row, syncs=max(c["syncs"] for c in steps.values()),
                input_copies=max(c["input_copies"] for c in steps.values()), launches_per_step=worst["launches"],
                launches_per_layer=max(worst["launches_per_layer"]),
                launches_per_layer_no_fill=max(steps[False]["launches_per_layer"]),
                launches_per_layer_block_fills=max(steps[True]["launches_per_layer"]),
                triton_launches=worst["triton_launches"], ops=worst["ops"], ops_no_fill=steps[False]["ops"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--kv", default="fp16-r16,int4-g16-r16")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    from lowbit_testing.tiny_models import save_model, tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        model, tok = tiny_llama(hidden=128, layers=args.layers)  # head_dim 32: the attention kernels take it
        model_dir = save_model(model, tok, Path(tmp) / "m")
        rows = [count(model_dir, kv, int(b), fused) for kv in args.kv.split(",") for b in args.batch.split(",")
                for fused in (True, False)]
        rows += [count_generate(model_dir, kv) for kv in args.kv.split(",")]
    record = dict(what="one engine decode step on the CUDA path, counted on CPU (lowbit_testing/counting.py)",
                  commit=commit(), torch=torch.__version__, layers=args.layers, rows=rows)
    out = args.json or ROOT / "bench" / "results" / "engine" / f"step-counts-{record['commit']}.json"
    write_result(out, record)
    for r in rows:
        print(f"{r['runner']:>14} {r['kv']:>14} batch {r['batch']:>2} fused={r['fused_small_ops']!s:5}  "
              f"syncs {r['syncs']}  copies {r['input_copies']}  launches/layer {r['launches_per_layer_no_fill']:>2} "
              f"({r['launches_per_layer_block_fills']:>2} when a block fills)  /step {r['launches_per_step']}")


if __name__ == "__main__":
    main()
