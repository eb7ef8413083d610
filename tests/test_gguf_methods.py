"""AWQ and SignRound on GGUF grids (a recipe's ``gguf:`` target): what they learn is on the type's
own grid (quant/gguf_signround.py, quant/awq.py with a GGUF type), the file holds what the
calibration pass propagated, and each lowers the layers' output error below nearest rounding."""

import copy

import gguf.quants
import numpy as np
import pytest
import torch

from lowbit.recipe import RecipeError
from lowbit.recipe_parse import parse_recipe
from lowbit_testing.tiny_models import save_model, with_outlier_channels
from quant.architectures import decoder_layers
from quant.awq import AWQConfig
from quant.gguf import TYPES, GGUFFields, dequantize, pack
from quant.gguf_fit import fit_grid, round_to_nearest
from quant.gguf_quantize import check_methods, quantize_gguf, write
from quant.gguf_signround import RANGE_STEP, GridRounding
from quant.learned_rounding import SignRoundConfig
from quant.sequential import capture_inputs, run_layer
from test_gguf_export import tiny_copy

pytestmark = pytest.mark.filterwarnings("ignore:llama.cpp will split text")

FAST = {"signround": SignRoundConfig(iters=40, batch_size=4), "awq": AWQConfig(grid=10, clip_steps=10)}
CALIBRATION = torch.randint(0, 360, (32, 32), generator=torch.Generator().manual_seed(0))
HELD_OUT = torch.randint(0, 360, (8, 32), generator=torch.Generator().manual_seed(1))


def float_model():
    """The tiny Llama of test_gguf_export cut to one decoder layer (the tests' time is the methods'),
    with outlier input channels (what AWQ is for)."""
    model, tok = tiny_copy()
    del model.model.layers[1:]
    model.config.num_hidden_layers = 1
    return with_outlier_channels(model.float()), tok


@pytest.mark.parametrize("name", list(TYPES))
def test_what_signround_learns_is_what_the_fields_dequantize_to(name):
    """Any offsets and ratios: the weight the descent sees is, to float rounding, what the stored
    fields give in llama.cpp's own dequantization (gguf-py's reference, from the packed bytes)."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(8, 512, generator=g) * 0.05
    W[:, 3] += 0.3
    r = GridRounding(W, name, SignRoundConfig(), torch.rand(512, generator=g) + 0.1)
    with torch.no_grad():
        r.offset.copy_(torch.rand(W.shape, generator=g) - 0.5)
        for ratio in r.ratios:  # factors on the scales and mins across [0.5, 1.5]
            ratio.copy_(1 + (torch.rand(ratio.shape, generator=g) - 0.5) / RANGE_STEP)
        r.clamp_(0.5)
        seen = r.fake_quantized()
    fitted = r.result()
    fitted.fields.check()
    stored = torch.from_numpy(gguf.quants.dequantize(pack(fitted.fields), TYPES[name].ggml_type).copy())
    assert torch.equal(stored, fitted.dequantize())
    assert torch.allclose(seen, stored, rtol=0, atol=1e-6 * float(W.abs().max()))


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q4_0", "Q5_1"])
def test_signround_starts_from_nearest_rounding_on_the_fitted_grid(name):
    W = torch.randn(8, 512, generator=torch.Generator().manual_seed(2)) * 0.05
    h = torch.rand(512, generator=torch.Generator().manual_seed(3)) + 0.1
    start = GridRounding(W, name, SignRoundConfig(), h).result()
    assert torch.equal(start.dequantize(), round_to_nearest(W, name, h).dequantize())
    assert torch.equal(start.fields.d, fit_grid(W, name, h).fields.d)


def quantized(methods, mix="Q4_K_M"):
    model, tok = float_model()
    fields, stats = quantize_gguf(model, mix, methods, samples=CALIBRATION, settings=FAST, progress=False)
    return model, tok, fields, stats


@pytest.mark.parametrize("methods", [["awq", "signround"]])  # both: AWQ's folded norms, SignRound's learned fields
def test_the_file_holds_what_the_calibration_pass_propagated(tmp_path, methods):
    from test_gguf_llama import gguf_weights

    source_model, tok = float_model()
    source = save_model(source_model, tok, tmp_path / "float")
    model, _, fields, _ = quantized(methods, "Q4_K_M")
    write(tmp_path / "m.gguf", source, fields)
    stored = gguf_weights(tmp_path / "m.gguf", model.config.to_dict(), model.state_dict())
    _, layers = decoder_layers(model)
    for name, tensor in layers.named_parameters(prefix="model.layers"):
        assert torch.equal(stored[name], tensor.detach()), name
    if "awq" in methods:  # the norms the file holds are AWQ's, with 1/s folded in, not the source's
        norm = "model.layers.0.input_layernorm.weight"
        assert not torch.equal(stored[norm], source_model.state_dict()[norm])


def holding(fields: dict):
    """The float model whose decoder layers hold what the fields dequantize to (and their norms)."""
    model, _ = float_model()
    new = {n: dequantize(f) if isinstance(f, GGUFFields) else f for n, f in fields.items() if ".layers." in n}
    model.load_state_dict({**model.state_dict(), **new})
    return model


def output_error(model, reference) -> float:
    """Relative mean squared error of the last decoder layer's output on held-out tokens."""
    with torch.no_grad():
        ours = model(HELD_OUT, output_hidden_states=True).hidden_states[-1]
        theirs = reference(HELD_OUT, output_hidden_states=True).hidden_states[-1]
    return float((ours - theirs).pow(2).mean() / theirs.pow(2).mean())


