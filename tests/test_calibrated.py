"""GPTQ, AWQ and the layer-by-layer pipeline, on small random problems and tiny models."""

import warnings

import pytest
import torch

from quant import architectures, checkpoint_write
from quant.affine import QuantScheme, fake_quantize
from quant.architectures import UnsupportedModelError, architecture, architecture_of
from quant.awq import AWQConfig, apply_awq, scale_mappings
from quant.calibration import calibration_samples
from quant.learned_rounding import SignRoundConfig
from quant.gptq import GPTQConfig, gptq_quantize, inverse_hessian_cholesky, output_error
from quant.plan import plan_layers
from quant.quantize import quantize_model
from quant import rtn
from quant.gram import add_gram, mirror_upper
from quant.sequential import LayerInputs, capture_inputs, lockstep_pass, run_layer
from tiny import TEXT, tiny_llama, tiny_model


def correlated_problem(seed=0, n=2048, inp=128, out=96):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(inp, inp, generator=g) * 0.2 + torch.eye(inp)
    X = torch.randn(n, inp, generator=g) @ mix * torch.linspace(0.1, 4, inp)  # outlier channels
    W = torch.randn(out, inp, generator=g) * 0.05
    return W, 2 * X.T @ X / n


@pytest.mark.parametrize("actorder", [None, "weight", "group"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_gptq_beats_rounding_on_output_error(actorder, symmetric):
    W, H = correlated_problem()
    scheme = QuantScheme(4, 32, symmetric, actorder)
    qw = gptq_quantize(W, H, scheme)
    rtn = fake_quantize(W, QuantScheme(4, 32, symmetric))
    assert output_error(W, qw.dequantize(torch.float32), H) < 0.9 * output_error(W, rtn, H)
    assert (qw.g_idx is not None) == (actorder == "group")
    if actorder == "group":  # every group keeps its size, whatever the order
        assert torch.bincount(qw.g_idx.long()).tolist() == [32] * 4


def test_gptq_mse_clip_and_block_size_still_work():
    W, H = correlated_problem(seed=1)
    base = output_error(W, gptq_quantize(W, H, QuantScheme(4, 32, False, "weight")).dequantize(torch.float32), H)
    for config in (GPTQConfig(mse_clip=True), GPTQConfig(block_size=17)):
        err = output_error(W, gptq_quantize(W, H, QuantScheme(4, 32, False, "weight"), config).dequantize(torch.float32), H)
        assert err < 1.1 * base


def test_dead_inputs_and_indefinite_hessians_do_not_crash():
    W, H = correlated_problem(seed=2)
    H[:, 5] = H[5, :] = 0  # an input that never fires
    qw = gptq_quantize(W, H, QuantScheme(4, 32))
    assert (qw.dequantize(torch.float32)[:, 5] == qw.dequantize(torch.float32)[:, 5]).all()
    bad = -torch.eye(8)  # negative definite: dampening must be escalated, with a warning
    bad[0, 0] = 50.0
    with pytest.warns(UserWarning, match="dampening raised"):
        inverse_hessian_cholesky(bad, 0.01, "layer.x")


def decoder_layers(model):
    return architectures.decoder_layers(model)[1]


def tiny_inputs(model, samples=8, seq=32, seed=0):
    ids = torch.randint(0, model.config.vocab_size, (samples, seq), generator=torch.Generator().manual_seed(seed))
    layers = decoder_layers(model)
    with torch.no_grad():
        return ids, capture_inputs(model, layers, ids, 4, "cpu")[0]


def test_awq_scaling_is_exact_in_floating_point():
    model, _ = tiny_llama(hidden=64, num_attention_heads=4, num_key_value_heads=4)  # no GQA: v->o scaled too
    _, inputs = tiny_inputs(model)
    layer = decoder_layers(model)[0]
    assert len(scale_mappings(layer, architecture_of(model))) == 4
    plan = {n: QuantScheme(4, 32) for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    with torch.no_grad():
        before = run_layer(layer, inputs)
        scales = apply_awq(layer, inputs, plan, AWQConfig(clip=False, search_samples=4), architecture_of(model))
        after = run_layer(layer, inputs)
    assert set(scales) == set(plan)
    assert any(not torch.allclose(s, torch.ones_like(s)) for s in scales.values())
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_awq_names_the_modules_a_layer_lacks():
    with pytest.raises(UnsupportedModelError, match="llama decoder layer needs the modules .*input_layernorm"):
        scale_mappings(torch.nn.Linear(4, 4), architecture("llama"))


@pytest.mark.parametrize("method", ["gptq", "awq", "awq+gptq"])
def test_calibrated_methods_lower_output_error_and_load_everywhere(tmp_path, method):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    import runtime

    model, tok = tiny_llama(hidden=64, layers=2)
    ids, _ = tiny_inputs(model, samples=16)
    actorder = "group" if method == "gptq" else ("weight" if method.endswith("gptq") else None)
    plan = plan_layers(model, QuantScheme(4, 32, False, actorder), ["lm_head"])
    quantized, stats = quantize_model(model, plan, method, samples=ids, awq=AWQConfig(search_samples=8), progress=False)
    assert set(quantized) == set(plan)
    if method == "awq":  # RTN rounds after AWQ: it reads no statistics, so no Hessian (no output error) is made
        assert not any("output_rel_error" in s for s in stats.values())
    else:  # GPTQ must win outright
        errors = [(s["output_rel_error"], s["output_rel_error_rtn"]) for s in stats.values()]
        assert sum(e for e, _ in errors) < sum(r for _, r in errors)
    out = checkpoint_write.save(model, quantized, tmp_path / "ckpt", tokenizer=tok, dtype=torch.float32)
    test_ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(9))
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs(test_ids).logits
    torch.testing.assert_close(runtime.load(out, linear_backend="reference").logits(test_ids), expected, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # the model object itself now holds the quantized weights
        torch.testing.assert_close(model(test_ids).logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("lazy,method", [(False, "gptq"), (True, "gptq"), (False, "signround")])
def test_resume_after_an_interruption_gives_the_same_result(tmp_path, monkeypatch, lazy, method):
    import quant.sequential as seq
    from quant.models import load_lazily

    model, tok = tiny_llama(hidden=64, layers=3)
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")

    def run(work_dir, resume=False):
        model, _, layers_on_disk = load_lazily(tmp_path / "model") if lazy else (*tiny_llama(hidden=64, layers=3), None)
        ids, _ = tiny_inputs(model)
        plan = plan_layers(model, QuantScheme(4, 32, False, "weight"), ["lm_head"])
        # signround learning against the float model: its float activations are saved and resumed too
        settings = {"signround": SignRoundConfig(iters=3, batch_size=2, target="model")} if method == "signround" else {}
        return quantize_model(model, plan, method, samples=ids, work_dir=work_dir, resume=resume, run_id="r",
                              progress=False, lazy=layers_on_disk, **settings)[0]

    expected = run(None)
    real_save, calls = seq.save_progress, []

    def save_then_stop(*args, **kwargs):
        real_save(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(seq, "save_progress", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "work")
    monkeypatch.setattr(seq, "save_progress", real_save)
    resumed = run(tmp_path / "work", resume=True)
    assert set(resumed) == set(expected)
    for name in expected:
        assert torch.equal(resumed[name].q, expected[name].q), name
        assert torch.equal(resumed[name].scale, expected[name].scale), name


def test_resume_refuses_progress_from_another_recipe(tmp_path):
    model, _ = tiny_llama(hidden=64, layers=2)
    ids, _ = tiny_inputs(model)
    plan = plan_layers(model, QuantScheme(4, 32), ["lm_head"])
    quantize_model(model, plan, "gptq", samples=ids, work_dir=tmp_path, run_id="a", progress=False)
    with pytest.raises(ValueError, match="different recipe"):
        quantize_model(model, plan, "gptq", samples=ids, work_dir=tmp_path, resume=True, run_id="b", progress=False)


@pytest.mark.parametrize("method", ["gptq", "awq"])  # with and without a Hessian to show the NaN
def test_nan_activations_name_the_layer(method):
    model, _ = tiny_llama(hidden=64, layers=2)
    ids, _ = tiny_inputs(model)
    model.model.layers[1].post_attention_layernorm.weight.data[3] = float("inf")
    plan = plan_layers(model, QuantScheme(4, 32), ["lm_head"])
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.(gate|up)_proj.*NaN or Inf"):
        quantize_model(model, plan, method, samples=ids, awq=AWQConfig(search_samples=4), progress=False)
    # the paused batches were unwound and the hooks removed: the model runs as before
    assert not any(m._forward_pre_hooks for m in model.modules())
    with torch.no_grad():
        model(ids[:1])


def test_lockstep_pass_quantizes_each_linear_from_the_inputs_that_reach_it():
    """One forward: every Linear is quantized, in forward order, from the Hessian of the inputs it
    receives after the Linears before it were quantized, and the outputs are the quantized layer's."""
    model, _ = tiny_llama(hidden=64, layers=1)
    _, inputs = tiny_inputs(model)  # two batches of 4
    layer = decoder_layers(model)[0]
    plan = {n: QuantScheme(4, 32) for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    order, hessians = [], {}

    def quantize_linear(name, H):
        order.append(name)
        hessians[name] = H
        return rtn.quantize_weight(layer.get_submodule(name).weight.detach(), plan[name]), {"name": name}

    with torch.no_grad():
        float_inputs = _linear_inputs(layer, inputs, plan)
        quantized, stats, outputs = lockstep_pass(layer, inputs, plan, quantize_linear)
        seen = _linear_inputs(layer, inputs, plan)  # the layer now holds the dequantized weights
        expected_outputs = run_layer(layer, inputs)
    assert set(quantized) == set(plan) and stats["mlp.down_proj"] == {"name": "mlp.down_proj"}
    assert set(order[:3]) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
    assert order[3:] == ["self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    for a, b in zip(outputs, expected_outputs):
        torch.testing.assert_close(a, b)
    for name, xs in seen.items():
        x = torch.cat(xs).reshape(-1, xs[0].shape[-1]).float()
        torch.testing.assert_close(hessians[name], 2 * x.T @ x / x.shape[0], rtol=1e-4, atol=1e-5)
    # o_proj's inputs come from the quantized q/k/v, not the float ones
    assert not torch.allclose(torch.cat(seen["self_attn.o_proj"]), torch.cat(float_inputs["self_attn.o_proj"]))


def _linear_inputs(layer, inputs, names):
    xs = {n: [] for n in names}
    handles = [layer.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: xs[n].append(a[0])) for n in names]
    try:
        run_layer(layer, inputs)
    finally:
        for h in handles:
            h.remove()
    return xs


@pytest.mark.parametrize("width", [7, 600, 1537])
def test_gram_sum_matches_a_plain_product(width):
    x = torch.randn(2, 300, width, generator=torch.Generator().manual_seed(width))
    total = torch.zeros(width, width)
    for batch in x:  # accumulated over batches, as the lockstep pass does
        add_gram(total, batch)
    flat = x.reshape(-1, width)
    torch.testing.assert_close(mirror_upper(total), flat.T @ flat, rtol=1e-5, atol=1e-3)


def test_calibration_samples_are_reproducible_and_say_what_is_missing():
    from evals.texts import load_text

    _, tok = tiny_llama()
    text = load_text("default")[:20000]  # no repeats, so distinct windows differ in content
    a = calibration_samples(tok, text, samples=8, seq_len=16, seed=3)
    b = calibration_samples(tok, text, samples=8, seq_len=16, seed=3)
    c = calibration_samples(tok, text, samples=8, seq_len=16, seed=4)
    assert a.shape == (8, 16) and torch.equal(a, b) and not torch.equal(a, c)
    assert len({tuple(r) for r in a.tolist()}) == 8  # distinct windows
    with pytest.raises(ValueError, match=r"needs 1000 x 512 = 512000 tokens, but the text has \d+"):
        calibration_samples(tok, TEXT, samples=1000, seq_len=512)


def test_calibration_windows_begin_with_the_bos_where_the_tokenizer_adds_one():
    from tokenizers import processors

    from evals.texts import load_text
    from quant.calibration import adds_bos

    _, tok = tiny_llama()
    text = load_text("default")[:20000]
    plain = calibration_samples(tok, text, samples=4, seq_len=16, bos=False)
    assert not adds_bos(tok) and torch.equal(calibration_samples(tok, text, samples=4, seq_len=16), plain)
    forced = calibration_samples(tok, text, samples=4, seq_len=16, bos=True)
    assert forced.shape == (4, 16) and (forced[:, 0] == tok.bos_token_id).all()
    assert not (plain[:, 0] == tok.bos_token_id).any()
    body = tok(text, add_special_tokens=False).input_ids
    row = forced[0, 1:].tolist()  # the rest of the window is 15 consecutive tokens of the text
    assert any(body[i:i + 15] == row for i in range(0, len(body), 15))
    # a tokenizer that begins prompts with its BOS (as Llama's does) gets it in calibration too
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    assert adds_bos(tok) and torch.equal(calibration_samples(tok, text, samples=4, seq_len=16), forced)
    with pytest.raises(ValueError, match="no room for text"):
        calibration_samples(tok, text, samples=4, seq_len=1)
    tok.bos_token = None
    assert torch.equal(calibration_samples(tok, text, samples=4, seq_len=16), plain)
    with pytest.raises(ValueError, match="calibration.bos is true but the tokenizer has no BOS"):
        calibration_samples(tok, text, samples=4, seq_len=16, bos=True)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral"])
def test_pipeline_is_generic_over_decoder_families(tmp_path, kind):
    """Biased q/k/v (Qwen2), per-head q/k norms (Qwen3), Mistral: GPTQ after AWQ still lowers
    every family's output error, and the checkpoint runs in lowbit like transformers runs it."""
    import runtime

    model, tok = tiny_model(kind)
    ids, _ = tiny_inputs(model, samples=16)
    plan = plan_layers(model, QuantScheme(4, 32, False, "weight"), ["lm_head"])
    quantized, stats = quantize_model(model, plan, "awq+gptq", samples=ids, awq=AWQConfig(search_samples=8),
                                      progress=False)
    assert set(quantized) == set(plan)
    assert sum(s["output_rel_error"] for s in stats.values()) < sum(s["output_rel_error_rtn"] for s in stats.values())
    out = checkpoint_write.save(model, quantized, tmp_path / "ckpt", tokenizer=tok, dtype=torch.float32)
    test_ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():  # the model object holds the quantized weights (AWQ's scales folded in)
        expected = model(test_ids).logits
    torch.testing.assert_close(runtime.load(out, linear_backend="reference").logits(test_ids), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method,tie", [("gptq", True), ("awq+gptq", False)])
def test_lazy_loading_quantizes_like_the_whole_model_with_one_layer_in_memory(tmp_path, method, tie):
    """A model read layer by layer from its safetensors gives the same result as the model
    loaded whole, while no more than one decoder layer holds float Linear weights."""
    from quant.models import load_float_model, load_lazily

    source, tok = tiny_llama(hidden=64, layers=3, tie=tie)
    source.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    ids, _ = tiny_inputs(source)

    def run(model, lazy=None):
        plan = plan_layers(model, QuantScheme(4, 32, False, "weight"), ["lm_head"])
        return quantize_model(model, plan, method, samples=ids, awq=AWQConfig(search_samples=4), progress=False,
                              lazy=lazy)[0]

    expected = run(load_float_model(tmp_path / "model")[0])
    model, _, lazy = load_lazily(tmp_path / "model")
    layers = decoder_layers(model)
    assert all(p.is_meta for p in layers.parameters()) and not model.model.embed_tokens.weight.is_meta
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    in_memory = []
    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: in_memory.append(
            sum(not l.mlp.down_proj.weight.is_meta for l in layers)))
    got = run(model, lazy)
    assert max(in_memory) == 1
    for name in expected:
        assert torch.equal(got[name].q, expected[name].q), name
        assert torch.equal(got[name].scale, expected[name].scale), name
    # what the checkpoint needs besides the quantized weights stayed: norms (AWQ's scales folded in)
    assert not any(p.is_meta for n, p in model.named_parameters() if "norm" in n)
