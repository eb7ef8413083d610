"""A bits budget (``weights.target_bits``): pricing, sensitivities, the assignment, the checkpoint, bad input."""

import itertools
import json
import random

import pytest
import torch

from lowbit.recipe import RecipeError
from lowbit.recipe_parse import parse_recipe
from quant import checkpoint
from quant import checkpoint_write
from quant.affine import QuantScheme
from quant import budget as budget_module
from quant.budget import Candidate, assign, measure_sensitivities
from quant.format import stored_bytes
from quant.plan import plan_layers
from quant.quantize import quantize_model
from tiny import TEXT, save_model, tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    model, tokenizer = tiny_llama(hidden=64, layers=2)
    return save_model(model, tokenizer, tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "calibration.txt"
    path.write_text(TEXT * 20)
    return path


def recipe(tiny_dir, calibration_file, out, **weights):
    return parse_recipe({"model": str(tiny_dir), "output": str(out), "dtype": "float32",
                         "calibration": {"text": str(calibration_file), "samples": 8, "seq_len": 48},
                         "weights": {"methods": ["gptq"], "group_size": 32, **weights}})


# ------------------------------------------------------------------ pricing

def test_stored_bytes_is_what_lowbit_eval_counts(tmp_path):
    """The budget prices candidates before anything is written; the checkpoint must then show the same
    bits/weight that ``lowbit eval`` reports, for every width, group, symmetry and act-order."""
    from evals.size import weight_stats

    model, tok = tiny_llama(hidden=96, layers=1)
    schemes = [QuantScheme(2, 32, False), QuantScheme(3, 48, True), QuantScheme(4, -1, False),
               QuantScheme(8, 32, False, "group")]
    names = list(plan_layers(model, QuantScheme(4, 32), ["lm_head"]))
    plan = {n: schemes[i % len(schemes)] for i, n in enumerate(names)}
    quantized, _ = quantize_model(model, plan, "rtn", progress=False)
    for name, qw in quantized.items():  # GPTQ's act-order "group" stores each column's group; RTN makes none
        if qw.scheme.actorder == "group":
            qw.g_idx = (torch.arange(qw.q.shape[1]) // 32).to(torch.int32)
    for name, qw in quantized.items():  # the writer's tensors, less the shape record
        written = qw.to_tensors(name, torch.bfloat16)
        del written[f"{name}.weight_shape"]
        assert stored_bytes(tuple(qw.q.shape), plan[name], torch.bfloat16) == sum(t.nbytes for t in written.values())
    out = checkpoint_write.save(model, quantized, tmp_path / "ckpt", tokenizer=tok, dtype=torch.bfloat16)
    priced = sum(stored_bytes(tuple(model.get_submodule(n).weight.shape), s, torch.bfloat16) for n, s in plan.items())
    assert weight_stats(out).quantized_bytes == priced


# ------------------------------------------------------------------ assignment

def brute_force(costs, losses, budget):
    names = sorted(costs)
    best = None
    for combo in itertools.product(*(sorted(costs[n]) for n in names)):
        cost = sum(costs[n][k] for n, k in zip(names, combo))
        loss = sum(losses[n][k] for n, k in zip(names, combo))
        if cost <= budget and (best is None or loss < best):
            best = loss
    return best


@pytest.mark.parametrize("seed", range(20))
def test_assignment_meets_the_budget_and_lands_within_its_bound_of_the_optimum(seed):
    rng = random.Random(seed)
    labels = ["w2", "w3", "w4", "w8"]
    costs, losses = {}, {}
    for i in range(5):
        size = rng.choice([64, 128, 256])
        costs[f"l{i}"] = {k: int(size * b * 1.1) for k, b in zip(labels, (2, 3, 4, 8))}
        base = rng.uniform(0.1, 10)
        losses[f"l{i}"] = {k: base * rng.uniform(0.3, 0.6) ** j for j, k in enumerate(labels)}  # more bits, less loss
    low = sum(min(c.values()) for c in costs.values())
    budget = rng.randint(low, sum(max(c.values()) for c in costs.values()))
    result = assign(costs, losses, budget)
    optimum = brute_force(costs, losses, budget)
    assert result["cost"] == sum(costs[n][k] for n, k in result["choice"].items()) <= budget
    assert result["loss"] == pytest.approx(sum(losses[n][k] for n, k in result["choice"].items()))
    assert result["lower_bound"] <= optimum + 1e-9 <= result["loss"] + 2e-9  # the bound is a true bound
    # no uniform assignment that fits does better (the budget never loses to one width everywhere)
    for k in labels:
        if sum(costs[n][k] for n in costs) <= budget:
            assert result["loss"] <= sum(losses[n][k] for n in costs) + 1e-9
    assert assign(costs, losses, budget) == result  # deterministic


def test_a_sensitive_linear_gets_the_bits():
    costs = {n: {"w2": 200, "w4": 400} for n in ("a", "b", "c")}
    losses = {"a": {"w2": 1.0, "w4": 0.5}, "b": {"w2": 50.0, "w4": 1.0}, "c": {"w2": 2.0, "w4": 1.0}}
    assert assign(costs, losses, 800)["choice"] == {"a": "w2", "b": "w4", "c": "w2"}


# ------------------------------------------------------------------ sensitivities

def _sensitivities(model, tok, candidates, bits=(2, 3, 4, 8)):
    from quant.calibration import calibration_samples

    samples = calibration_samples(tok, TEXT * 20, 4, 32, 0)
    plan = plan_layers(model, QuantScheme(4, 32), ["lm_head"])
    return measure_sensitivities(model, plan, candidates, samples, torch.float32, progress=False), samples


def test_sensitivities_are_the_fisher_weighted_rounding_error_on_the_float_model():
    """Weights untouched; more bits never cost more; one Linear's value checked against its gradient
    taken here another way (a zero added to its output, differentiated)."""
    from quant import rtn

    model, tok = tiny_llama(hidden=64, layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    candidates = [Candidate(b, 32) for b in (2, 3, 4, 8)]
    losses, samples = _sensitivities(model, tok, candidates)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.requires_grad for p in model.parameters())  # as the model had them
    for name, by_label in losses.items():
        values = [by_label[c.label] for c in candidates]
        assert values == sorted(values, reverse=True) and values[-1] > 0, name

    name = "model.layers.1.mlp.down_proj"
    linear = model.get_submodule(name)
    delta = linear.weight.detach() - rtn.quantize_weight(linear.weight.detach(), QuantScheme(3, 32),
                                                         torch.float32).dequantize(torch.float32)
    total, tokens = 0.0, 0
    for ids in samples.split(1):
        seen = {}

        def add_zero(module, args, out):
            seen["x"], seen["zero"] = args[0].detach(), torch.zeros_like(out, requires_grad=True)
            return out + seen["zero"]

        hook = linear.register_forward_hook(add_zero)
        logits = model(ids).logits[0, :-1]
        torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").backward()
        hook.remove()
        total += float((seen["zero"].grad ** 2 * (seen["x"] @ delta.T) ** 2).sum())
        tokens += ids.shape[1] - 1
    model.zero_grad()
    assert losses[name]["w3 g32"] == pytest.approx(total / (2 * tokens), rel=1e-4)


def test_samples_share_passes_and_give_the_sums_of_passes_alone(monkeypatch):
    """Short samples share a forward/backward pass, each Linear rounded once per pass and nothing
    rounded kept between passes; the sums are those of one pass per sample (no sample reads another)."""
    from quant import rtn, sensitivity
    from quant.sensitivity import weigh_rounding
    from quant.calibration import calibration_samples

    model, tok = tiny_llama(hidden=64, layers=2)
    samples = calibration_samples(tok, TEXT * 20, 4, 32, 0)
    plan = plan_layers(model, QuantScheme(4, 32), ["lm_head"])
    candidates = [Candidate(b, 32) for b in (2, 4)]
    calls = []
    real = rtn.quantize_weight
    monkeypatch.setattr(rtn, "quantize_weight", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(sensitivity, "PASS_TOKENS", 64)  # two samples of 32 tokens per pass
    shared, tokens = weigh_rounding(model, plan, candidates, samples, torch.float32, progress=False)
    assert len(calls) == len(plan) * len(candidates) * 2 and tokens == 4 * 31

    alone = {n: dict.fromkeys(shared[n], 0.0) for n in plan}
    for ids in samples.split(1):
        sums, _ = weigh_rounding(model, plan, candidates, ids, torch.float32, progress=False)
        for n, by_label in sums.items():
            for label, value in by_label.items():
                alone[n][label] += value
    for n in plan:
        assert shared[n] == pytest.approx(alone[n], rel=1e-5), n


def test_sensitivities_follow_what_the_loss_reads_not_the_output_scale():
    """Move a factor 64 from every v_proj to its o_proj: the model computes the same function and each
    rounding error does the same damage (round-to-nearest's grid scales with the weights), though
    v_proj's output energy grows 4096-fold (what the first estimator ranked by, and lost with:
    bench/results/budget/curve-energy.txt). The sensitivities and the assignment must not move."""
    candidates = [Candidate(b, 32) for b in (2, 3, 4, 8)]
    model, tok = tiny_llama(hidden=64, layers=2)
    plain, _ = _sensitivities(model, tok, candidates)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(64)
            layer.self_attn.o_proj.weight.div_(64)
    moved, _ = _sensitivities(model, tok, candidates)
    for name in plain:
        for label in plain[name]:
            assert moved[name][label] == pytest.approx(plain[name][label], rel=1e-3), (name, label)
    costs = {n: {c.label: 32 * 32 * c.bits for c in candidates} for n in plain}
    budget = int(sum(c["w3 g32"] for c in costs.values()))
    assert assign(costs, moved, budget)["choice"] == assign(costs, plain, budget)["choice"]


def test_the_linear_whose_rounding_hurts_the_loss_most_gets_more_bits():
    """Measured, not estimated: round each Linear alone to 2 bits and take the calibration loss; under a
    budget that lets about three Linears rise above 2 bits, the two that hurt most are among them (the
    output energy gave the second, layer 1's o_proj, 2 bits: it upgraded q/k/v instead)."""
    from quant import rtn

    model, tok = tiny_llama(hidden=64, layers=2)
    candidates = [Candidate(2, 32), Candidate(4, 32)]
    losses, samples = _sensitivities(model, tok, candidates)

    def calibration_loss():
        with torch.no_grad():
            logits = model(samples).logits[:, :-1]
            return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), samples[:, 1:].flatten()))

    base, hurt = calibration_loss(), {}
    for name in losses:
        linear = model.get_submodule(name)
        kept = linear.weight.detach().clone()
        with torch.no_grad():
            linear.weight.copy_(rtn.quantize_weight(kept, QuantScheme(2, 32), torch.float32).dequantize(torch.float32))
        hurt[name] = calibration_loss() - base
        with torch.no_grad():
            linear.weight.copy_(kept)
    worst = sorted(hurt, key=hurt.get, reverse=True)[:2]
    costs = {n: {c.label: model.get_submodule(n).weight.numel() * c.bits for c in candidates} for n in losses}
    budget = sum(c["w2 g32"] for c in costs.values()) + 3 * 64 * 64 * 2  # about three Linears at 4 bits
    choice = assign(costs, losses, budget)["choice"]
    assert [choice[n] for n in worst] == ["w4 g32"] * 2, sorted(hurt.items(), key=lambda kv: -kv[1])[:4]


