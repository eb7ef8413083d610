"""Serving benchmark: lowbit's engine (fp16, W4 g128, W4 + INT4 KV cache) against transformers
``generate`` fp16, on a Llama-3-8B-shaped model with random weights, on one CUDA GPU.

    python -m bench.engine [--configs fp16,w4g128,w4g128+kv-int4] [--batch 1,8,32] [--prompt-len 512,4096]
                           [--output-len 256] [--arrivals 64] [--rate 4] [--prefill-chunk 4096] [--no-baseline]
                           [--json OUT]
    python -m bench.engine --smoke      # the same code on a tiny CPU model: checks the script, times nothing real

The same as ``lowbit bench`` (the code is ``evals/serving.py``). Refuses without a GPU. Writes
``bench/results/engine/<device>-<commit>.json`` with device, versions and commit.
"""

import sys

from lowbit.cli import main

if __name__ == "__main__":
    main(["bench", *sys.argv[1:]])
