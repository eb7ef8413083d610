"""The engine table (quant/engines.py): what each engine serves, recipes held to engines (`serve_with`),
and the engines `lowbit quantize` / `lowbit inspect` say can serve a checkpoint. Whether vLLM really
loads what the table says it does: tests/test_vllm.py."""

import json

import pytest

from lowbit.recipe import RecipeError
from lowbit.recipe_parse import parse_recipe
from quant import architectures, checkpoint, engines
from quant.affine import QuantScheme
from quant.budget import Candidate
from tiny import TEXT, save_model, tiny_llama

W4_ASYM, W4_SYM = QuantScheme(4, 64, False), QuantScheme(4, 128, True)


def served_by(name: str, scheme: QuantScheme, expert: bool = False) -> bool:
    return engines.ENGINES[name].refusal(scheme, expert) is None


def test_the_vllm_rows_are_vllms_kernel_tables():
    """vLLM 0.32: Marlin (GPU) takes uint4 with zero points, uint4b8 and uint8b128 at groups -1/32/64/128;
    CPUWNA16 (CPU) uint4 and uint4b8 at even groups; act-order 'group' is refused on both."""
    for name in ("vllm-gpu", "vllm-cpu"):
        assert served_by(name, W4_ASYM) and served_by(name, W4_SYM)
        assert served_by(name, QuantScheme(4, 128, True, "weight"))
        assert not served_by(name, QuantScheme(4, 128, True, "group"))
        assert not served_by(name, QuantScheme(8, 64, False))  # uint8 with zero points
        for bits in (2, 3):
            assert not served_by(name, QuantScheme(bits, 64, True))
            assert not served_by(name, QuantScheme(bits, 64, False))
    assert served_by("vllm-gpu", QuantScheme(8, 128, True)) and not served_by("vllm-cpu", QuantScheme(8, 128, True))
    assert not served_by("vllm-gpu", QuantScheme(4, 256, True)) and served_by("vllm-cpu", QuantScheme(4, 256, True))
    assert not served_by("vllm-cpu", QuantScheme(4, 33, True))
    assert served_by("vllm-gpu", QuantScheme(4, -1, False)) and served_by("vllm-cpu", QuantScheme(4, -1, False))


def test_lowbit_serves_everything_it_writes_and_transformers_what_compressed_tensors_reads():
    schemes = [QuantScheme(b, g, s, a) for b in (2, 3, 4, 8) for g in (-1, 32, 48) for s in (True, False)
               for a in (None, "weight", "group")]
    assert all(served_by("lowbit-cpu", s) and served_by("lowbit-gpu", s) for s in schemes)
    assert not served_by("transformers", QuantScheme(3, 64, True))  # 0.17.1 reads 3-bit in its older layout
    assert served_by("transformers", QuantScheme(2, 64, False)) and served_by("transformers", QuantScheme(8, -1, False))
    assert not served_by("transformers", W4_ASYM, expert=True) and served_by("transformers", W4_SYM, expert=True)
    assert served_by("llama.cpp", QuantScheme(4, 32, False)) and served_by("llama.cpp", QuantScheme(8, 32, True))
    assert not served_by("llama.cpp", QuantScheme(4, 64, True))


def test_the_llama_cpp_row_is_what_the_gguf_export_copies_exactly():
    from quant.gguf.export import EXACT_TYPES

    schemes = [QuantScheme(b, g, s) for b in (2, 3, 4, 8) for g in (-1, 32, 64) for s in (True, False)]
    assert {(s.bits, s.group_size, s.symmetric) for s in schemes if served_by("llama.cpp", s)} == set(EXACT_TYPES)


def _config(model_type: str, head_dim: int, **extra) -> dict:
    return {"model_type": model_type, "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 64,
            "head_dim": head_dim, **extra}


