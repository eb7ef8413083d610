"""lowbit's calibrated rounding methods on llama.cpp's GGUF mixes, judged by lowbit's own perplexity.

    python -m bench.gguf_methods [--mixes Q3_K_M Q4_K_M] [--methods rtn gptq awq signround]
        [--samples 32] [--seq-len 512] [--calibration mixed] [--eval-tokens 4096]
        [--signround-iters 200] [--signround-batch 8]
        [--out bench/results/gguf/methods-smollm2.json]

On SmolLM2-135M, each ``gguf:`` recipe target (``quant.gguf_quantize.quantize_gguf``: llama.cpp's
per-tensor types, every Linear of the decoder layers rounded by the method on its type's own grid,
embedding and head rounded to nearest) from the same calibration windows (``quant.calibration``,
seed 0). The model then holds exactly what the file would (the fields dequantized as llama.cpp
dequantizes them; the decoder layers' norms as the method left them) and is scored by
``evals.perplexity`` (float32, sliding window 512, stride 256, no BOS) on the first
``--eval-tokens`` tokens of Persuasion (prose) and CPython's argparse.py (code), none calibrated on.
No llama.cpp needed: this compares the methods, ``bench.gguf_vs_llamacpp`` compares the files with
llama.cpp's own. Each row is saved as it finishes (a long run leaves what it measured).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.results_file import write_result

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "gguf" / "methods-smollm2.json"
TEXTS = {"persuasion": "persuasion", "code": "code"}


def quantized_model(float_model, fields: dict):
    """A copy of ``float_model`` holding what the GGUF fields dequantize to (and the float tensors given)."""
    from quant.gguf import GGUFFields, dequantize

    model = copy.deepcopy(float_model)
    state = model.state_dict()
    new = {n: dequantize(f) if isinstance(f, GGUFFields) else f for n, f in fields.items()}
    if model.config.tie_word_embeddings and "model.embed_tokens.weight" in new:
        new["lm_head.weight"] = new["model.embed_tokens.weight"]
    model.load_state_dict({**state, **{n: t.to(state[n].dtype) for n, t in new.items()}})
    return model


def scores(model, token_ids: dict, protocol) -> dict:
    from evals.perplexity import hf_logits_fn, perplexity

    out = {}
    for name, ids in token_ids.items():
        result = perplexity(hf_logits_fn(model), ids, protocol, progress=False)
        out[name] = {"ppl": round(result.ppl, 4), "nll": round(result.nll, 5), "tokens_scored": result.tokens_scored}
    return out


def settings_for(methods: list[str], args) -> dict:
    """Each method's settings: its defaults, SignRound's steps and batch from the command line."""
    from quant import methods as registry
    from quant.learned_rounding import SignRoundConfig

    chosen = {m.name: m.settings() for m in registry.chain(methods)}
    if "signround" in chosen:
        chosen["signround"] = SignRoundConfig(iters=args.signround_iters, batch_size=args.signround_batch)
    return chosen


def layer_inputs(model, layers, ids: torch.Tensor, upto: int):
    """The float model's inputs to decoder layer ``upto`` for windows ``ids`` (LayerInputs)."""
    from quant.sequential import LayerInputs, capture_inputs, run_layer

    inputs, kwargs = capture_inputs(model, layers, ids, 4, "cpu")
    for i in range(upto):
        inputs = LayerInputs(run_layer(layers[i], inputs), kwargs[i + 1])
    return inputs


