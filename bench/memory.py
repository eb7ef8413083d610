"""Does the calibration pipeline's memory grow with one decoder layer, or with the model?

    python -m bench.memory [--samples 128] [--out bench/results/quantize/memory.json]

Quantizes SmolLM2-135M with GPTQ (4-bit, group 64, asymmetric) twice, each in a
fresh child process, the way `lowbit quantize` does (the decoder layers read from
the safetensors one at a time, `quant.models.load_lazily`): as it is (30 layers)
and a copy written to a temporary directory with every decoder layer repeated
(60 layers, 2x the layer weights). A sampler thread reads the process's resident
memory every few milliseconds. Reported per depth:

* ``rss_before``: resident memory when the pipeline starts (embeddings loaded,
  decoder layers still on disk);
* ``peak``: the highest resident memory during the pipeline;
* ``working``: ``peak - rss_before``: calibration activations, one layer's float
  weights, Hessians and GPTQ temporaries, and the quantized results so far (one
  int8 per weight until the checkpoint is packed, the only part that grows with depth).

Each depth runs twice: with glibc's default (dynamic) mmap threshold, and with a
fixed one (``MALLOC_MMAP_THRESHOLD_``), which returns freed activations to the
system at once (slower: every large tensor is fresh pages).

On CUDA the script also reports the compute device's peak allocation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

from bench.results_file import write_result
from bench.scoring import commit

ROOT = Path(__file__).resolve().parent.parent


PAGE = os.sysconf("SC_PAGE_SIZE")
# glibc raises its mmap threshold as large blocks are freed, so later activations come from
# the heap, whose freed holes stay resident: RSS then grows with every layer although the
# pipeline frees what it allocates. A fixed threshold (each run once with it) shows what
# the pipeline itself holds.
FIXED_MMAP_THRESHOLD = 65536


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakSampler:
    """Highest resident memory seen while the ``with`` block runs."""

    def __init__(self, every_s: float = 0.005):
        self.every_s, self.peak, self._stop = every_s, 0, threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.every_s)

    def __enter__(self):
        self.peak = rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def deeper_copy(source: Path, target: Path, repeat: int) -> None:
    """``source`` with its decoder layers repeated ``repeat`` times, written to ``target``."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    layers = config["num_hidden_layers"]
    deeper = {}
    for name, t in tensors.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            for r in range(repeat):  # distinct tensors in the file: each layer is read on its own
                deeper[f"model.layers.{int(i) + r * layers}.{rest}"] = t.clone()
        else:
            deeper[name] = t
    target.mkdir(parents=True)
    save_file(deeper, target / "model.safetensors", metadata={"format": "pt"})
    for f in source.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, target / f.name)
    (target / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers * repeat}, indent=2))


def one(source: Path, samples: int) -> dict:
    import torch

    from quant import models
    from quant.affine import QuantScheme
    from quant.calibration import calibration_samples, load_calibration_text
    from quant.plan import plan_layers
    from quant.quantize import quantize_model

    torch.manual_seed(0)
    model, tokenizer, lazy = models.load_lazily(source)
    layers = model.model.layers
    layer_bytes = sum(p.numel() * p.element_size() for p in layers.parameters())  # as they will be, once read
    ids = calibration_samples(tokenizer, load_calibration_text("default"), samples, 512, seed=0)
    plan = plan_layers(model, QuantScheme(4, 64, False, "weight"), ["lm_head"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = rss()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        quantize_model(model, plan, "gptq", samples=ids, device=device, progress=False, lazy=lazy)
    row = {"layers": len(layers), "layer_weight_bytes": layer_bytes, "rss_before": before, "peak": sampler.peak,
           "working": sampler.peak - before, "seconds": time.perf_counter() - start}
    if device == "cuda":
        row["cuda_peak_allocated"] = torch.cuda.max_memory_allocated()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=32, help="calibration samples of 512 tokens")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "quantize" / "memory.json")
    ap.add_argument("--one", type=Path, help="Measure only this model directory, in this process.")
    ap.add_argument("--no-heap-trim", action="store_true", help="With --one: never hand freed heap pages back (A/B).")
    args = ap.parse_args()
    if args.no_heap_trim:
        import quant.sequential

        quant.sequential._HeapTrim.MARGIN = 1 << 62  # never reached
    if args.one:
        print(json.dumps(one(args.one, args.samples)))
        return
    import subprocess
    import tempfile

    from quant.models import resolve

    code_version = commit()
    source = resolve("smollm2-135m")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        deeper_copy(source, Path(tmp) / "x2", 2)
        for threshold in (None, FIXED_MMAP_THRESHOLD):
            for model_dir in (source, Path(tmp) / "x2"):
                env = {**os.environ, **({"MALLOC_MMAP_THRESHOLD_": str(threshold)} if threshold else {})}
                out = subprocess.run([sys.executable, "-m", "bench.memory", "--one", str(model_dir), "--samples",
                                      str(args.samples)], capture_output=True, text=True, check=True, env=env,
                                     cwd=ROOT).stdout
                rows.append({**json.loads(out.strip().splitlines()[-1]), "malloc_mmap_threshold": threshold})
                print(json.dumps(rows[-1]), flush=True)
    result = {"commit": code_version, "device": f"cpu ({os.cpu_count()} cores)", "samples": args.samples,
              "seq_len": 512, "method": "gptq w4 g64 asym, actorder weight",
              "loading": "decoder layers read from the safetensors one at a time (quant.models.load_lazily)", "rows": rows}
    write_result(args.out, result)
    gb = 1e9
    print("| glibc mmap threshold | layers | layer weights GB | RSS before GB | peak GB | working set GB | seconds |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        threshold = "dynamic (default)" if r["malloc_mmap_threshold"] is None else f"fixed {r['malloc_mmap_threshold']}"
        print(f"| {threshold} | {r['layers']} | {r['layer_weight_bytes'] / gb:.2f} | {r['rss_before'] / gb:.2f} | "
              f"{r['peak'] / gb:.2f} | {r['working'] / gb:.2f} | {r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