def test_engines_that_refuse_a_model_whole_say_so_by_family_or_head_size():
    """vLLM-CPU's attention takes head sizes 32, 64, 80, ... (the tiny models' 16 it refuses, as
    tests/test_vllm.py found); llama.cpp takes the families lowbit's GGUF writer writes."""
    from quant.gguf.write import ARCHES

    small = engines.serving({}, {}, _config("gemma2", 16))
    assert small["vllm-cpu"] == ("the model: head_dim 16: its attention takes 32, 64, 80, 96, 112, 128, 160, 192, "
                                 "224, 256, 512 only")
    assert small["vllm-gpu"] is None and small["transformers"] is None and small["lowbit-cpu"] is None
    assert engines.serving({}, {}, _config("qwen3", 64))["vllm-cpu"] is None
    assert engines.serving({}, {}, _config("qwen3", 48))["vllm-cpu"].startswith("the model: head_dim 48")
    for family in ARCHES:
        assert engines.ENGINES["llama.cpp"].model_refusal(_config(family, 32)) is None
    outside = sorted(set(architectures.SUPPORTED_MODEL_TYPES) - set(ARCHES))
    assert outside, "every lowbit family exports to GGUF: this test has nothing left to refuse"
    for family in outside:
        why = engines.ENGINES["llama.cpp"].model_refusal(_config(family, 32, text_config=_config("gemma3_text", 32)))
        text_family = "gemma3_text" if family == "gemma3" else family  # a multimodal config: its text decoder
        if text_family in ARCHES:
            assert why is None
            continue
        assert why == f"the {text_family} family: lowbit's GGUF export writes {', '.join(sorted(ARCHES))} only"
    unknown = engines.serving({}, {}, _config("falcon", 64))
    assert all(why.startswith("the model: model_type 'falcon' is not supported") for why in unknown.values())
    lines = engines.serving_lines({}, {}, _config("gemma2", 16))
    assert lines[0] == "served by: lowbit-cpu, lowbit-gpu, transformers, vllm-gpu"
    assert lines[1].startswith("not by vllm-cpu: the model: head_dim 16")


def test_names_and_aliases():
    assert [e.name for e in engines.resolve(["vllm"])] == ["vllm-gpu", "vllm-cpu"]
    assert [e.name for e in engines.resolve(["vllm-cpu", "transformers"])] == ["transformers", "vllm-cpu"]
    with pytest.raises(engines.EngineError, match="unknown engine 'vlm' .*known: lowbit-cpu"):
        engines.resolve(["vlm"])


def test_vllm_cpu_needs_input_and_joined_output_sizes_in_multiples_of_32():
    plan = {f"l.self_attn.{p}": W4_ASYM for p in ("q_proj", "k_proj", "v_proj")} | {"l.mlp.down_proj": W4_ASYM}
    shapes = {"l.self_attn.q_proj": (64, 64), "l.self_attn.k_proj": (16, 64), "l.self_attn.v_proj": (16, 64),
              "l.mlp.down_proj": (64, 80)}
    refused = engines.layer_refusals(engines.ENGINES["vllm-cpu"], plan, shapes)
    assert refused == {"l.mlp.down_proj": "80 input features: it takes multiples of 32"}  # q+k+v = 96 outputs
    shapes["l.self_attn.k_proj"] = (8, 64)
    assert "88 output features (q_proj+k_proj+v_proj" in engines.layer_refusals(
        engines.ENGINES["vllm-cpu"], plan, shapes)["l.self_attn.q_proj"]
    assert engines.serving(plan, shapes)["vllm-gpu"] is None
    plan["l.self_attn.k_proj"] = QuantScheme(4, 32, False)  # vLLM joins q/k/v into one matmul of one scheme
    assert engines.serving(plan, shapes)["vllm-gpu"] == ("l.self_attn.k_proj: q_proj+k_proj+v_proj with different "
                                                         "schemes: it runs them as one matmul under one scheme "
                                                         "(and 2 more Linears)")
    assert engines.serving(plan, shapes)["transformers"] is None


# ------------------------------------------------------------------ recipes held to engines


@pytest.mark.parametrize("spec, weights, message", [
    ("vllm", {"bits": 3}, "weights.bits: serve_with vllm: vllm-gpu (Marlin kernel) refuses 3-bit asymmetric"),
    ("vllm-cpu", {"bits": 8, "symmetric": True}, "weights.bits: serve_with vllm-cpu: vllm-cpu (CPUWNA16 kernel) "
                                                 "refuses 8-bit symmetric weights: of symmetric ones it takes 4-bit only"),
    ("vllm", {"methods": ["gptq"], "gptq": {"actorder": "group"}},
     "weights.gptq.actorder: serve_with vllm: vllm-gpu (Marlin kernel) refuses act-order 'group'"),
    ("vllm", {"group_size": 256}, "weights.group_size: serve_with vllm: vllm-gpu (Marlin kernel) refuses group size 256"),
    (["vllm"], {"overrides": [{"match": "down_proj", "bits": 8}]}, "weights.overrides[0]: serve_with vllm: "
                                                                   "vllm-gpu (Marlin kernel) refuses 8-bit asymmetric"),
    ("vllm-gpu", {"target_bits": 4.5, "candidates": [{"bits": 4}, {"bits": 3}]},
     "weights.candidates[1]: serve_with vllm-gpu: vllm-gpu (Marlin kernel) refuses 3-bit"),
    ("vllm", {"target_bits": 3.5}, "weights.target_bits: serve_with vllm: the candidates its engines serve "
                                   "(w4 g32, w4 g64, w4 g128) store at least 4 bits"),
    ("transformers", {"bits": 3}, "weights.bits: serve_with transformers: transformers (compressed-tensors) refuses 3-bit"),
    ("vlm", {}, "serve_with: unknown engine 'vlm'"),
    ({"vllm": True}, {}, "serve_with: expected an engine name or a list of them (lowbit-cpu, "),
])
def test_a_recipe_an_engine_cannot_serve_is_refused_at_the_key_that_chose_it(spec, weights, message):
    with pytest.raises(RecipeError) as e:
        parse_recipe({"model": "m", "serve_with": spec, "weights": weights}, "r.yaml")
    assert f"r.yaml: {message}" in str(e.value)


