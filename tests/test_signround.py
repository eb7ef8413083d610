"""SignRound (learned rounding and ranges per decoder layer): lower layer-output error than
RTN at 3 and 2 bits, checkpoints that load and run, recipe settings checked."""

import pytest
import torch

from lowbit.recipe import RecipeError
from lowbit.recipe_parse import parse_recipe
from quant import checkpoint_write, rtn
from quant.affine import QuantScheme, choose_qparams
from quant.learned_rounding import SignRoundConfig, learn_rounding
from quant.plan import plan_layers
from quant.quantize import quantize_model
from quant.sequential import capture_inputs, run_layer
from quant.architectures import decoder_layers
from tiny import tiny_llama

FAST = SignRoundConfig(iters=40, batch_size=4)


def layer_error(layer, inputs, weights: dict) -> float:
    """Mean squared difference of the layer's output with ``weights`` swapped in, against its float output."""
    reference = torch.cat(run_layer(layer, inputs))
    originals = {n: layer.get_submodule(n).weight.data for n in weights}
    for n, w in weights.items():
        layer.get_submodule(n).weight.data = w
    try:
        return float((torch.cat(run_layer(layer, inputs)) - reference).pow(2).mean())
    finally:
        for n, w in originals.items():
            layer.get_submodule(n).weight.data = w


@pytest.mark.parametrize("bits,symmetric", [(3, False), (2, False), (3, True)])
def test_learned_rounding_lowers_the_layer_output_error_against_rtn(bits, symmetric):
    model, _ = tiny_llama(hidden=64, layers=1)
    ids = torch.randint(0, model.config.vocab_size, (16, 32), generator=torch.Generator().manual_seed(0))
    layer = decoder_layers(model)[1][0]
    with torch.no_grad():
        inputs = capture_inputs(model, decoder_layers(model)[1], ids, 4, "cpu")[0]
        plan = {n: QuantScheme(bits, 32, symmetric) for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
        plain = {n: rtn.quantize_weight(layer.get_submodule(n).weight, s, torch.float32).dequantize(torch.float32)
                 for n, s in plan.items()}
        learned, record = learn_rounding(layer, inputs, plan, FAST, torch.float32)
    mine = layer_error(layer, inputs, {n: q.dequantize(torch.float32) for n, q in learned.items()})
    assert mine < 0.6 * layer_error(layer, inputs, plain)
    assert record["loss_best"] < record["loss_first"] and record["seconds"] > 0
    for n, q in learned.items():  # an ordinary affine result: integers on the grid, float weights untouched
        assert q.q.dtype == torch.int8 and q.q.min() >= plan[n].qmin and q.q.max() <= plan[n].qmax
        assert layer.get_submodule(n).weight.requires_grad


@pytest.mark.parametrize("init_range", ["minmax", "search"])
def test_one_step_at_a_negligible_rate_is_its_start(init_range):
    """No learning leaves the start: RTN on min/max ranges, or RTN on the searched ranges."""
    from quant.affine import choose_qparams, clip_search, quantize

    model, _ = tiny_llama(hidden=64, layers=1)
    ids = torch.randint(0, model.config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1))
    layers = decoder_layers(model)[1]
    with torch.no_grad():
        inputs = capture_inputs(model, layers, ids, 4, "cpu")[0]
        scheme = QuantScheme(3, 32)
        config = SignRoundConfig(iters=1, lr_scale=1e-9, init_range=init_range)
        learned, _ = learn_rounding(layers[0], inputs, {"mlp.down_proj": scheme}, config, torch.float32)
        w = layers[0].mlp.down_proj.weight
        if init_range == "minmax":
            expected = rtn.quantize_weight(w, scheme, torch.float32).q
        else:
            scale, zero = choose_qparams(w, scheme, clip_search(w, scheme, torch.float32, 51, 0.5), torch.float32)
            expected = quantize(w, scale, zero, scheme)
            assert not torch.equal(expected, rtn.quantize_weight(w, scheme, torch.float32).q)
    assert torch.equal(learned["mlp.down_proj"].q, expected)


