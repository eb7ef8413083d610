"""GGUF files lowbit writes, run in llama.cpp (its own libllama, `make llama-cpp-lib`): the logits
llama.cpp computes match lowbit's runtime on the same grid. Alone: pytest -m llama_cpp.

llama.cpp quantizes the activations of a quantized matmul to 8 bits per block (Q8_0 / Q8_K) and
keeps its KV cache in float16, so it is not bit-exact against lowbit's float32 runtime: the bound
is a relative RMS logit difference of TOLERANCE (measured: ~1% on the tiny models)."""

import copy

import gguf
import numpy as np
import pytest
import torch

import runtime
from lowbit_testing.tiny_models import save_model, tiny_model, tiny_tokenizer
from quant import checkpoint_write
from quant.affine import QuantScheme
from quant.gguf import TYPES, dequantize, unpack
from quant.gguf.export import export
from quant.gguf.write import ARCHES, rotary_permutation
from quant.plan import plan_layers
from quant.quantize import quantize_model
from test_gguf_export import tiny_copy

pytestmark = [pytest.mark.llama_cpp, pytest.mark.filterwarnings("ignore:llama.cpp will split text"),
              pytest.mark.filterwarnings("ignore::quant.checkpoint.UnverifiedCheckpointWarning")]

TOLERANCE = 0.03
IDS = [(7 * i + 3) % 300 + 2 for i in range(48)]


def llama_logits(llama_cpp, path, ids=IDS) -> np.ndarray:
    model = llama_cpp.Llama(str(path), logits_all=True, n_ctx=256, n_threads=2, verbose=False)
    try:
        model.eval(list(ids))
        return np.asarray(model.scores[: len(ids)], dtype=np.float32).copy()
    finally:
        model.close()


def lowbit_logits(path, ids=IDS) -> np.ndarray:
    return runtime.load(path, dtype=torch.float32, linear_backend="reference").logits(torch.tensor([ids]))[0].numpy()  # float32 precision


def rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a - b) ** 2).mean() / (b**2).mean()))


def gguf_weights(path, config: dict, hf_names) -> dict[str, torch.Tensor]:
    """What the GGUF file holds for each Hugging Face tensor, as float32 in Hugging Face's row order."""
    arch, permuted = ARCHES[config["model_type"]]
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    out = {}
    for hf in hf_names:
        t = stored.get(names.get_name(hf, try_suffixes=(".weight", ".bias")))
        if t is None:
            continue  # the tied head
        shape = tuple(int(n) for n in reversed(t.shape))
        if t.tensor_type.name in TYPES:
            w = dequantize(unpack(t.tensor_type.name, np.asarray(t.data).reshape(-1), shape))
        else:
            w = torch.from_numpy(np.asarray(t.data).astype(np.float32).reshape(shape))
        if permuted and hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in hf else config["num_key_value_heads"]
            w = w[torch.argsort(rotary_permutation(w.shape[0], heads))]
        out[hf] = w
    return out


