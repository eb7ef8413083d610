"""Which sensitivity estimate should a bits budget rank Linears by? Several, measured in one run.

    python -m bench.budget_estimators [--samples 8] [--targets 3.296875 4.3125] \
        [--candidates 2:64 3:64 4:64 8:64] [--sets "g64=2:64,3:64,4:64,8:64" ...] \
        [--texts persuasion=1024 code=512] [--out bench/results/budget/estimators.json]

SmolLM2-135M, every decoder Linear at each of ``--candidates`` (bits:group; default 2/3/4/8 bits at
group 64), asymmetric, round-to-nearest with bfloat16 scales (lm_head kept). One float forward and
backward pass over the calibration samples
(``quant.sensitivity.gradient_passes``, the code the budget runs) weighs each Linear's rounding error at
its output four ways:

- ``output``: Σ‖ΔW x‖², the output energy (the first estimator, tr(ΔW H ΔWᵀ) up to a constant);
- ``relative``: the same over the Linear's own output energy Σ‖W x‖² (scale-free);
- ``fisher``: Σ g² (ΔW x)², the diagonal empirical Fisher at the output (g: the loss gradient there);
- ``fisher_dot``: Σ_t (g_t · ΔW x_t)², the per-token empirical Fisher without the diagonal cut.

For each estimate, target and candidate set (``--sets``: named subsets of the candidates weighed, so
one pass serves several sets; default: all of them), ``quant.budget.assign`` picks the schemes; the
model is then rounded
in place (weights replaced by their dequantized RTN values, float32 compute) and scored on both
protocols (``bench/scoring.py``), with uniform W3 and W4 beside. In-process fake quantization: the
numbers are close to, not the same as, a written checkpoint's through lowbit's runtime
(``bench/calibrated.py`` rows). Each row also records the mean next-token loss on the first
``--check-samples`` calibration samples (the data the estimate came from) and the summed estimate,
so a row that loses can be told apart: an estimate that misjudges its own data, or a choice that
does not carry over to other text.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sysconfig
import time
from pathlib import Path

import torch

from bench.results_file import write_result
from bench.scoring import PROTOCOLS, commit, parse_texts, protocols, score_texts

ROOT = Path(__file__).resolve().parent.parent


ESTIMATORS = ("output", "relative", "fisher", "fisher_dot")


def measures() -> dict:
    """Each estimate's sum over a batch, from the Linear's input ``x``, the loss gradient at its
    output ``g`` and round-to-nearest's error there ``e`` (rows: tokens)."""
    from quant.sensitivity import fisher

    return {"output": lambda x, g, e: float((e ** 2).sum()), "fisher": lambda x, g, e: fisher(g, e),
            "fisher_dot": lambda x, g, e: float(((g * e).sum(-1) ** 2).sum())}


def model_draws():
    """Loss targets drawn (seeded) from the model's own prediction at each position, in place of the
    text's next tokens: their squared gradients average to the model's Fisher, so on the float model
    the estimate is of the rise of the KL divergence from its predictions, whatever the text says."""
    draw = torch.Generator().manual_seed(0)

    def targets(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits.detach(), -1).cpu()
        return torch.multinomial(probs, 1, generator=draw).flatten().to(logits.device)

    return targets