def test_serve_with_narrows_the_budgets_default_candidates_and_round_trips():
    r = parse_recipe({"model": "m", "serve_with": ["vllm"], "weights": {"target_bits": 4.3, "group_size": 32}})
    assert r.weights.budget_candidates == [Candidate(4, 32), Candidate(4, 64), Candidate(4, 128)]
    assert parse_recipe(r.to_dict()) == r
    assert "serve_with" not in parse_recipe({"model": "m"}).to_dict()  # today's recipes write as before
    gpu = parse_recipe({"model": "m", "serve_with": "vllm-gpu", "weights": {"target_bits": 4.3, "symmetric": True}})
    assert Candidate(8, 64) in gpu.weights.budget_candidates  # Marlin takes symmetric 8-bit


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    text = root / "calibration.txt"
    text.write_text(TEXT * 20)
    # every size a multiple of 32, head_dim 32 (vLLM-CPU's smallest)
    fits = save_model(*tiny_llama(hidden=64, layers=2, num_attention_heads=2, num_key_value_heads=1), root / "fits")
    # head_dim 80 (vLLM-CPU takes it), Linear sizes it does not
    odd = save_model(*tiny_llama(hidden=80, layers=1, num_attention_heads=1, num_key_value_heads=1), root / "odd")
    return fits, odd, text


def _recipe(model, out, calibration, serve_with=None, **weights):
    data = {"model": str(model), "output": str(out), "dtype": "float32",
            "calibration": {"text": str(calibration), "samples": 4, "seq_len": 32}, "weights": weights}
    return parse_recipe({**data, "serve_with": serve_with} if serve_with else data)


def test_a_model_whose_shapes_an_engine_refuses_fails_before_any_work_naming_the_layers(tmp_path, tiny_dirs,
                                                                                       monkeypatch):
    import quant.quantize
    from lowbit import pipeline

    _, odd, text = tiny_dirs
    monkeypatch.setattr(pipeline, "quantize_model", lambda *a, **k: pytest.fail("quantization ran"))
    monkeypatch.setattr(quant.quantize, "quantize_model", lambda *a, **k: pytest.fail("quantization ran"))
    with pytest.raises(RecipeError) as e:
        pipeline.quantize(_recipe(odd, tmp_path / "out", text, "vllm-cpu", methods=["gptq"]), progress=False)
    message = str(e.value)
    assert message.startswith("serve_with: vllm-cpu cannot serve this plan:")
    assert "model.layers.0.self_attn.q_proj: vllm-cpu (CPUWNA16 kernel) refuses 80 input features: it takes " \
           "multiples of 32" in message
    assert not (tmp_path / "out").exists()


def test_a_model_an_engine_refuses_whole_fails_before_any_work(tmp_path, tiny_dirs, monkeypatch):
    import quant.quantize
    from lowbit import pipeline

    _, _, text = tiny_dirs
    small = save_model(*tiny_llama(hidden=64, layers=1, intermediate_size=128), tmp_path / "small")  # head_dim 16
    monkeypatch.setattr(quant.quantize, "quantize_model", lambda *a, **k: pytest.fail("quantization ran"))
    with pytest.raises(RecipeError) as e:
        pipeline.quantize(_recipe(small, tmp_path / "out", text, "vllm", methods=["gptq"]), progress=False)
    assert str(e.value) == ("serve_with: vllm-gpu, vllm-cpu cannot serve this plan:\n  the model: vllm-cpu refuses "
                            "head_dim 16: its attention takes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512 only")
    assert not (tmp_path / "out").exists()


