"""Perplexity of quantized checkpoints through the CPU kernels against the dense reference path.

    python -m bench.cpu_perplexity CHECKPOINT [CHECKPOINT ...] [--tokens 4096]

Each checkpoint (e.g. ``lowbit quantize default`` and ``w8-rtn`` of SmolLM2-135M) is loaded twice
on CPU in float32: with the quantized Linears on PyTorch's weight-only kernels (bf16 activations,
``runtime/cpu_linear.py``; embedding and lm_head kept in the checkpoint's bf16, lm_head multiplied in
bf16) and on the dense float32 reference (``cpu_kernels=False``, every float weight in float32). Perplexity by
``evals.perplexity`` on the bundled default text (window 1024, stride 512, the first ``--tokens``
tokens, no BOS: SmolLM2's tokenizer adds none). Reports both and the relative difference (target:
within 0.2%). Raw JSON with device, versions and commit under bench/results/cpu/.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch

from bench.results_file import write_result
from evals.provenance import commit, cpu_name, versions

ROOT = Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", type=Path)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu" / "perplexity.json")
    args = ap.parse_args()
    import runtime
    from evals.perplexity import Protocol, perplexity, tokenize_text
    from evals.texts import load_text
    from quant import checkpoint

    warnings.simplefilter("ignore")
    protocol = Protocol(window=1024, stride=512, tokens=args.tokens)
    rows = []
    for path in args.checkpoints:
        row = {"checkpoint": str(path), "recipe": (checkpoint.read_manifest(path) or {}).get("recipe")}
        for name, kernels in (("cpu_kernels", True), ("dense_reference", False)):
            model = runtime.load(path, cpu_kernels=kernels)
            ids = tokenize_text(model.tokenizer, load_text("default"), protocol)
            with torch.inference_mode():
                row[name] = perplexity(model.logits, ids, protocol, progress=False).ppl
            del model
        row["relative_difference"] = row["cpu_kernels"] / row["dense_reference"] - 1
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"commit": commit(), "device": f"cpu: {cpu_name()}", "versions": versions(),
              "protocol": protocol.describe() + ", bundled default text", "rows": rows}
    write_result(args.out, result)


if __name__ == "__main__":
    main()