def layer_rows(args, float_model, samples, token_ids, save) -> None:
    """The layer-local look (``--layers``): each chosen decoder layer of the float model rounded alone by
    each method on its types under each mix (the calibration pipeline's own per-layer step, from the
    float model's inputs), its output error on the held-out texts' float inputs relative to the float
    layer's output energy. No error carried between layers: a proxy, not perplexity."""
    from quant import methods as registry
    from quant.architectures import architecture_of, decoder_layers
    from quant.gguf_mix import GridScheme
    from quant.gguf_quantize import plan_types
    from quant.quantize import layer_step
    from quant.sequential import run_layer

    prefix, layers = decoder_layers(float_model)
    arch = architecture_of(float_model)
    with torch.no_grad():
        for index in args.layers:
            calibration = layer_inputs(float_model, layers, samples, index)
            held = {k: layer_inputs(float_model, layers, ids[: ids.numel() // 512 * 512].view(-1, 512), index)
                    for k, ids in token_ids.items()}
            reference = {k: torch.cat(run_layer(layers[index], v)) for k, v in held.items()}
            where = f"{prefix}.{index}."
            for mix in args.mixes:
                types = plan_types(float_model, mix, calibrated=True)
                plan = {n[len(where):]: GridScheme(t) for n, t in types.items() if n.startswith(where)}
                for spec in args.methods:
                    methods = spec.split("+")
                    settings = settings_for(methods, args)
                    layer = copy.deepcopy(layers[index])
                    start = time.process_time()
                    layer_step(registry.chain(methods), settings, arch, None)(layer, calibration, plan, where)
                    seconds = time.process_time() - start
                    errors = {k: float((torch.cat(run_layer(layer, v)) - reference[k]).pow(2).sum()
                                       / reference[k].pow(2).sum()) for k, v in held.items()}
                    save({"layer": index, "mix": mix, "methods": spec, "quantize_cpu_s": round(seconds, 1),
                          "settings": {k: asdict(v) for k, v in settings.items()},
                          "types": {n: s.type_name for n, s in plan.items()},
                          "relative_output_error": {k: float(f"{v:.4g}") for k, v in errors.items()}})
                    print(index, mix, spec, {k: round(v, 5) for k, v in errors.items()}, f"{seconds:.0f} s", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mixes", nargs="+", default=["Q3_K_M", "Q4_K_M"])
    ap.add_argument("--methods", nargs="+", default=["rtn", "gptq", "awq", "signround"],
                    help="each a method list joined by '+', e.g. awq+gptq")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--calibration", default="mixed")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--signround-iters", type=int, default=200)
    ap.add_argument("--signround-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=lambda v: [int(x) for x in v.split(",")],
                    help="the layer-local look at these decoder layers (e.g. 0,15) instead of whole-model perplexity")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from evals.perplexity import Protocol, tokenize_text
    from evals.provenance import provenance
    from evals.texts import load_text
    from quant import models
    from quant.calibration import calibration_samples, load_calibration_text
    from quant.gguf_quantize import quantize_gguf

    source = models.resolve("smollm2-135m")
    float_model, tokenizer = models.load_float_model(source)
    protocol = Protocol(window=512, stride=256, tokens=args.eval_tokens, bos=False)
    token_ids = {k: tokenize_text(tokenizer, load_text(v), protocol) for k, v in TEXTS.items()}
    text = load_calibration_text(args.calibration)
    samples = calibration_samples(tokenizer, text, args.samples, args.seq_len, 0, None)
    result = {
        "bench": "gguf_methods", "command": "python -m bench.gguf_methods " + " ".join(sys.argv[1:]),
        **provenance("cpu"), "load_average_start": os.getloadavg(),
        "protocol": {"model": "smollm2-135m (float32)",
                     "calibration": f"{args.samples} x {args.seq_len} tokens of quant.calibration's "
                                    f"{args.calibration!r} source, seed 0, the same windows for every method",
                     "evaluation": f"evals.perplexity, {protocol.describe()}, lowbit's float32 model holding the "
                                   "GGUF fields dequantized as llama.cpp does (texts: persuasion, code)",
                     "torch_threads": args.threads},
        "rows": [],
    }

    def save(row: dict) -> None:
        result["rows"].append(row)
        write_result(args.out, result)  # after every row: a long run keeps what it has measured

    if args.layers is not None:
        result["protocol"]["evaluation"] = (
            f"layer-local (bench.gguf_methods.layer_rows): decoder layers {args.layers} of the float model, each "
            "rounded alone by the calibration pipeline's per-layer step from the float model's inputs; its output "
            f"error on the float inputs of the first {args.eval_tokens // 512 * 512} tokens of each text (windows "
            "of 512) as sum of squares over the float layer's; no error carried between layers (a proxy)")
        layer_rows(args, float_model, samples, token_ids, save)
        return
    result["float"] = scores(float_model, token_ids, protocol)
    for mix in args.mixes:
        for spec in args.methods:
            methods = spec.split("+")
            model = copy.deepcopy(float_model)
            start = time.process_time()
            settings = settings_for(methods, args)
            fields, _ = quantize_gguf(model, mix, methods, samples=samples, settings=settings, progress=False)
            seconds = time.process_time() - start
            quantized = quantized_model(float_model, fields)
            save({"mix": mix, "methods": spec, "settings": {k: asdict(v) for k, v in settings.items()},
                  "quantize_cpu_s": round(seconds, 1), **scores(quantized, token_ids, protocol)})
            print(mix, spec, {k: result["rows"][-1][k]["ppl"] for k in TEXTS}, f"{seconds:.0f} s CPU", flush=True)

if __name__ == "__main__":
    main()
