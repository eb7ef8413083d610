"""Which GPTQ settings on GGUF grids generalize across genres: a layer-local look, cheap enough for a
busy 2-core machine where whole-model runs take an hour each.

    python -m bench.gguf_levers [LAYERS, default 0,1,2]   (writes bench/results/gguf/levers-layers.json)

SmolLM2-135M's float model runs 16 x 512 windows of the ``mixed`` calibration source (seed 0) and the
first 4,096 tokens of each held-out text (Persuasion, argparse.py, package READMEs) up to the chosen
decoder layers; each Linear's Hessian ``XᵀX/n`` is gathered per text. Every Linear of those layers is
rounded to its type under the Q2_K and Q3_K_M mixes (``quant.gguf_quantize.plan_types``) from the
calibration Hessian: lowbit's port of llama.cpp's imatrix nearest rounding (``imatrix_rtn``), GPTQ
on the fitted grid as lowbit runs it (dampening 0.03, act-order), and one lever changed at a time.
The score per text is the summed output error ``tr(ΔW H_text ΔWᵀ)`` of the layers' Linears, over
``imatrix_rtn``'s (lower is better). Float inputs, no error carried between layers: a proxy, not
perplexity.
"""
import json
import os
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
from quant import models, gguf_fit
from quant.gptq import GPTQConfig, gptq_on_grid
from quant.calibration import calibration_samples, load_calibration_text
from quant.gguf_quantize import plan_types
from evals.texts import load_text

LAYERS = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [0, 1, 2]
MIXES = ("Q2_K", "Q3_K_M")
source = models.resolve("smollm2-135m")
model, tok = models.load_float_model(source)
model.eval()
calib = calibration_samples(tok, load_calibration_text("mixed"), 16, 512, 0, None)
evals = {}
for name in ("persuasion", "code", "docs"):
    ids = tok(load_text(name), add_special_tokens=False).input_ids[:4096]
    evals[name] = torch.tensor(ids).view(8, 512)
H = {}
current = [None]
class Stop(Exception): pass
def pre(name):
    def hook(mod, args):
        x = args[0].detach().float().reshape(-1, args[0].shape[-1])
        key = (name, current[0])
        H[key] = H.get(key, 0) + x.T @ x
        H[(name, current[0], "n")] = H.get((name, current[0], "n"), 0) + x.shape[0]
    return hook
linears = {}
for i in LAYERS:
    for n, m in model.model.layers[i].named_modules():
        if isinstance(m, torch.nn.Linear):
            full = f"model.layers.{i}.{n}"
            linears[full] = m
            m.register_forward_pre_hook(pre(full))
last = max(LAYERS)
model.model.layers[last].register_forward_hook(lambda *a: (_ for _ in ()).throw(Stop()))
t0 = time.time()
with torch.no_grad():
    for setname, ids in [("calib", calib), *evals.items()]:
        current[0] = setname
        for b in range(0, ids.shape[0], 4):
            try:
                model(ids[b:b + 4])
            except Stop:
                pass
print("forward", round(time.time() - t0), "s", flush=True)
def Hn(name, s):
    return H[(name, s)] / H[(name, s, "n")]
def blend(h, a):
    h = h.clamp_min(0)
    return (1 - a) * h / h.mean() + a
VARIANTS = {
    "imatrix_rtn": lambda W, t, Hc: gguf_fit.round_to_nearest(W, t, torch.diagonal(Hc)),
    "gptq": lambda W, t, Hc: gguf_fit.round_gptq(W, t, Hc, GPTQConfig()),
    "gptq_damp0.1": lambda W, t, Hc: gguf_fit.round_gptq(W, t, Hc, GPTQConfig(dampening=0.1)),
    "gptq_damp0.3": lambda W, t, Hc: gguf_fit.round_gptq(W, t, Hc, GPTQConfig(dampening=0.3)),
    "gptq_order_none": lambda W, t, Hc: gguf_fit.round_gptq(W, t, Hc, GPTQConfig(actorder="none")),
    "gptq_grid_blend0.5": lambda W, t, Hc: (lambda g: g.with_codes(gptq_on_grid(W, Hc, g, GPTQConfig())))(
        gguf_fit.fit_grid(W, t, blend(torch.diagonal(Hc), 0.5))),
    "gptq_diagshrink0.1": lambda W, t, Hc: (lambda g: g.with_codes(gptq_on_grid(W, Hc + 0.1 * torch.diag(torch.diagonal(Hc)), g, GPTQConfig())))(
        gguf_fit.fit_grid(W, t, torch.diagonal(Hc))),
}
out = {"layers": LAYERS, "rows": []}
for mix in MIXES:
    types = plan_types(model, mix, True)
    totals = {v: {g: 0.0 for g in evals} for v in VARIANTS}
    for name, m in linears.items():
        t = types[name]
        W = m.weight.detach().float()
        Hc = Hn(name, "calib")
        for v, f in VARIANTS.items():
            q = f(W, t, Hc).dequantize()
            for g in evals:
                totals[v][g] += gguf_fit.weighted_loss(W, q, Hn(name, g))
    base = totals["imatrix_rtn"]
    for v in VARIANTS:
        row = {"mix": mix, "variant": v, **{g: round(totals[v][g] / base[g], 4) for g in evals}}
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
from bench.results_file import write_result  # noqa: E402
from evals.provenance import commit, versions  # noqa: E402

out.update(commit=commit(), versions=versions(), load_average=os.getloadavg(), protocol=__doc__)
path = Path(__file__).resolve().parent / "results" / "gguf" / "levers-layers.json"
write_result(path, out)