# ------------------------------------------------------------------ end to end

def test_budgeted_checkpoint_is_an_ordinary_mixed_checkpoint(tmp_path, tiny_dir, calibration_file):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    import runtime
    from evals.size import weight_stats
    from lowbit import pipeline
    from lowbit.inspection import inspect_text

    # 2/4/8 bits: compressed-tensors 0.17.1 (the test extra's pin) packs 3 bits in its older layout (docs/budget.md)
    r = recipe(tiny_dir, calibration_file, tmp_path / "mix", target_bits=4.0,
               candidates=[{"bits": 2}, {"bits": 4}, {"bits": 8}])
    out = pipeline.quantize(r, device="cpu", progress=False)
    manifest = json.loads((out / checkpoint.MANIFEST).read_text())
    budget = manifest["budget"]
    bits = weight_stats(out).bits_per_weight
    assert bits == pytest.approx(budget["bits_per_weight"]) and 3.5 < bits <= 4.0
    # the largest estimates checked by measurement (at 4 bits, the widest candidate below 8), on the whole model
    assert 0 < len(budget["checked"]) <= budget_module.CHECKED_LINEARS and "w4" in budget["estimator"]
    assert all(set(v) == {"estimated", "measured"} for v in budget["checked"].values())
    widths = {g["weights"]["num_bits"] for g in checkpoint.read_config(out)["quantization_config"]["config_groups"].values()}
    assert len(widths) > 1  # mixed: one config group per scheme
    ids = torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(3))
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs(ids).logits
    torch.testing.assert_close(runtime.load(out, linear_backend="reference").logits(ids), expected, atol=1e-4, rtol=1e-4)

    # the manifest's recipe is the choice as plain overrides: run again, it makes the same weights, no budget
    again = parse_recipe({**manifest["recipe"], "output": str(tmp_path / "again")})
    assert again.weights.target_bits is None and len(again.weights.overrides) == len(budget["layers"])
    out2 = pipeline.quantize(again, device="cpu", progress=False)
    assert "budget" not in json.loads((out2 / checkpoint.MANIFEST).read_text())
    from safetensors.torch import load_file
    first, second = load_file(out / "model.safetensors"), load_file(out2 / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)

    text = inspect_text(out, layers=True)
    assert "bits budget: target 4 bits/weight" in text
    for name, entry in budget["layers"].items():
        assert any(line.startswith(name) and "*" in line for line in text.splitlines())