def test_signround_checkpoint_loads_in_transformers_and_lowbit(tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    import runtime

    model, tok = tiny_llama(hidden=64, layers=2)
    ids = torch.randint(0, model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(2))
    plan = plan_layers(model, QuantScheme(2, 32, False), ["lm_head"])
    with torch.no_grad():
        reference = model(ids).logits
    rtn_model, _ = tiny_llama(hidden=64, layers=2)
    plain, _ = quantize_model(rtn_model, plan, ["rtn"], progress=False)
    for n, q in plain.items():
        rtn_model.get_submodule(n).weight.data = q.dequantize(torch.float32)
    quantized, stats = quantize_model(model, plan, ["signround"], samples=ids, signround=FAST, progress=False)
    assert set(quantized) == set(plan)
    assert all(s["signround"]["loss_best"] < s["signround"]["loss_first"] for s in stats.values())
    with torch.no_grad():  # the whole model's output: closer to the float model's than RTN's is
        assert (model(ids).logits - reference).pow(2).mean() < (rtn_model(ids).logits - reference).pow(2).mean()
    out = checkpoint_write.save(model, quantized, tmp_path / "ckpt", tokenizer=tok, dtype=torch.float32)
    test_ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(9))
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs(test_ids).logits
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(runtime.load(out, linear_backend="reference").logits(test_ids), expected, atol=1e-4, rtol=1e-4)


def test_awq_then_signround_runs():
    model, _ = tiny_llama(hidden=64, layers=1)
    ids = torch.randint(0, model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(4))
    plan = plan_layers(model, QuantScheme(3, 32, False), ["lm_head"])
    quantized, stats = quantize_model(model, plan, ["awq", "signround"], samples=ids,
                                      signround=SignRoundConfig(iters=10, batch_size=4), progress=False)
    assert set(quantized) == set(plan) and all("signround" in s for s in stats.values())


def test_target_model_learns_against_the_float_models_own_activations(monkeypatch):
    """With ``target: model`` each layer's reference is the float model's hidden state after that
    layer (from float inputs), not the float layer on the quantized model's inputs."""
    import quant.methods.signround as method

    model, _ = tiny_llama(hidden=64, layers=3)
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        float_states = model(ids, output_hidden_states=True).hidden_states  # [embeddings, layer 0, layer 1, ...]
    seen, real = [], method.learn_rounding

    def spy(layer, inputs, *args):
        if inputs.target is not None:
            seen.append(torch.cat(inputs.target))
        return real(layer, inputs, *args)

    monkeypatch.setattr(method, "learn_rounding", spy)
    plan = plan_layers(model, QuantScheme(2, 32, False), ["lm_head"])
    quantize_model(model, plan, "signround", samples=ids, progress=False,
                   signround=SignRoundConfig(iters=4, batch_size=2, target="model"))
    assert len(seen) == 3
    for i in (0, 1):  # the last layer's hidden state is reported after the final norm
        torch.testing.assert_close(seen[i], float_states[i + 1], rtol=1e-4, atol=1e-5)
    seen.clear()
    quantize_model(tiny_llama(hidden=64, layers=3)[0], plan, "signround", samples=ids, progress=False,
                   signround=SignRoundConfig(iters=4, batch_size=2, target="layer"))
    assert seen == []  # target: layer carries no float stream


def test_recipe_reads_signround_settings_and_refuses_bad_ones():
    r = parse_recipe({"model": "m", "weights": {"methods": ["signround"], "bits": 2,
                                                "signround": {"iters": 50, "batch_size": 4, "min_range": 0.7}}})
    assert r.weights.settings["signround"] == SignRoundConfig(iters=50, batch_size=4, min_range=0.7)
    assert parse_recipe(r.to_dict()) == r
    assert parse_recipe({"model": "m", "weights": {"methods": ["awq", "signround"]}}).weights.method == "awq+signround"
    bad = [({"min_range": 1.5}, "min_range must be in"), ({"iters": 0}, "signround.iters"),
           ({"lr_scale": -1}, "signround.lr_scale"), ({"steps": 3}, "steps"), ({"tune_range": "yes"}, "tune_range"),
           ({"target": "float"}, "target"), ({"loss": "l1"}, "loss")]
    for settings, message in bad:
        with pytest.raises(RecipeError, match=message):
            parse_recipe({"model": "m", "weights": {"methods": ["signround"], "signround": settings}}, "r.yaml")
    with pytest.raises(RecipeError, match="signround cannot follow gptq|gptq cannot follow signround"):
        parse_recipe({"model": "m", "weights": {"methods": ["signround", "gptq"]}}, "r.yaml")
    with pytest.raises(RecipeError, match="settings for signround"):
        parse_recipe({"model": "m", "weights": {"methods": ["gptq"], "signround": {"iters": 5}}}, "r.yaml")


