"""Which part of a budgeted mix wins or loses? The mix with one kind of its choices undone at a time.

    python -m bench.budget_ablation --pass-file bench/results/budget/fisher16-pass.json \
        [--target 4.3125] [--texts persuasion=8192 code=4096] [--out bench/results/budget/ablation.json]

SmolLM2-135M, RTN with bfloat16 scales, lm_head kept, the assignment
``quant.budget.assign`` makes at ``--target`` from the pass file's Fisher sums (as
``bench/budget_estimators.py`` does), then the same assignment with one kind of choice put back to
w4 g64 (its 3-bit Linears, its 8-bit ones, its g128 or g32 ones, its attention or MLP Linears),
each fake-quantized in process and scored on both protocols (``bench/scoring.py``). The variants
change the bits per weight (recorded): they say where the mix's gains and losses sit, not what
else the budget could buy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from bench.budget_estimators import estimates, parse_candidates, round_to
from bench.results_file import write_result
from bench.scoring import commit, parse_texts, score_texts

ROOT = Path(__file__).resolve().parent.parent


CANDIDATES = "3:32 3:64 3:128 4:32 4:64 4:128 8:64".split()
BASE = "w4 g64"
UNDONE = {  # variant: which of the mix's choices go back to BASE
    "3-bit Linears": lambda name, label: label.startswith("w3"),
    "8-bit Linears": lambda name, label: label.startswith("w8"),
    "w4 g128 Linears": lambda name, label: label == "w4 g128",
    "w4 g32 Linears": lambda name, label: label == "w4 g32",
    "v_proj": lambda name, label: name.endswith("v_proj"),
    "MLP Linears": lambda name, label: ".mlp." in name,
    "attention Linears": lambda name, label: ".self_attn." in name,
}


def variants(choice: dict) -> dict[str, dict]:
    """{variant: assignment}: uniform ``BASE``, the mix, then the mix with each kind in ``UNDONE`` put
    back to ``BASE``."""
    out = {f"uniform {BASE}": dict.fromkeys(choice, BASE), "mix": choice}
    for kind, undone in UNDONE.items():
        out[f"mix, {kind} -> {BASE}"] = {n: BASE if undone(n, k) else k for n, k in choice.items()}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pass-file", type=Path, default=ROOT / "bench" / "results" / "budget" / "fisher16-pass.json")
    ap.add_argument("--target", type=float, default=4.3125)
    ap.add_argument("--texts", nargs="*", default=["persuasion=8192", "code=4096"])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "budget" / "ablation.json")
    args = ap.parse_args()
    from evals.perplexity import hf_logits_fn
    from evals.provenance import versions
    from quant.affine import QuantScheme
    from quant.budget import assign, linear_costs
    from quant.models import load_float_model, resolve
    from quant.plan import plan_layers

    weighed = json.loads(args.pass_file.read_text())
    fisher = estimates(weighed)["fisher"]
    model, tok = load_float_model(resolve("smollm2-135m"))
    plan = plan_layers(model, QuantScheme(4, 64), ["lm_head"])
    result = {"made_by": "bench/budget_ablation.py", "commit": commit(), "device": f"cpu ({os.cpu_count()} cores)",
              "platform": platform.platform(), "versions": versions(), "pass_file": args.pass_file.name,
              "scheme": "RTN, asymmetric, bfloat16 scales, lm_head kept; fake-quantized float32 model"}
    start = time.perf_counter()
    candidates = parse_candidates(CANDIDATES)
    costs = linear_costs(model, plan, candidates, torch.bfloat16)
    params = sum(model.get_submodule(n).weight.numel() for n in plan)
    originals = {n: model.get_submodule(n).weight.detach().clone() for n in plan}
    choice = assign(costs, fisher, int(args.target * params))["choice"]
    result["target_bits"], result["rows"] = args.target, []
    for name, chosen in variants(choice).items():
        round_to(model, plan, candidates, originals, chosen)
        scores = score_texts(hf_logits_fn(model), tok, parse_texts(args.texts))
        result["rows"].append({
            "row": name, "bits_per_weight": sum(costs[n][k] for n, k in chosen.items()) / params,
            "changed": sum(chosen[n] != choice[n] for n in choice),
            # the pass's own estimate of the mean loss, nats/token: set beside the measured log ratios
            "estimated_fisher": sum(fisher[n][k] for n, k in chosen.items()) / (2 * weighed["tokens"]),
            "scores": scores})
        write_result(args.out, result)  # after every row: a cut-short run keeps what it measured
        print(name, {p: {t: round(s["ppl"], 3) for t, s in d.items()} for p, d in scores.items()}, flush=True)
    result["seconds"] = time.perf_counter() - start
    write_result(args.out, result)


if __name__ == "__main__":
    main()
