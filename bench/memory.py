"""Does the calibration pipeline's memory grow with one decoder layer, or with the model?

    python bench/memory.py [--samples 32] [--out bench/results/memory-cpu.json]

Quantizes SmolLM2-135M with GPTQ (4-bit, group 64, asymmetric) twice, each in a
fresh child process: as it is (30 layers) and with every decoder layer repeated
(60 layers, 2x the layer weights). A sampler thread reads the process's resident
memory every few milliseconds. Reported per depth:

* ``rss_before``: resident memory when the pipeline starts (the float model loaded);
* ``peak``: the highest resident memory during the pipeline;
* ``working``: ``peak - rss_before``, what the pipeline itself adds: calibration
  activations, one layer's Hessians and GPTQ temporaries, and the quantized results
  it has produced so far (one int8 per weight until the checkpoint is packed).

On CPU the float model itself lives in the same memory, so ``rss_before`` grows
with depth by the size of the extra layers; the working set should not, apart
from the int8 results. On CUDA the script also reports the compute device's peak
allocation, where only the current layer sits.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scoring import commit  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


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


def one(repeat: int, samples: int) -> dict:
    import torch

    from quant import models
    from quant.affine import QuantScheme
    from quant.calibration import calibration_samples, load_calibration_text
    from quant.plan import plan_layers
    from quant.quantize import quantize_model

    torch.manual_seed(0)
    model, tokenizer = models.load_float_model(models.resolve("smollm2-135m"))
    layers = model.model.layers
    if repeat > 1:  # distinct copies, so the extra layers really take memory
        for layer in list(layers) * (repeat - 1):
            layers.append(copy.deepcopy(layer))
        model.config.num_hidden_layers = len(layers)
    layer_bytes = sum(p.numel() * p.element_size() for p in layers.parameters())
    ids = calibration_samples(tokenizer, load_calibration_text("default"), samples, 512, seed=0)
    plan = plan_layers(model, QuantScheme(4, 64, False, "weight"), ["lm_head"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = rss()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        quantize_model(model, plan, "gptq", samples=ids, device=device, progress=False)
    row = {"layers": len(layers), "layer_weight_bytes": layer_bytes, "rss_before": before, "peak": sampler.peak,
           "working": sampler.peak - before, "seconds": time.perf_counter() - start}
    if device == "cuda":
        row["cuda_peak_allocated"] = torch.cuda.max_memory_allocated()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=32, help="calibration samples of 512 tokens")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "memory-cpu.json")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.samples)))
        return
    import subprocess

    code_version = commit()
    rows = []
    for repeat in (1, 2):
        out = subprocess.run([sys.executable, __file__, "--one", str(repeat), "--samples", str(args.samples)],
                             capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    result = {"commit": code_version, "device": f"cpu ({os.cpu_count()} cores)", "samples": args.samples,
              "seq_len": 512, "method": "gptq w4 g64 asym, actorder weight", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    gb = 1e9
    print("| layers | layer weights GB | RSS before GB | peak GB | working set GB | seconds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['layer_weight_bytes'] / gb:.2f} | {r['rss_before'] / gb:.2f} | "
              f"{r['peak'] / gb:.2f} | {r['working'] / gb:.2f} | {r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