def test_a_budget_held_to_vllm_chooses_only_what_vllm_serves(tmp_path, tiny_dirs, capsys):
    from lowbit import pipeline

    fits, _, text = tiny_dirs
    out = pipeline.quantize(_recipe(fits, tmp_path / "mix", text, ["vllm"], target_bits=4.75, group_size=32,
                                    symmetric=True, methods=["gptq"], gptq={"actorder": "weight"}),
                            device="cpu", progress=True)
    manifest = json.loads((out / checkpoint.MANIFEST).read_text())
    layers = manifest["budget"]["layers"]
    assert {e["choice"] for e in layers.values()} <= {"w4 g32", "w4 g64", "w4 g128"}
    for i in range(2):  # vLLM runs q/k/v and gate/up as one matmul each: one choice per group
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            assert len({layers[n]["choice"] for n in layers if n.startswith(f"model.layers.{i}.")
                        and n.rsplit(".", 1)[1] in group}) == 1
    groups = checkpoint.read_config(out)["quantization_config"]["config_groups"].values()
    assert len(groups) > 1 and {g["weights"]["num_bits"] for g in groups} == {4}  # a mix of group sizes
    assert "served by: lowbit-cpu, lowbit-gpu, transformers, vllm-gpu, vllm-cpu\n" in capsys.readouterr().out


def test_quantize_and_inspect_say_which_engines_serve_the_result(tmp_path, tiny_dirs, capsys):
    from lowbit import pipeline
    from lowbit.inspection import inspect_text

    fits, _, text = tiny_dirs
    out = pipeline.quantize(_recipe(fits, tmp_path / "w8", text, bits=8, symmetric=True, group_size=32,
                                    methods=["gptq"], gptq={"actorder": "group"}), device="cpu", progress=True)
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith(("served by", "not by"))]
    assert lines[0] == "served by: lowbit-cpu, lowbit-gpu, transformers"
    assert "not by vllm-gpu: model.layers.0.mlp.down_proj: act-order 'group' (a per-column group index): use " \
           "actorder: weight, which it takes (and 13 more Linears)" in lines
    assert "not by vllm-cpu: model.layers.0.mlp.down_proj: 8-bit symmetric weights: of symmetric ones it takes " \
           "4-bit only (and 13 more Linears)" in lines
    assert any(line.startswith("not by llama.cpp: ") for line in lines)
    assert "\n".join(lines) in inspect_text(out)


def test_transformers_reads_act_order_group_as_the_table_says(tmp_path, tiny_dirs):
    """The table's transformers row takes act-order 'group' (its g_idx): the logits are lowbit's."""
    pytest.importorskip("compressed_tensors")
    import torch
    from transformers import AutoModelForCausalLM

    import runtime
    from lowbit import pipeline

    fits, _, text = tiny_dirs
    out = pipeline.quantize(_recipe(fits, tmp_path / "group", text, ["transformers"], group_size=32,
                                    methods=["gptq"], gptq={"actorder": "group"}), device="cpu", progress=False)
    assert "weight_g_idx" in "".join(checkpoint.read_header(out / "model.safetensors"))
    ids = torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    torch.testing.assert_close(runtime.load(out, linear_backend="reference").logits(ids), theirs, atol=1e-4, rtol=1e-4)


def test_vllm_cpu_with_amx_takes_symmetric_4_bit_experts_in_groups_other_than_32():
    """vLLM's int4 MoE kernel (CPUExpertsInt4) runs on AMX CPUs only, and there takes uint4b8 experts whose scale
    key is kInt4Static: every group size but 32 (tests/test_vllm.py on an AMX host)."""
    amx, plain = engines.VLLM_CPU_AMX, engines.ENGINES["vllm-cpu"]
    assert plain.refusal(QuantScheme(4, 64, True), expert=True).startswith("quantized MoE experts: its only CPU int4")
    assert amx.refusal(QuantScheme(4, 64, True), expert=True) is None
    assert amx.refusal(QuantScheme(4, -1, True), expert=True) is None
    assert "groups of 32" in amx.refusal(QuantScheme(4, 32, True), expert=True)
    assert "other than 4-bit symmetric" in amx.refusal(QuantScheme(4, 64, False), expert=True)
    assert amx.refusal(QuantScheme(4, 32, True)) is None and amx.refusal(QuantScheme(8, 64, True))  # the row's rules