def model_from_gguf(float_dir, gguf_path, tmp_path):
    """The float model directory whose every tensor is what the GGUF file stores: lowbit's runtime on
    the file's own grid, whatever its type."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    state = model.state_dict()
    model.load_state_dict({**state, **gguf_weights(gguf_path, model.config.to_dict(), state)})
    return save_model(model, AutoTokenizer.from_pretrained(float_dir), tmp_path / "from-gguf")


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory):
    model, tok = tiny_copy()
    return save_model(model.float(), tok, tmp_path_factory.mktemp("float") / "llama")


@pytest.mark.parametrize("bits,symmetric,gguf_type", [(4, True, "Q4_0"), (4, False, "Q4_1"), (8, True, "Q8_0")])
def test_copied_grid_runs_in_llama_cpp_as_in_lowbit(llama_cpp, tmp_path, bits, symmetric, gguf_type):
    model, tok = tiny_copy()
    plan = plan_layers(model, QuantScheme(bits, 32, symmetric), ["lm_head"])
    quantized, _ = quantize_model(model, plan, "rtn", progress=False)
    ckpt = checkpoint_write.save(copy.deepcopy(model), quantized, tmp_path / "ckpt", tokenizer=tok)
    report = export(str(ckpt), gguf_type, tmp_path / "m.gguf")
    assert len(report.exact) == len(quantized)
    ours = lowbit_logits(ckpt)
    theirs = llama_logits(llama_cpp, tmp_path / "m.gguf")
    assert rel_rms(theirs, ours) < TOLERANCE
    if bits == 4:  # the same grid, not merely a nearby one: far closer than lowbit's float model is
        float_dir = save_model(model.float(), tok, tmp_path / "float")
        assert rel_rms(theirs, ours) < rel_rms(lowbit_logits(float_dir), ours) / 3


@pytest.mark.parametrize("gguf_type", list(TYPES) + ["F16"])
def test_every_type_runs_in_llama_cpp_on_its_own_grid(llama_cpp, float_llama, tmp_path, gguf_type):
    export(str(float_llama), gguf_type, tmp_path / "m.gguf")
    reference = model_from_gguf(float_llama, tmp_path / "m.gguf", tmp_path)
    theirs, ours = llama_logits(llama_cpp, tmp_path / "m.gguf"), lowbit_logits(reference)
    assert rel_rms(theirs, ours) < TOLERANCE, gguf_type
    # and the grid is the type's: the file's weights differ from the float model's as its bits say
    assert rel_rms(ours, lowbit_logits(float_llama)) < {"Q2_K": 1.0, "Q3_K": 0.5}.get(gguf_type, 0.25)


# the families each run in llama.cpp by a test here (llama: the tests above; phi3: its own test below)
FAMILIES_RUN = {"llama", "mistral", "qwen2", "qwen3", "phi3"}


def test_every_family_the_writer_writes_is_run_here():
    """The engine table's llama.cpp row names the writer's families (quant/engines.py): each is run above."""
    assert set(ARCHES) == FAMILIES_RUN, "a family the GGUF writer writes needs its llama.cpp test in this file"


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "qwen3"])
def test_mistral_and_qwen_families_run_in_llama_cpp(llama_cpp, tmp_path, kind):
    tok = tiny_tokenizer(vocab_size=400)
    # a vocabulary padded past the tokenizer (as Qwen's is; transformers' Qwen2Tokenizer adds <|endoftext|>)
    model, _ = tiny_model(kind, vocab_size=len(tok) + 11)
    float_dir = save_model(model.float(), tok, tmp_path / kind)
    for gguf_type in ("Q8_0", "F16"):
        out = tmp_path / f"{kind}-{gguf_type}.gguf"
        export(str(float_dir), gguf_type, out)
        reference = model_from_gguf(float_dir, out, tmp_path / gguf_type)
        assert rel_rms(llama_logits(llama_cpp, out), lowbit_logits(reference)) < TOLERANCE, gguf_type


def test_phi3_family_runs_in_llama_cpp(llama_cpp, tmp_path):
    """Phi-3 / Phi-4: q/k/v and gate/up stored joined, written as llama.cpp's attn_qkv and ffn_up (its
    SwiGLU takes the gate half first, as Hugging Face's): a float model fitted to Q8_0, and a W4 g32
    checkpoint whose codes are copied (Q4_1), each within TOLERANCE of lowbit's runtime on the same grid."""
    tok = tiny_tokenizer(vocab_size=400)
    model, _ = tiny_model("phi3", vocab_size=len(tok))
    # named phi3: llama.cpp sets attributes of <unk> and <|endoftext|> in a file whose name says phi-3
    # (llama-vocab.cpp) and fails where the vocabulary lacks them, as the tiny one does: the writer renames it
    float_dir = save_model(model.float(), tok, tmp_path / "Phi3-tiny")
    with pytest.warns(UserWarning, match="the file is named 'Phi 3-tiny', not 'Phi3-tiny'"):
        export(str(float_dir), "Q8_0", tmp_path / "q8.gguf")
    reference = model_from_gguf(float_dir, tmp_path / "q8.gguf", tmp_path / "q8")
    assert rel_rms(llama_logits(llama_cpp, tmp_path / "q8.gguf"), lowbit_logits(reference)) < TOLERANCE
    plan = plan_layers(model, QuantScheme(4, 32, False), ["lm_head"])
    quantized, _ = quantize_model(model, plan, "rtn", progress=False)
    ckpt = checkpoint_write.save(copy.deepcopy(model), quantized, tmp_path / "ckpt", tokenizer=tok)
    report = export(str(ckpt), "exact", tmp_path / "w4.gguf")
    assert len(report.exact) == len(quantized) == 8
    assert report.types["blk.0.attn_qkv.weight"] == report.types["blk.1.ffn_up.weight"] == "Q4_1"
    ours, theirs = lowbit_logits(ckpt), llama_logits(llama_cpp, tmp_path / "w4.gguf")
    assert rel_rms(theirs, ours) < TOLERANCE
    assert rel_rms(theirs, ours) < rel_rms(lowbit_logits(float_dir), ours) / 3  # the W4 grid itself


