"""Which sensitivity estimate should a bits budget rank Linears by? Several, measured in one run.

    python bench/budget_estimators.py [--samples 8] [--targets 3.296875 4.3125] \
        [--texts persuasion=1024 code=512] [--out bench/results/budget-estimators-cpu.json]

SmolLM2-135M, every decoder Linear at 2/3/4/8 bits, group 64 asymmetric, round-to-nearest with
bfloat16 scales (lm_head kept). One float forward and backward pass over the calibration samples
(``quant.budget.weigh_rounding``, the code the budget runs) weighs each Linear's rounding error at
its output four ways:

- ``output``: Σ‖ΔW x‖², the output energy (the first estimator, tr(ΔW H ΔWᵀ) up to a constant);
- ``relative``: the same over the Linear's own output energy Σ‖W x‖² (scale-free);
- ``fisher``: Σ g² (ΔW x)², the diagonal empirical Fisher at the output (g: the loss gradient there);
- ``fisher_dot``: Σ_t (g_t · ΔW x_t)², the per-token empirical Fisher without the diagonal cut.

For each estimate and target, ``quant.budget.assign`` picks the schemes; the model is then rounded
in place (weights replaced by their dequantized RTN values, float32 compute) and scored on both
protocols (``bench/scoring.py``), with uniform W3 and W4 beside. In-process fake quantization: the
numbers are close to, not the same as, a written checkpoint's through lowbit's runtime
(``bench/calibrated.py`` rows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scoring import PROTOCOLS, commit, parse_texts, protocols, score_texts  # noqa: E402

ESTIMATORS = ("output", "relative", "fisher", "fisher_dot")


def measures() -> dict:
    from quant.budget import fisher

    return {"output": lambda x, g, e: float((e ** 2).sum()), "fisher": fisher,
            "fisher_dot": lambda x, g, e: float(((g * e).sum(-1) ** 2).sum())}


def weigh(model, plan, candidates, samples) -> dict:
    """The pass: {"sums": {measure: {Linear: {label: Σ}}}, "energy": {Linear: Σ‖W x‖²}, "tokens", "seconds"}."""
    from quant.budget import weigh_rounding

    energy = dict.fromkeys(plan, 0.0)  # of each Linear's own output, for the relative estimate

    def hook(name):
        def record(module, args, out):
            energy[name] += float(out.detach().float().pow(2).sum())
        return record

    hooks = [model.get_submodule(n).register_forward_hook(hook(n)) for n in plan]
    start = time.perf_counter()
    try:
        sums, tokens = weigh_rounding(model, plan, candidates, samples, torch.bfloat16, progress=False,
                                      measures=measures())
    finally:
        for h in hooks:
            h.remove()
    return {"sums": sums, "energy": energy, "tokens": tokens, "seconds": time.perf_counter() - start}


def estimates(weighed: dict) -> dict:
    """{estimator: {Linear: {label: value}}}; a common factor does not change an assignment."""
    sums = weighed["sums"]
    out = {m: sums[m] for m in ("output", "fisher", "fisher_dot")}
    out["relative"] = {n: {k: v / weighed["energy"][n] for k, v in by.items()} for n, by in sums["output"].items()}
    return out


def round_to(model, plan, candidates, originals: dict, choice: dict) -> None:
    """Each Linear's weight replaced by its float weight rounded to nearest at its chosen candidate."""
    from quant import methods
    from quant.budget import candidate_schemes

    rtn = methods.get("rtn")
    with torch.no_grad():
        for name, label in choice.items():
            scheme = candidate_schemes(plan[name], originals[name].shape[1], candidates)[label]
            rounded = rtn.round_linear(originals[name], scheme, None, torch.bfloat16, None, name)
            model.get_submodule(name).weight.copy_(rounded.dequantize(torch.float32))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8, help="Calibration samples of 512 tokens (seed 0).")
    ap.add_argument("--targets", type=float, nargs="*", default=[3.296875, 4.3125])
    ap.add_argument("--estimators", nargs="*", default=list(ESTIMATORS), choices=ESTIMATORS)
    ap.add_argument("--uniform", type=int, nargs="*", default=[3, 4], help="Uniform widths scored beside.")
    ap.add_argument("--texts", nargs="*", default=["persuasion=1024", "code=512"])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "budget-estimators-cpu.json")
    ap.add_argument("--pass-file", type=Path, default=ROOT / "bench" / "results" / "budget-estimators-pass-cpu.json",
                    help="The pass's sums: read when the file exists (same samples), else measured and written.")
    args = ap.parse_args()
    from evals.perplexity import hf_logits_fn
    from evals.provenance import versions
    from quant.affine import QuantScheme
    from quant.budget import Candidate, assign, linear_costs
    from quant.calibration import calibration_samples, load_calibration_text
    from quant.models import load_float_model, resolve
    from quant.plan import plan_layers

    texts = parse_texts(args.texts)
    result = {"made_by": "bench/budget_estimators.py", "commit": commit(), "device": f"cpu ({os.cpu_count()} cores)",
              "platform": platform.platform(), "versions": versions(),
              "scheme": f"RTN, group 64, asymmetric, bfloat16 scales, lm_head kept; sensitivities from "
                        f"{args.samples} x 512 calibration tokens (seed 0); fake-quantized float32 model",
              "protocols": {p: {t: d.describe() for t, d in protocols(p, texts).items()} for p in PROTOCOLS},
              "load_average_at_start": os.getloadavg(), "rows": []}
    model, tok = load_float_model(resolve("smollm2-135m"))
    samples = calibration_samples(tok, load_calibration_text("default"), args.samples, 512, 0)
    plan = plan_layers(model, QuantScheme(4, 64), ["lm_head"])
    candidates = [Candidate(b, 64) for b in (2, 3, 4, 8)]
    if args.pass_file.exists():
        weighed = json.loads(args.pass_file.read_text())
        if weighed["samples"] != args.samples:
            raise SystemExit(f"{args.pass_file} weighed {weighed['samples']} samples, not {args.samples}; "
                             "remove it to measure again")
    else:
        weighed = {**weigh(model, plan, candidates, samples), "samples": args.samples, "commit": result["commit"]}
        args.pass_file.write_text(json.dumps(weighed))
    result["pass"] = {k: weighed[k] for k in weighed if k not in ("sums", "energy")} | {"file": args.pass_file.name}
    estimated = estimates(weighed)
    costs = linear_costs(model, plan, candidates, torch.bfloat16)
    params = sum(model.get_submodule(n).weight.numel() for n in plan)
    originals = {n: model.get_submodule(n).weight.detach().clone() for n in plan}

    def score(choice: dict, row: dict) -> None:
        round_to(model, plan, candidates, originals, choice)
        row["bits_per_weight"] = sum(costs[n][k] for n, k in choice.items()) / params
        row["scores"] = score_texts(hf_logits_fn(model), tok, texts)
        result["rows"].append(row)
        args.out.write_text(json.dumps(result, indent=2))  # after every row: a cut-short run keeps what it measured
        print(row["row"], {p: {t: round(s["ppl"], 3) for t, s in d.items()} for p, d in row["scores"].items()},
              flush=True)

    tool = "lowbit, fake-quantized in process"  # rows in bench/calibrated.py's format: budget_curve.py, plot.py
    for bits in args.uniform:
        score(dict.fromkeys(plan, f"w{bits} g64"), {"row": f"uniform W{bits}", "tool": tool, "method": "rtn",
                                                      "bits": bits, "quantize_s": None})
    for target in args.targets:
        for estimator in args.estimators:
            chosen = assign(costs, estimated[estimator], int(target * params))
            budget = {"target_bits": target, "estimator": estimator, "estimated_loss": chosen["loss"],
                      "layers": {n: {"choice": k, "loss": estimated[estimator][n]} for n, k in chosen["choice"].items()}}
            score(chosen["choice"], {"row": f"budget {target:g} ({estimator})", "tool": tool,
                                     "method": f"rtn:weights.target_bits={target:g},weights.sensitivity={estimator}",
                                     "bits": 4, "quantize_s": None, "budget": budget})


if __name__ == "__main__":
    main()