def weigh(model, plan, candidates, samples, labels: str = "data", float_weights: dict | None = None) -> dict:
    """The pass: {"sums": {measure: {Linear: {label: Σ}}}, "energy": {Linear: Σ‖W x‖²}, "tokens", "seconds"}.

    The budget's own pass (``quant.sensitivity.gradient_passes``, ``rounding_errors``) with every
    estimate of :func:`measures` summed at once. ``labels``: ``data``, the loss of the text's next
    tokens (what the budget uses); ``model``, of :func:`model_draws`. ``float_weights`` ({Linear:
    float weight}): the model runs with the weights it holds (say, an assignment already rounded), and
    each named Linear's candidates are rounded from its float weight: the same error, weighed by the
    inputs and gradients of the rounded model."""
    from quant.sensitivity import gradient_passes, next_text_tokens, rounding_errors

    targets = {"data": lambda: next_text_tokens, "model": model_draws}
    if labels not in targets:
        raise ValueError(f"labels must be one of {', '.join(targets)}, got {labels!r}")
    estimators = measures()
    sums = {m: {n: {c.label: 0.0 for c in candidates} for n in plan} for m in estimators}
    energy = dict.fromkeys(plan, 0.0)  # of each Linear's own output, for the relative estimate

    def at_output(name, linear, x, grad):
        weight = (float_weights or {}).get(name, linear.weight)
        for label, error in rounding_errors(weight, x, plan[name], candidates, torch.bfloat16, name):
            for measure, fn in estimators.items():
                sums[measure][name][label] += fn(x, grad, error)

    def hook(name):
        def record(module, args, out):
            energy[name] += float(out.detach().float().pow(2).sum())
        return record

    hooks = [model.get_submodule(n).register_forward_hook(hook(n)) for n in plan]
    start, cpu = time.perf_counter(), time.process_time()
    try:
        tokens = gradient_passes(model, plan, samples, at_output, progress=False, targets=targets[labels]())
    finally:
        for h in hooks:
            h.remove()
    return {"sums": sums, "energy": energy, "tokens": tokens, "seconds": time.perf_counter() - start,
            "cpu_seconds": time.process_time() - cpu, "candidates": [c.label for c in candidates]}


def estimates(weighed: dict) -> dict:
    """{estimator: {Linear: {label: value}}}; a common factor does not change an assignment."""
    sums = weighed["sums"]
    out = {m: sums[m] for m in ("output", "fisher", "fisher_dot") if m in sums}  # a pass may have weighed fewer
    if "output" in sums:
        out["relative"] = {n: {k: v / weighed["energy"][n] for k, v in by.items()} for n, by in sums["output"].items()}
    return out


def round_to(model, plan, candidates, originals: dict, choice: dict) -> None:
    """Each Linear's weight replaced by its float weight rounded to nearest at its chosen candidate."""
    from quant import methods
    from quant.sensitivity import candidate_schemes

    rtn = methods.get("rtn")
    with torch.no_grad():
        for name, label in choice.items():
            scheme = candidate_schemes(plan[name], originals[name].shape[1], candidates)[label]
            rounded = rtn.round_linear(originals[name], scheme, None, torch.bfloat16, None, name)
            model.get_submodule(name).weight.copy_(rounded.dequantize(torch.float32))


def parse_candidates(specs: list[str]) -> list:
    """``["3:64", "4:128"]`` -> [Candidate(3, 64), Candidate(4, 128)]."""
    from quant.sensitivity import Candidate

    try:
        return [Candidate(*(int(v) for v in spec.split(":"))) for spec in specs]
    except (TypeError, ValueError):
        raise SystemExit(f"candidates are BITS:GROUP (3:64, 4:128, 8:-1 for per channel), got {specs}") from None