@pytest.mark.slow
def test_smollm2_w4_checkpoint_in_llama_cpp(llama_cpp, tmp_path):
    """The real model, 30 layers: a W4 g32 checkpoint copied to Q4_0; llama.cpp's tokens and logits
    on real text. Its float32 matmuls (an F32 file of the same weights) agree with lowbit's to 0.07%;
    its Q4_0 x Q8_0 dot products quantize SmolLM2's large activations to 8 bits per 32 (measured:
    3.6-4% relative RMS, ~90% of top-1 tokens equal)."""
    from lowbit import pipeline
    from lowbit.recipe_parse import parse_recipe
    from quant import models

    try:
        models.resolve("smollm2-135m")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    recipe = parse_recipe({"model": "smollm2-135m", "output": str(tmp_path / "ckpt"), "dtype": "bfloat16",
                           "weights": {"method": "rtn", "bits": 4, "group_size": 32, "symmetric": True}})
    ckpt = pipeline.quantize(recipe, progress=False)
    report = export(str(ckpt), "Q4_0", tmp_path / "q4_0.gguf")
    assert not report.refit and report.rounded == 0
    export(str(ckpt), "F32", tmp_path / "f32.gguf")
    text = ("Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who, for his own amusement, "
            "never took up any book but the Baronetage; there he found occupation for an idle hour.")
    lowbit = runtime.load(ckpt, dtype=torch.float32, linear_backend="reference")  # compared with llama.cpp's F32 file
    ids = lowbit.tokenizer(text).input_ids
    model = llama_cpp.Llama(str(tmp_path / "q4_0.gguf"), n_ctx=256, n_threads=2, verbose=False, vocab_only=True)
    try:
        assert model.tokenize(text.encode(), add_bos=False) == ids  # the smollm pre-tokenizer and merges
    finally:
        model.close()
    ours = lowbit.logits(torch.tensor([ids]))[0].numpy()
    assert rel_rms(llama_logits(llama_cpp, tmp_path / "f32.gguf", ids), ours) < 0.005
    q4 = llama_logits(llama_cpp, tmp_path / "q4_0.gguf", ids)
    assert rel_rms(q4, ours) < 0.06
    assert (q4.argmax(-1) == ours.argmax(-1)).mean() >= 0.8
    float_logits = lowbit_logits(models.resolve("smollm2-135m"), ids)
    assert rel_rms(q4, ours) < rel_rms(float_logits, ours) / 3  # the W4 grid, not merely near the float model


def test_quantized_head_of_a_tied_model_is_written(llama_cpp, tmp_path):
    """lowbit quantizes a tied model's head on its own (the embedding stays float): the file keeps it."""
    model, tok = tiny_copy()
    plan = plan_layers(model, QuantScheme(8, 32, True), [])
    assert "lm_head" in plan
    quantized, _ = quantize_model(model, plan, "rtn", progress=False)
    ckpt = checkpoint_write.save(copy.deepcopy(model), quantized, tmp_path / "ckpt", tokenizer=tok)
    report = export(str(ckpt), "exact", tmp_path / "m.gguf")
    assert report.types["output.weight"] == "Q8_0" and report.types["token_embd.weight"] == "BF16"
    assert rel_rms(llama_logits(llama_cpp, tmp_path / "m.gguf"), lowbit_logits(ckpt)) < TOLERANCE
