"""What sliding-window rings save in the KV cache at a long context, measured and planned.

    python -m bench.kv_rings [--context 32768] [--out bench/results/kv/rings.json]

Two public shapes (config values as published on the Hugging Face hub):

* Gemma-3-27B (``gemma3_text``): 62 layers, 16 KV heads x head_dim 128, every 6th layer global
  (``sliding_window_pattern`` 6: 52 local layers with a 1,024-token window, 10 global);
* Mistral-7B-v0.1: 32 layers, 8 KV heads x head_dim 128, every layer within a 4,096-token window.

For each, ``lowbit plan``'s numbers (``evals.planner.plan`` on the config, bytes per sequence at
``--context`` with and without rings, per KV scheme) and a measurement: a real ``KVCache``
allocated on the CPU with the same layers, windows, head_dim and block size but one KV head
(every byte of the cache is per head, so the ratio is the real one), grown to ``--context``
positions the way the engine grows a sequence (``reserve`` at each block boundary, then
``advance``). Measured bytes are the pages it holds times their bytes plus its residual blocks;
the same for a cache that keeps every position (no windows). The factor is their ratio.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from bench.results_file import write_result
from evals import planner
from evals.provenance import provenance
from kvquant import parse_kv
from kvquant.memory import residual_bytes
from runtime.cache import KVCache

ROOT = Path(__file__).resolve().parent.parent


GEMMA3_27B = {  # google/gemma-3-27b-it text_config
    "model_type": "gemma3_text", "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
    "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "vocab_size": 262208,
    "sliding_window": 1024, "sliding_window_pattern": 6, "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16", "tie_word_embeddings": True,
    # what transformers' Gemma3TextConfig derives from sliding_window_pattern
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)],
}
MISTRAL_7B = {  # mistralai/Mistral-7B-v0.1
    "model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 32000, "sliding_window": 4096,
    "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
}
SCHEMES = ("fp16", "int8", "int4", "int2", "fp8")
MEASURED = ("int8", "int4", "fp8")  # an uncapped fp16 Gemma cache at 32k would need ~1 GB even at one head


def grown_bytes(layers: int, head_dim: int, windows, scheme, context: int) -> int:
    """Bytes one sequence holds in an allocated one-head cache grown to ``context`` positions."""
    probe = KVCache(layers, 1, 1, head_dim, context, torch.float16, "cpu", scheme=scheme, windows=windows,
                    num_blocks=1)
    pages = probe.pages_for(context, chunk=scheme.block_size) + 1
    del probe
    cache = KVCache(layers, 1, 1, head_dim, context, torch.float16, "cpu", scheme=scheme, windows=windows,
                    num_blocks=pages)
    slot, B = cache.add_sequence(), cache.block_size
    for end in range(B, context + 1, B):  # each block boundary the sequence crosses, as the engine reserves
        cache.advance(slot, end - 1 - cache.seq_lengths[slot])
        assert cache.reserve(slot, end), "the pool is sized for the ring"
        cache.advance(slot, 1)
    held = cache.pages_held() * cache.block_bytes() + residual_bytes(scheme, layers, 1, head_dim)
    assert cache.pages_held() == cache.pages_for(context)
    return held


def shape_report(name: str, config: dict, context: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(config))
        plan = planner.plan(str(path), 10**12, context, SCHEMES)
    layers, _, head_dim = planner.attention_shape(config)
    windows = planner.sliding_windows(config, layers)
    measured = {}
    for scheme_name in MEASURED:
        scheme = parse_kv(scheme_name)
        ring = grown_bytes(layers, head_dim, windows, scheme, context)
        flat = grown_bytes(layers, head_dim, None, scheme, context)
        measured[scheme.name] = {"bytes_with_rings_one_head": ring, "bytes_without_rings_one_head": flat,
                                 "factor": flat / ring}
    planned = {r["scheme"]: {k: r[k] for k in ("bytes_per_sequence", "bytes_per_sequence_without_rings",
                                               "ring_factor", "kv_bytes_per_token_at_context", "layer_types")}
               for r in plan["schemes"]}
    return {"shape": name, "config": {k: v for k, v in config.items() if k != "layer_types"},
            "layer_types": plan["attention"]["layer_types"], "planned": planned, "measured": measured}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kv" / "rings.json")
    args = ap.parse_args(argv)
    shapes = [shape_report("Gemma-3-27B", GEMMA3_27B, args.context),
              shape_report("Mistral-7B-v0.1", MISTRAL_7B, args.context)]
    for s in shapes:
        for name, m in s["measured"].items():
            planned = s["planned"][name]["ring_factor"]
            print(f"{s['shape']:<16} {name:<14} rings save {m['factor']:.2f}x measured, {planned:.2f}x planned "
                  f"at {args.context:,} tokens")
    result = {"bench": "kv_rings", "context": args.context, **provenance("cpu"), "shapes": shapes,
              "protocol": __doc__.split("\n\n", 2)[2]}
    write_result(args.out, result)


if __name__ == "__main__":
    main()