def parse_sets(specs: list[str] | None, candidates: list) -> dict[str, list]:
    """``["no2=3:64,4:64,8:64"]`` -> {"no2": [Candidate, ...]}, each a subset of the candidates weighed."""
    if not specs:
        return {"all": candidates}
    sets = {}
    for spec in specs:
        name, _, members = spec.partition("=")
        sets[name] = parse_candidates(members.split(","))
        if missing := [c.label for c in sets[name] if c not in candidates]:
            raise SystemExit(f"set {name!r}: {missing} not among --candidates {[c.label for c in candidates]}")
    return sets


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8, help="Calibration samples of 512 tokens.")
    ap.add_argument("--seed", type=int, default=0, help="Which calibration samples (a second seed: the spread).")
    ap.add_argument("--bos", action="store_true", help="Begin every calibration sample with the BOS token "
                                                         "(default: as the tokenizer encodes a prompt).")
    ap.add_argument("--labels", choices=("data", "model"), default="data",
                    help="The pass's loss against the text's next tokens (empirical Fisher) or against tokens "
                         "drawn from the float model (its Fisher: the rise of KL from the float model).")
    ap.add_argument("--code-share", type=float, default=0.0,
                    help="Share of the calibration samples drawn from Python source (CPython's Lib/*.py of this "
                         "interpreter, argparse.py, the code text scored, left out) instead of the Austen text.")
    ap.add_argument("--check", type=int, default=0,
                    help="Check the fisher estimates of this many Linears (the largest at quant.budget.check_base's "
                         "candidate) by measuring the loss with each alone rounded (quant.sensitivity.check_largest).")
    ap.add_argument("--relinearize", action="store_true",
                    help="After each budget row, weigh the candidates again with the model rounded as that row "
                         "chose (inputs and gradients of the rounded model) and score the assignment made from it.")
    ap.add_argument("--targets", type=float, nargs="*", default=[3.296875, 4.3125])
    ap.add_argument("--estimators", nargs="*", default=list(ESTIMATORS), choices=ESTIMATORS)
    ap.add_argument("--candidates", nargs="*", default=["2:64", "3:64", "4:64", "8:64"],
                    help="BITS:GROUP schemes weighed in the pass (8:-1: per channel).")
    ap.add_argument("--sets", nargs="*", help="NAME=BITS:GROUP,... candidate sets assigned from, each a subset "
                                              "of --candidates (default: all of them, one set).")
    ap.add_argument("--uniform", nargs="*", default=["3:64", "4:64"], help="Uniform schemes scored beside.")
    ap.add_argument("--check-samples", type=int, default=2,
                    help="Calibration samples each row's calibration loss is taken on (0: none).")
    ap.add_argument("--texts", nargs="*", default=["persuasion=1024", "code=512"])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "budget" / "estimators.json")
    ap.add_argument("--pass-file", type=Path, default=ROOT / "bench" / "results" / "budget" / "estimators-pass.json",
                    help="The pass's sums: read when the file exists (same samples, every candidate weighed), "
                         "else measured and written.")
    args = ap.parse_args()
    from evals.perplexity import hf_logits_fn
    from evals.provenance import versions
    from quant.affine import QuantScheme
    from quant.budget import BudgetError, assign, check_base, linear_costs
    from quant.sensitivity import check_largest, mean_loss
    from quant.models import load_float_model, resolve
    from quant.plan import plan_layers

    texts = parse_texts(args.texts)
    candidates = parse_candidates(args.candidates)
    sets = parse_sets(args.sets, candidates)
    uniform = parse_candidates(args.uniform)
    if missing := [c.label for c in uniform if c not in candidates]:
        raise SystemExit(f"--uniform {missing} not among --candidates")
    result = {"made_by": "bench/budget_estimators.py", "commit": commit(), "device": f"cpu ({os.cpu_count()} cores)",
              "platform": platform.platform(), "versions": versions(),
              "scheme": f"RTN, asymmetric, bfloat16 scales, lm_head kept; candidates "
                        f"{', '.join(c.label for c in candidates)}; sensitivities from {args.samples} x 512 "
                        f"calibration tokens (seed {args.seed}{', BOS first' if args.bos else ''}, labels "
                        f"{args.labels}, code share {args.code_share:g}); "
                        "fake-quantized float32 model",
              "sets": {name: [c.label for c in members] for name, members in sets.items()},
              "calibration_loss": f"mean next-token loss, nats, on the first {args.check_samples} x 512 calibration "
                                  "tokens (the estimate's own data)",
              "protocols": {p: {t: d.describe() for t, d in protocols(p, texts).items()} for p in PROTOCOLS},
              "load_average_at_start": os.getloadavg(), "rows": []}
    model, tok = load_float_model(resolve("smollm2-135m"))
    samples = calibration_mix(tok, args.samples, args.seed, args.bos, args.code_share)
    plan = plan_layers(model, QuantScheme(4, 64), ["lm_head"])
    how = {k: getattr(args, k) for k in PASS_KEYS}
    weighed = read_pass(args.pass_file, **how)
    if weighed is None:
        weighed = {**weigh(model, plan, candidates, samples, args.labels), **how, "commit": result["commit"]}
        args.pass_file.write_text(json.dumps(weighed))
    elif missing := [c for c in candidates if c.label not in weighed["candidates"]]:
        add_to_pass(weighed, weigh(model, plan, missing, samples, args.labels), result["commit"])
        args.pass_file.write_text(json.dumps(weighed))
    result["pass"] = {k: weighed[k] for k in weighed if k not in ("sums", "energy")} | {"file": args.pass_file.name}
    estimated = estimates(weighed)
    if missing := [e for e in args.estimators if e not in estimated]:
        raise SystemExit(f"{args.pass_file} has no sums for {missing}; pass --estimators {' '.join(estimated)}")
    if args.check:  # the largest estimates checked by measurement on the pass's own samples
        per_token = {n: {k: v / (2 * weighed["tokens"]) for k, v in by.items()}
                     for n, by in estimated["fisher"].items()}
        checked, result["check"] = check_largest(model, plan, per_token, candidates, check_base(candidates, plan),
                                                 samples, torch.bfloat16, args.check)
        estimated["fisher"] = {n: {k: v * 2 * weighed["tokens"] for k, v in by.items()} for n, by in checked.items()}
    costs = linear_costs(model, plan, candidates, torch.bfloat16)
    params = sum(model.get_submodule(n).weight.numel() for n in plan)
    originals = {n: model.get_submodule(n).weight.detach().clone() for n in plan}
    check = samples[:args.check_samples]
    if args.check_samples:
        result["float_calibration_loss"] = mean_loss(model, check)

    def score(choice: dict, row: dict) -> None:
        round_to(model, plan, candidates, originals, choice)
        row["bits_per_weight"] = sum(costs[n][k] for n, k in choice.items()) / params
        row["estimated_fisher"] = sum(estimated["fisher"][n][k] for n, k in choice.items()) / (2 * weighed["tokens"])
        row["calibration_loss"] = mean_loss(model, check) if args.check_samples else None
        row["scores"] = score_texts(hf_logits_fn(model), tok, texts)
        result["rows"].append(row)
        write_result(args.out, result)  # after every row: a cut-short run keeps what it measured
        print(row["row"], {p: {t: round(s["ppl"], 3) for t, s in d.items()} for p, d in row["scores"].items()},
              flush=True)

    tool = "lowbit, fake-quantized in process"  # rows in bench/calibrated.py's format: budget_curve.py, plot.py
    for c in uniform:
        score(dict.fromkeys(plan, c.label), {"row": f"uniform {c.label}", "tool": tool, "method": "rtn",
                                             "bits": c.bits, "quantize_s": None})
    def place(target: float, estimator: str, set_name: str, members: list, by_estimate: dict,
              relinearized: bool = False) -> bool:
        """Assign and score one budget row; False when the set's cheapest candidates exceed the target."""
        labels = {c.label for c in members}
        pick = {n: {k: v for k, v in by.items() if k in labels} for n, by in by_estimate[estimator].items()}
        try:
            chosen = assign({n: {k: v for k, v in by.items() if k in labels} for n, by in costs.items()},
                            pick, int(target * params))
        except BudgetError as e:
            print(f"budget {target:g} ({estimator}, {set_name}): {e}", flush=True)
            return False
        budget = {"target_bits": target, "estimator": estimator, "candidates": sorted(labels),
                  "estimated_loss": chosen["loss"],
                  "layers": {n: {"choice": k, "loss": pick[n]} for n, k in chosen["choice"].items()}}
        # how the row was made goes into its method, so bench/plot.py draws each way as its own curve
        suffix = ("" if set_name == "all" else f",weights.candidates={set_name}") \
            + (f",weights.check={args.check}" if args.check else "") + (",relinearized" if relinearized else "")
        tag = ", relinearized" if relinearized else ""
        score(chosen["choice"], {"row": f"budget {target:g} ({estimator}, {set_name}{tag})", "tool": tool,
                                 "method": f"rtn:weights.target_bits={target:g},weights.sensitivity="
                                           f"{estimator}{suffix}",
                                 "bits": 4, "quantize_s": None, "budget": budget})
        return True

    for target in args.targets:
        for estimator in args.estimators:
            for set_name, members in sets.items():
                if place(target, estimator, set_name, members, estimated) and args.relinearize:
                    # the model now holds this row's rounding: weigh every candidate again around it
                    again = weigh(model, plan, members, samples, args.labels, float_weights=originals)
                    place(target, estimator, set_name, members, estimates(again), relinearized=True)