# relative output error of the decoder layer on held-out tokens, this method against nearest rounding on
# the same mix (the one-layer tiny Llama with outlier channels, 32 x 32 random calibration tokens, fast
# settings): asserted at least 10% lower
@pytest.mark.parametrize("mix", ["Q2_K", "Q4_K_M"])
@pytest.mark.parametrize("methods", [["awq"], ["signround"]])
def test_each_method_lowers_the_output_error_below_nearest_rounding(mix, methods):
    reference, _ = float_model()
    plain = output_error(holding(quantized(["rtn"], mix)[2]), reference)
    mine = output_error(holding(quantized(methods, mix)[2]), reference)
    assert mine < 0.9 * plain, (mine, plain)


def test_methods_a_gguf_target_cannot_take_are_refused_naming_method_and_type():
    for methods in (["awq"], ["signround"], ["awq", "gptq"], ["awq", "signround"]):
        recipe = parse_recipe({"model": "m", "gguf": "Q3_K_M", "weights": {"methods": methods}})
        assert recipe.gguf == "Q3_K_M"
    with pytest.raises(ValueError, match="hqq cannot round onto Q3_K_M's grid: a GGUF target takes methods rtn, gptq"):
        check_methods(["hqq"], "Q3_K_M")
    with pytest.raises(RecipeError, match="gguf: weights.bits do not apply"):
        parse_recipe({"model": "m", "gguf": "Q2_K", "weights": {"methods": ["signround"], "bits": 2}})


@pytest.mark.llama_cpp
@pytest.mark.filterwarnings("ignore::quant.checkpoint.UnverifiedCheckpointWarning")  # the reference built from the file
def test_an_awq_fitted_file_runs_in_llama_cpp_as_in_lowbit(llama_cpp, tmp_path):
    """`gguf: Q4_K_M` with AWQ from a recipe: llama.cpp's logits on the file (AWQ's folded norms, its
    scaled Linears on their Q4_K grids) match lowbit's runtime on the file's own weights."""
    from lowbit import pipeline
    from test_gguf_llama import TOLERANCE, llama_logits, lowbit_logits, model_from_gguf, rel_rms

    model, tok = float_model()
    source = save_model(model, tok, tmp_path / "float")
    recipe = parse_recipe({"model": str(source), "gguf": "Q4_K_M", "output": str(tmp_path / "m.gguf"),
                           "weights": {"methods": ["awq"]}, "calibration": {"samples": 4, "seq_len": 32}})
    out = pipeline.quantize(recipe, device="cpu", progress=False)
    reference = model_from_gguf(source, out, tmp_path)
    theirs = llama_logits(llama_cpp, out)
    assert rel_rms(theirs, lowbit_logits(reference)) < TOLERANCE
    # the file holds AWQ's model, not the float one re-rounded: far closer to its own weights than the float model is
    assert rel_rms(theirs, lowbit_logits(reference)) < rel_rms(lowbit_logits(source), lowbit_logits(reference)) / 3
