"""Gemma 2, Gemma 3 and Phi-3: what lowbit plans for real-shaped configs, and what quantization costs the
tiny random models the tests build.

    python -m bench.families [--out bench/results/quality/families.json]

* ``lowbit plan`` (``evals.planner``) on google/gemma-3-27b-it's and a Phi-3-mini-128k-shaped
  config.json: bytes per token per KV scheme at 32k context in 80 GB;
* per family, a tiny random model (``lowbit_testing/tiny_models.py``) with a few outlier input channels (as trained
  models have, ``with_outlier_channels``): logit mean squared error against the float model, through
  W4 g32 checkpoints of RTN, AWQ (then RTN), GPTQ and AWQ+GPTQ (16 calibration samples of 32 random
  tokens, 2 x 32 held-out tokens);
* per family and KV scheme, the largest logit error of a cached forward (19 tokens prefilled, then
  one at a time to 40) against the same W4 model without a cache, as a share of the largest logit.

Deterministic (seeded); CPU only. The test suite asserts the orderings (tests/test_architectures_gemma.py).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path

from bench.results_file import write_result
from evals.provenance import commit, provenance

ROOT = Path(__file__).resolve().parent.parent


FAMILIES = ["gemma2", "gemma3", "phi3"]
METHODS = ["rtn", "awq", "gptq", "awq+gptq"]
# the tests assert these tolerances on what quality() measures (tests/test_architectures_gemma.py)
KV_SCHEMES = {  # scheme: largest logit error of a cached forward against the plain one, as a share of the logits' range
    "fp16-r16": 1e-5, "int8-r16": 0.02, "fp8-r16": 0.1, "int4-g16-r16": 0.25, "int2-g16-r16": 0.6}

# google/gemma-3-27b-it's config.json (transformers 4.50): the text part leaves most keys to the defaults
GEMMA3_27B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
    "mm_tokens_per_image": 256, "torch_dtype": "bfloat16",
    "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
                    "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                    "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "num_hidden_layers": 27,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "patch_size": 14}}
# microsoft/Phi-3-mini-128k-instruct's shape (LongRoPE factors shortened to their length, 48)
PHI3_MINI_128K = {
    "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 262144,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [4.0] * 48},
    "tie_word_embeddings": False, "vocab_size": 32064, "torch_dtype": "bfloat16", "hidden_act": "silu"}


def plans() -> dict:
    from evals import planner

    out = {}
    for name, config in (("gemma-3-27b-it", GEMMA3_27B), ("phi-3-mini-128k-shaped", PHI3_MINI_128K)):
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "config.json").write_text(json.dumps(config))
            p = planner.plan(d, planner.parse_memory("80GB"), 32768, ["fp16", "int8", "int4-g32", "int2-g32", "fp8"])
        out[name] = {"attention": p["attention"], "weights": p["weights"],
                     "kv_bytes_per_token": {r["scheme"]: r.get("kv_bytes_per_token") for r in p["schemes"]},
                     "sequences_of_32k_in_80GB": {r["scheme"]: r.get("max_sequences") for r in p["schemes"]}}
    return out


def quality(kind: str, work: Path) -> dict:
    import torch

    import runtime
    from lowbit_testing.tiny_models import ids_for, quantized_checkpoint, tiny_model, with_outlier_channels

    model = with_outlier_channels(tiny_model(kind, seed=4)[0])
    held_out = ids_for(model, n=2, length=32, seed=11)
    with torch.no_grad():
        reference = model(held_out).logits
    mse = {}
    for methods in METHODS:
        out, _, _ = quantized_checkpoint(kind, work, methods, outliers=True)
        mse[methods] = float((runtime.load(out).logits(held_out) - reference).pow(2).mean())
    (work / "plain").mkdir()
    out, _, _ = quantized_checkpoint(kind, work / "plain")
    ids = ids_for(model, n=2, length=40)
    kv = {}
    for name in KV_SCHEMES:
        rt = runtime.load(out, kv=name)
        expected = rt.logits(ids)
        cache = rt.new_cache(40, batch=2)
        with torch.inference_mode():
            got = [rt.decoder(ids[:, :19], cache, 0)] + [rt.decoder(ids[:, p:p + 1], cache, p) for p in range(19, 40)]
        kv[name] = float((torch.cat(got, 1) - expected).abs().max() / expected.abs().max())
    return {"logit_mse_vs_float": mse, "kv_cached_logit_error_share": kv}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "quality" / "families.json")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    code_version = commit()
    result = {"benchmark": "Gemma 2 / Gemma 3 / Phi-3: lowbit plan on real shapes, quantization error on tiny models",
              "plans": plans(), "tiny": {}}
    with tempfile.TemporaryDirectory() as d:
        for kind in FAMILIES:
            (Path(d) / kind).mkdir()
            result["tiny"][kind] = quality(kind, Path(d) / kind)
            print(kind, json.dumps(result["tiny"][kind]), flush=True)
    result.update(provenance("cpu"), commit=code_version)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
