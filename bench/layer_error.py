"""Each method's error at a real decoder layer's output, on windows it never calibrated on.

    python -m bench.layer_error [--layers 15 2] [--bits 2 3 4] [--methods rtn gptq "signround:min_range=0.7"]
                                [--out bench/results/quality/layer-error.json]

A cheap stand-in for perplexity on a machine too busy for whole-model runs: SmolLM2-135M's
float model runs the calibration windows (the bundled non-evaluation Austen novels, seed 0)
and held-out windows (the start of Persuasion) up to each chosen decoder layer; each method
then quantizes that one layer from the calibration windows exactly as the pipeline does
(``quant.quantize.layer_step``: layer steps, whole-layer rounding, the lockstep pass), and the
layer's output on the held-out windows is compared with the float layer's:
``||y_q - y|| / ||y||``, and over what the layer adds to its input, ``||y_q - y|| / ||y - x||``. Group 64, asymmetric, bf16 scales (as checkpoints
store them). Wall time and CPU time of each method are recorded (CPU time is the fairer
figure on a shared machine). Results are written after every row.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import torch

from bench.calibrated import method_settings
from bench.results_file import write_result
from bench.scoring import commit
from evals.provenance import versions
from evals.texts import load_text
from quant import methods as registry
from quant.affine import QuantScheme
from quant.architectures import architecture_of, decoder_layers
from quant.calibration import calibration_samples, load_calibration_text
from quant.gptq import GPTQConfig
from quant.learned_rounding import SignRoundConfig
from quant.models import load_float_model, resolve
from quant.quantize import layer_step
from quant.sequential import LayerInputs, capture_inputs, run_layer

ROOT = Path(__file__).resolve().parent.parent


def layer_inputs(model, layers, ids: torch.Tensor, wanted: list[int]) -> dict[int, LayerInputs]:
    """The float model's inputs to each wanted layer (hooks on one forward)."""
    first, layer_kwargs = capture_inputs(model, layers, ids, 4, "cpu")  # each layer's own (Gemma's differ)
    found, hidden = {}, first.hidden
    with torch.no_grad():
        for i in range(max(wanted) + 1):
            if i in wanted:
                found[i] = LayerInputs(list(hidden), layer_kwargs[i])
            hidden = run_layer(layers[i], LayerInputs(hidden, layer_kwargs[i]))
    return found


def quantize_layer(layer, calib: LayerInputs, spec: str, bits: int, settings: dict, arch) -> dict:
    """``layer`` (a copy) quantized in place by the chain ``spec`` names (``awq+signround``, bare
    settings after a colon for its last method: ``signround:min_range=0.7``); returns the
    quantized weights."""
    plan = {n: QuantScheme(bits, 64, False) for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    chain_name, overrides = method_settings(spec)
    names = chain_name.split("+")
    chain = registry.chain(names)
    done = registry.check_settings(chain, {n: s for n, s in settings.items() if n in names})
    done[chain[-1].name] = dataclasses.replace(done[chain[-1].name], **overrides) if overrides else done[chain[-1].name]
    with torch.no_grad():
        quantized, _, _ = layer_step(chain, done, arch, torch.bfloat16)(layer, calib, plan)
    return quantized


def relative_errors(layer, held_out: LayerInputs, reference: torch.Tensor) -> dict:
    """The quantized layer (it holds the dequantized weights, and AWQ's scales in its norms) against the
    float one: relative to the float output, and to what the layer adds to the residual stream (the output
    minus its input, which carries most of the output's norm through every layer)."""
    with torch.no_grad():
        error = (torch.cat(run_layer(layer, held_out)) - reference).norm()
    update = (reference - torch.cat(held_out.hidden)).norm()
    return {"relative_error": float(error / reference.norm()), "error_over_update": float(error / update)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="*", default=[15, 2])
    ap.add_argument("--bits", type=int, nargs="*", default=[2, 3, 4])
    ap.add_argument("--calibration", type=int, default=8, help="calibration windows")
    ap.add_argument("--held-out", type=int, default=4, help="held-out Persuasion windows")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--iters", type=int, default=32, help="SignRound steps per layer")
    ap.add_argument("--batch-size", type=int, default=2, help="SignRound windows per step")
    ap.add_argument("--methods", nargs="*", default=["rtn", "gptq", "awq+gptq", "signround", "awq+signround"])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "quality" / "layer-error.json")
    args = ap.parse_args()

    model, tok = load_float_model(resolve("smollm2-135m"))
    _, layers = decoder_layers(model)
    calib_ids = calibration_samples(tok, load_calibration_text("default"), args.calibration, args.seq_len, seed=0)
    text = torch.tensor(tok(load_text("persuasion"), add_special_tokens=False).input_ids)
    held_ids = text[: args.held_out * args.seq_len].view(args.held_out, args.seq_len)
    calib = layer_inputs(model, layers, calib_ids, args.layers)
    held = layer_inputs(model, layers, held_ids, args.layers)
    arch = architecture_of(model)
    settings = {"gptq": GPTQConfig(), "signround": SignRoundConfig(iters=args.iters, batch_size=args.batch_size)}
    result = {"commit": commit(), "device": f"cpu ({os.cpu_count()} cores)", "platform": platform.platform(),
              "versions": versions(), "load_average_at_start": os.getloadavg(),
              "protocol": (f"SmolLM2-135M decoder layers {args.layers}, w{{bits}} g64 asym, bf16 scales; "
                           f"calibration {args.calibration} x {args.seq_len} tokens (Austen, seed 0); error on "
                           f"{args.held_out} x {args.seq_len} held-out Persuasion tokens; SignRound "
                           f"{args.iters} steps of {args.batch_size} windows"),
              "rows": []}
    for bits in args.bits:
        for i in args.layers:
            with torch.no_grad():
                reference = torch.cat(run_layer(layers[i], held[i])).float()
            for spec in args.methods:
                layer = copy.deepcopy(layers[i])
                wall, cpu = time.perf_counter(), time.process_time()
                quantize_layer(layer, calib[i], spec, bits, settings, arch)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                row = {"layer": i, "bits": bits, "method": spec,
                       **relative_errors(layer, held[i], reference),
                       "wall_s": wall, "cpu_s": cpu, "load_average": os.getloadavg()}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
                write_result(args.out, result)  # after every row: a cut-short run keeps what it measured


if __name__ == "__main__":
    main()
