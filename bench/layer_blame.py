"""Which decoder layers of a quantized checkpoint break a text, and where its error sits.

    python -m bench.layer_blame CHECKPOINT [--text code=4096] [--out bench/results/quality/layer-blame.json]

For a checkpoint of the bundled SmolLM2-135M (or any model whose float weights ``quant.models``
resolves from the checkpoint's manifest): the text's perplexity (both protocols of
``bench.scoring``) with every quantized Linear dequantized into the float model, then with one
decoder layer at a time given back its float weights; a layer whose restoration mends the text is
where the damage was done. Then the difference between the float and the quantized model's hidden
states after each layer, on calibration windows and on the text: its mean square, the share of it
on each window's first token and on the largest channel, and the float stream's largest activation
(massive activations sit on few tokens and channels and can dominate a squared-error loss).
The model runs in bfloat16 as the checkpoint's runtime does.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.results_file import write_result
from bench.scoring import commit, parse_texts, score_texts
from evals.provenance import versions
from evals.texts import load_text
from quant.calibration import calibration_samples, load_calibration_text
from quant.checkpoint import read_config, read_manifest, read_tensors
from quant.format import QuantizedWeight, linear_schemes
from quant.models import resolve

ROOT = Path(__file__).resolve().parent.parent


def load_pair(checkpoint: Path):
    """The float model, its tokenizer, and {Linear: (float weight, dequantized weight)}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    manifest = read_manifest(checkpoint) or {}
    source = resolve(manifest.get("recipe", {}).get("model", "smollm2-135m"))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
    tensors = read_tensors(checkpoint)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    weights = {n: (model.get_submodule(n).weight.detach().clone(),
                   QuantizedWeight.from_tensors(tensors, n, s).dequantize(torch.bfloat16))
               for n, s in linear_schemes(read_config(checkpoint), names).items()}
    return model, AutoTokenizer.from_pretrained(source), weights, manifest


def set_weights(model, weights: dict, quantized) -> None:
    """Each Linear's dequantized weight where ``quantized(name)``, its float weight elsewhere."""
    with torch.no_grad():
        for name, (w_float, w_quant) in weights.items():
            model.get_submodule(name).weight.copy_(w_quant if quantized(name) else w_float)


def hidden_states(model, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return [h.float() for h in model(ids, output_hidden_states=True).hidden_states[1:]]


def drift(model, weights: dict, ids: torch.Tensor) -> list[dict]:
    """Per layer: where the quantized stream's difference from the float stream sits."""
    set_weights(model, weights, lambda n: False)
    ours = hidden_states(model, ids)
    set_weights(model, weights, lambda n: True)
    theirs = hidden_states(model, ids)
    rows = []
    for i, (f, q) in enumerate(zip(ours, theirs)):
        err = (f - q).pow(2)
        rows.append({"layer": i, "mse": float(err.mean()), "first_token_share": float(err[:, 0].sum() / err.sum()),
                     "top_channel_share": float(err.sum((0, 1)).max() / err.sum()),
                     "float_max_abs": float(f.abs().max()), "float_max_channel": int(f.abs().amax((0, 1)).argmax())})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--text", default="code=4096", help="TEXT=TOKENS scored per restored layer")
    parser.add_argument("--windows", type=int, default=8, help="calibration windows of 512 tokens for the drift")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    text = parse_texts([args.text])
    name = next(iter(text))
    model, tokenizer, weights, manifest = load_pair(args.checkpoint)

    def score() -> dict:
        scores = score_texts(lambda ids: model(ids).logits, tokenizer, text)
        return {protocol: by_text[name]["ppl"] for protocol, by_text in scores.items()}

    with torch.no_grad():
        set_weights(model, weights, lambda n: True)
        result = {"all quantized": score(), "one layer float": []}
        print("all quantized", result["all quantized"], flush=True)
        layers = sorted({int(n.split(".layers.")[1].split(".")[0]) for n in weights if ".layers." in n})
        for i in layers:
            set_weights(model, weights, lambda n, i=i: f".layers.{i}." not in n)
            result["one layer float"].append({"layer": i, "ppl": score()})
            print(i, result["one layer float"][-1]["ppl"], flush=True)
        calib = calibration_samples(tokenizer, load_calibration_text("default"), args.windows, 512, 0)
        ids = tokenizer(load_text(name), return_tensors="pt").input_ids[:, :args.windows * 512]
        result["drift"] = {"calibration": drift(model, weights, calib),
                           name: drift(model, weights, ids[:, :ids.shape[1] // 512 * 512].reshape(-1, 512))}
    record = {"commit": commit(), "device": "cpu", "versions": versions(), "checkpoint": str(args.checkpoint),
              "recipe": manifest.get("recipe"), "text": args.text, **result}
    if args.out:
        write_result(args.out, record)
    print(json.dumps(result["drift"]["calibration"][9:16], indent=None))


if __name__ == "__main__":
    main()