def test_range_pair_needs_an_asymmetric_integer_grid():
    w = torch.randn(4, 64)
    lo_only, _ = choose_qparams(w, QuantScheme(3, 32), (0.5, 1.0))
    both, _ = choose_qparams(w, QuantScheme(3, 32), 0.5)
    assert (lo_only >= both).all() and not torch.equal(lo_only, both)
    with pytest.raises(ValueError, match="asymmetric integer grid"):
        choose_qparams(w, QuantScheme(3, 32, symmetric=True), (0.5, 1.0))


@pytest.mark.parametrize("symmetric", [False, True])
def test_scales_from_group_extremes_equal_the_affine_ones(symmetric):
    """Each step computes the scales from the groups' min and max alone: the same bits as from the weight."""
    from quant.learned_rounding import _Rounding

    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(5))
    rounding = _Rounding(w, QuantScheme(3, 64, symmetric), torch.bfloat16, SignRoundConfig())
    with torch.no_grad():
        for r in rounding.ratios:
            r.uniform_(0.5, 1.0, generator=torch.Generator().manual_seed(6))
    ratio = rounding.ratios[0] if symmetric else tuple(rounding.ratios)
    expected = choose_qparams(w, QuantScheme(3, 64, symmetric), ratio, torch.bfloat16)
    got = rounding.qparams()
    assert torch.equal(got[0], expected[0]) and (symmetric or torch.equal(got[1], expected[1]))


@pytest.mark.parametrize("symmetric", [False, True])
def test_searched_ranges_start_with_no_more_rounding_error_than_min_max(symmetric):
    """``init_range: search`` starts each group at the range in [min_range, 1] that rounds the group
    best: never worse than its min and max, better for groups with an outlier."""
    from quant.learned_rounding import _Rounding

    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(7))
    w[:, ::64] *= 6  # one outlier per group
    scheme = QuantScheme(2, 64, symmetric)
    errors = {}
    for init in ("minmax", "search"):
        rounding = _Rounding(w, scheme, torch.bfloat16, SignRoundConfig(init_range=init, min_range=0.5))
        assert all(((r >= 0.5) & (r <= 1)).all() for r in rounding.ratios)
        with torch.no_grad():
            errors[init] = (rounding.fake_quantized() - w).abs().pow(2.4).unflatten(-1, (2, 64)).sum(-1)
    assert (errors["search"] <= errors["minmax"]).all() and errors["search"].sum() < 0.8 * errors["minmax"].sum()


class _Proj(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.proj(x)


@pytest.mark.parametrize("loss", ["mse", "relative"])
def test_relative_loss_gives_a_massive_token_no_more_weight_than_any_other(loss):
    """A window's first token 1024 times its size (the massive activations a norm then divides away):
    under ``loss: relative`` the learned rounding is exactly what it was without them (the scale is a
    power of two, so the arithmetic is exact); under ``mse`` those tokens steer it."""
    from quant.sequential import LayerInputs

    torch.manual_seed(0)
    layer = _Proj()
    x = torch.randn(8, 16, 64)
    massive = x.clone()
    massive[:, 0] *= 1024
    plan = {"proj": QuantScheme(3, 32)}
    config = SignRoundConfig(iters=30, batch_size=4, loss=loss)
    learned = [learn_rounding(layer, LayerInputs(list(h.split(4)), [{}, {}]), plan, config, torch.float32)[0]["proj"].q
               for h in (x, massive)]
    assert torch.equal(learned[0], learned[1]) == (loss == "relative")