def test_overrides_pin_linears_and_count_against_the_budget(tmp_path, tiny_dir, calibration_file):
    from lowbit import pipeline

    r = recipe(tiny_dir, calibration_file, tmp_path / "pinned", target_bits=5.0,
               overrides=[{"match": "down_proj", "bits": 8}], candidates=[{"bits": 2}, {"bits": 4}])
    out = pipeline.quantize(r, device="cpu", progress=False)
    budget = json.loads((out / checkpoint.MANIFEST).read_text())["budget"]
    assert budget["pinned"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert not any(n in budget["layers"] for n in budget["pinned"])
    assert {e["choice"] for e in budget["layers"].values()} <= {"w2 g32", "w4 g32"}
    assert budget["bits_per_weight"] <= 5.0


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("weights, message", [
    ({"target_bits": 3.5, "bits": 4}, "weights.target_bits: give either weights.bits"),
    ({"target_bits": 9}, "above 8 bits per weight"),
    ({"target_bits": 2.5}, "below the smallest candidate (3 bits"),
    ({"target_bits": 1.5, "candidates": [{"bits": 2}]}, "below the smallest candidate (2 bits"),
    ({"target_bits": 2.5, "candidates": [{"bits": 3}, {"bits": 4}]}, "below the smallest candidate (3 bits"),
    ({"candidates": [{"bits": 3}]}, "weights.candidates: candidates are what a bits budget chooses from"),
    ({"target_bits": "3.5"}, "expected a positive number of bits per weight"),
    ({"target_bits": 3.5, "candidates": [{"bits": 5}]}, "weights.candidates[0].bits: must be one of 2, 3, 4, 8"),
    ({"target_bits": 3.5, "candidates": [{"group_size": 64}]}, "weights.candidates[0].bits: required"),
])
def test_bad_budgets_name_the_keys_and_the_fix(weights, message):
    with pytest.raises(RecipeError, match=None) as e:
        parse_recipe({"model": "m", "weights": weights}, "r.yaml")
    assert message in str(e.value)


def test_a_budget_below_what_scales_allow_fails_before_calibration(tmp_path, tiny_dir, calibration_file, monkeypatch):
    """2.5 bits is above the smallest candidate's 2 bits but below 2-bit g32 with its float32 scales and
    zero points (3.06): refused from the shapes alone, before the sensitivity pass, and nothing is written."""
    import quant.budget as budget
    from lowbit import pipeline

    monkeypatch.setattr(budget, "measure_sensitivities", lambda *a, **k: pytest.fail("calibration ran"))
    with pytest.raises(RecipeError, match=r"below the smallest assignment the candidates allow, 3\.06\d bits per "
                                          r"weight \(every Linear it places at w2 g32"):
        pipeline.quantize(recipe(tiny_dir, calibration_file, tmp_path / "low", target_bits=2.5,
                                 candidates=[{"bits": 2}, {"bits": 4}]), progress=False)
    assert not (tmp_path / "low").exists()


def test_recipe_round_trips_with_a_budget():
    r = parse_recipe({"model": "m", "weights": {"target_bits": 3.5, "candidates": [{"bits": 3}, {"bits": 4, "group_size": 128}]}})
    assert r.weights.budget_candidates == [Candidate(3, 64), Candidate(4, 128)]
    assert parse_recipe(r.to_dict()) == r
    assert parse_recipe({"model": "m"}).to_dict()["weights"].keys().isdisjoint({"target_bits", "candidates"})
    # the default: 3 and 4 bits at groups 32/64/128 and the recipe's, 8 bits at the recipe's; no 2 bits (docs/budget.md)
    default = parse_recipe({"model": "m", "weights": {"target_bits": 3.5, "group_size": 48}}).weights.budget_candidates
    assert default == [Candidate(b, g) for b in (3, 4) for g in (32, 64, 128, 48)] + [Candidate(8, 48)]


def test_the_largest_estimates_are_scaled_to_what_the_model_measures():
    """check_largest: the Linear with the largest estimate at the base candidate gets every estimate
    scaled by its measured rise (the loss with it alone rounded) over the estimated one; the rest
    keep theirs; the weights are as they were."""
    from quant import rtn
    from quant.sensitivity import check_largest, mean_loss
    from quant.calibration import calibration_samples

    model, tok = tiny_llama(hidden=64, layers=2)
    samples = calibration_samples(tok, TEXT * 20, 4, 32, 0)
    plan = plan_layers(model, QuantScheme(4, 32), ["lm_head"])
    candidates = [Candidate(b, 32) for b in (2, 4)]
    losses = {n: {"w2 g32": 4e-3, "w4 g32": 1e-3} for n in plan}
    name = "model.layers.1.mlp.down_proj"
    losses[name] = {"w2 g32": 8.0, "w4 g32": 2.0}  # far above anything rounding it can do
    before = {k: v.clone() for k, v in model.state_dict().items()}
    corrected, record = check_largest(model, plan, losses, candidates, Candidate(4, 32), samples, torch.float32, 1)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert list(record) == [name] and record[name]["estimated"] == 2.0
    floor = mean_loss(model, samples)
    linear = model.get_submodule(name)
    with torch.no_grad():
        linear.weight.copy_(rtn.quantize_weight(before[f"{name}.weight"], QuantScheme(4, 32), torch.float32)
                            .dequantize(torch.float32))
    measured = mean_loss(model, samples) - floor
    assert record[name]["measured"] == pytest.approx(measured, abs=1e-6)
    factor = max(measured, 0.0) / 2.0
    assert corrected[name] == pytest.approx({"w2 g32": 8.0 * factor, "w4 g32": 2.0 * factor})
    assert all(corrected[n] == losses[n] for n in plan if n != name)
