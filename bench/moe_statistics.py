"""Which tokens should an expert's Hessian see? ``all`` tokens (statistics only) or the ``routed`` ones.

A tiny random Mixtral (lowbit_testing/tiny_models.py, 8 experts, top 2) whose router is skewed so
that a few experts are rarely picked, as in real MoE models, GPTQ W3 g32 symmetric calibrated on N random
tokens with each statistics choice (``quant.moe``), against RTN. Output: relative error of the
logits on held-out random tokens (the same distribution), each expert's output error on the
held-out tokens routed to it (float inputs, that expert's weights only), and how many calibration
tokens the router sent each expert. Deterministic; CPU.

    python -m bench.moe_statistics   # -> bench/results/moe/expert-statistics-<commit>.json
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.results_file import write_result
from evals.provenance import commit
from quant.affine import QuantScheme
from quant.moe import routed_counts, unfuse_experts
from quant.plan import plan_layers
from quant.quantize import quantize_model
from lowbit_testing.tiny_models import tiny_model


SCHEME = QuantScheme(3, 32, True)
SKEW = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.0, -0.5, -1.5, -3.0])  # router logit offsets: experts 6, 7 rare


def skewed_mixtral(statistics: str):
    model, _ = tiny_model("mixtral", hidden_size=128, intermediate_size=128, num_hidden_layers=2)
    with torch.no_grad():  # a per-expert offset through the hidden state's mean direction
        for layer in model.model.layers:
            w = layer.mlp.gate.weight
            w += SKEW[:, None] * w.norm(dim=1, keepdim=True).mean() / w.shape[1] ** 0.5 * 8
    return unfuse_experts(model, statistics)


def logits_error(quantized, held_out) -> float:
    model = skewed_mixtral("all")
    with torch.no_grad():
        expected = model(held_out).logits
        for name, qw in quantized.items():
            model.get_submodule(name).weight.data = qw.dequantize(torch.float32)
        got = model(held_out).logits
    return float((got - expected).norm() / expected.norm())


def expert_errors(quantized, held_out) -> dict:
    """Per sparse block, per expert: relative error of the expert's output (quantized weights vs
    float) on the held-out tokens the float router sends it: how usable each expert's rounding is."""
    model = skewed_mixtral("routed")
    inputs = {}
    blocks = {n: m for n, m in model.named_modules() if hasattr(m, "experts") and hasattr(m, "gate")}
    def keep(name):
        def hook(module, args):
            inputs[name] = args[0].reshape(-1, args[0].shape[-1])
        return hook

    handles = [m.register_forward_pre_hook(keep(n)) for n, m in blocks.items()]
    with torch.no_grad():
        model(held_out)
        for h in handles:
            h.remove()
        errors = {}
        for n, block in blocks.items():
            x = inputs[n]
            chosen = block.gate(x)[2]
            errors[n] = []
            for e, expert in enumerate(block.experts):
                xe = x[(chosen == e).any(-1)]
                expected = expert(xe)
                for p in expert.projections:
                    getattr(expert, p).weight.data = quantized[f"{n}.experts.{e}.{p}"].dequantize(torch.float32)
                errors[n].append(round(float((expert(xe) - expected).norm() / expected.norm()), 4))
    return errors


def run(tokens: int, method: str, statistics: str, held_out) -> dict:
    model = skewed_mixtral(statistics)
    g = torch.Generator().manual_seed(tokens)
    samples = torch.randint(0, model.config.vocab_size, (tokens // 32, 32), generator=g)
    counts = {k: v.tolist() for k, v in routed_counts(model, samples).items()}
    plan = plan_layers(model, SCHEME, ["lm_head"])
    quantized, stats = quantize_model(model, plan, method, samples=None if method == "rtn" else samples,
                                      progress=False)
    return {"tokens": tokens, "method": method, "statistics": statistics if method != "rtn" else None,
            "logits_rel_error": logits_error(quantized, held_out),
            "expert_output_rel_error": expert_errors(quantized, held_out),
            "routed_tokens_per_expert": counts,
            "rtn_fallbacks": sorted(n for n, s in stats.items() if "rounded_by" in s)}


def main() -> None:
    model = skewed_mixtral("all")
    held_out = torch.randint(0, model.config.vocab_size, (32, 64), generator=torch.Generator().manual_seed(99))
    rows = [run(256, "rtn", "all", held_out)]
    for tokens in (64, 256, 1024):
        for statistics in ("routed", "all"):
            rows.append(run(tokens, "gptq", statistics, held_out))
            r = rows[-1]
            print(f"{tokens:5d} tokens {statistics:6s}: logits error {r['logits_rel_error']:.4f}", flush=True)
            for block, errs in r["expert_output_rel_error"].items():
                print(f"    {block}: routed {r['routed_tokens_per_expert'][block]} expert errors {errs}")
    print(f"  rtn: {rows[0]['logits_rel_error']:.4f} expert errors {rows[0]['expert_output_rel_error']}")
    code_version = commit()
    import transformers

    out = Path(__file__).parent / "results" / "moe" / f"expert-statistics-{code_version}.json"
    write_result(out, {
        "protocol": __doc__.split("\n\n")[1].replace("\n", " "), "scheme": SCHEME.describe(),
        "model": "tiny mixtral: hidden 128, expert width 128, 2 layers, 8 experts top 2, router skewed",
        "held_out_tokens": list(held_out.shape), "commit": code_version, "device": "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__}, "rows": rows})


if __name__ == "__main__":
    main()