# how a pass weighed: a pass file is reused only for the same samples weighed the same way (the
# defaults are what files written before a key existed did)
PASS_KEYS = {"samples": None, "seed": 0, "bos": False, "labels": "data", "code_share": 0.0}


def stdlib_source() -> str:
    """The running CPython's own ``Lib/*.py``, sorted by name, ``argparse.py`` left out: Python source
    disjoint from the code text scored (``evals/data/code.txt.gz``, CPython 3.11.7's argparse.py)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join(f.read_text(encoding="utf-8") for f in sorted(lib.glob("*.py")) if f.name != "argparse.py")


def calibration_mix(tok, samples: int, seed: int, bos: bool, code_share: float) -> torch.Tensor:
    """``samples`` windows of 512 tokens: ``round(samples * code_share)`` of Python source
    (:func:`stdlib_source`), the rest of the bundled Austen text, each drawn as the pipeline draws."""
    from quant.calibration import calibration_samples, load_calibration_text

    if not 0 <= code_share <= 1:
        raise SystemExit(f"--code-share is a share of the samples, from 0 to 1; got {code_share}")
    code = round(samples * code_share)
    prose = calibration_samples(tok, load_calibration_text("default"), samples - code, 512, seed, bos or None)
    if not code:
        return prose
    return torch.cat([prose, calibration_samples(tok, stdlib_source(), code, 512, seed, bos or None)])


def read_pass(path: Path, **how) -> dict | None:
    """A pass file's sums when it weighed as ``how`` says (``PASS_KEYS``); None when there is none."""
    if not path.exists():
        return None
    weighed = json.loads(path.read_text())
    found = {k: weighed.get(k, default) for k, default in PASS_KEYS.items()}
    wanted = {k: how.get(k, default) for k, default in PASS_KEYS.items()}
    if found != wanted:
        differ = ", ".join(f"{k} {found[k]} (here {wanted[k]})" for k in PASS_KEYS if found[k] != wanted[k])
        raise SystemExit(f"{path} weighed other samples or another way: {differ}; give another --pass-file, or "
                         "remove it to measure again")
    weighed.setdefault("candidates", list(next(iter(weighed["sums"]["fisher"].values()))))
    return weighed


def add_to_pass(weighed: dict, more: dict, code_version: str) -> None:
    """Candidates the pass file lacks, weighed over the same samples, added to it. Each candidate's sums
    read only its own rounding, so two passes over the same samples give what one over both would."""
    if more["tokens"] != weighed["tokens"]:
        raise SystemExit(f"the pass file counted {weighed['tokens']} tokens, this pass {more['tokens']}: "
                         "not the same samples")
    for measure in list(weighed["sums"]):  # a measure only one of the two passes weighed covers too few candidates
        if measure not in more["sums"]:
            del weighed["sums"][measure]
            continue
        for name, by_label in more["sums"][measure].items():
            weighed["sums"][measure][name].update(by_label)
    weighed.setdefault("energy", more["energy"])  # of the float Linears' outputs: the same in every pass
    weighed["candidates"] += more["candidates"]
    weighed.setdefault("added", []).append({"candidates": more["candidates"], "commit": code_version,
                                            "seconds": more["seconds"], "cpu_seconds": more["cpu_seconds"]})


if __name__ == "__main__":
    main()
