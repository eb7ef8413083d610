"""lowbit's runtime against transformers: same logits, same greedy tokens, quantized or not."""

import json

import pytest
import torch
import torch.nn.functional as F

import runtime
from quant import checkpoint
from quant import checkpoint_write
from quant.affine import QuantScheme, choose_qparams, fake_quantize, quantize
from quant.format import quantization_config
from quant.packing import pack
from runtime.cache_lockstep import LockstepCache
from runtime.linear import QuantLinear
from tiny import save_model, tiny_llama, tiny_model


KINDS = ["llama", "llama-untied", "llama3-rope", "llama-bias", "qwen2", "qwen2-sliding", "qwen3", "mistral",
         "mistral-sliding", "gemma2", "gemma3", "phi3", "phi3-longrope"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """One saved tiny Llama (GQA, tied) shared by the tests that only need some model."""
    model, tok = tiny_model("llama")
    return save_model(model, tok, tmp_path_factory.mktemp("tiny") / "m")


@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_greedy_tokens_match_transformers(tmp_path, kind):
    model, tok = tiny_model(kind)
    rt = runtime.load(save_model(model, tok, tmp_path / kind))
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(rt.logits(ids), expected, atol=1e-4, rtol=1e-4)
    assert rt.num_parameters == model.num_parameters()

    prompt = "Anne Elliot walked"
    gen = rt.generate(prompt, max_new_tokens=12, stop_at_eos=False)
    ours = [t.id for t in gen]
    hf = model.generate(tok(prompt, return_tensors="pt").input_ids, max_new_tokens=12, min_new_tokens=12,
                        do_sample=False, pad_token_id=tok.eos_token_id)
    assert ours == hf[0, -12:].tolist()


def test_prefill_in_chunks_through_the_cache_equals_one_forward(tiny_dir):
    rt = runtime.load(tiny_dir)
    cfg = rt.decoder.cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    cache = LockstepCache(cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim, 37, torch.float32, "cpu")
    chunks, pos = [], 0
    with torch.inference_mode():
        for size in (16, 1, 7, 13):  # a prefill, a decode step, then uneven chunks
            chunks.append(rt.decoder(ids[:, pos:pos + size], cache, pos))
            pos += size
    torch.testing.assert_close(torch.cat(chunks, 1), rt.logits(ids), atol=1e-5, rtol=1e-5)


def test_kv_cache_writes_at_positions_and_reads_up_to_length():
    cache = LockstepCache(num_layers=2, batch=1, kv_heads=2, head_dim=4, max_len=6, dtype=torch.float32, device="cpu")
    k, v = torch.ones(1, 2, 4, 4), torch.full((1, 2, 4, 4), 2.0)
    keys, values = cache.update(1, 0, k, v)
    assert keys.shape == (1, 2, 4, 4) and torch.equal(values, v)
    keys, _ = cache.update(1, 4, 3 * torch.ones(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert keys.shape[2] == 5 and keys[0, 0, :, 0].tolist() == [1, 1, 1, 1, 3]
    assert cache.read(0, 0)[0].shape == (1, 2, 0, 4)  # other layers untouched
    with pytest.raises(ValueError, match="holds 0 positions"):
        cache.read(0, 5)
    with pytest.raises(ValueError, match="6 positions"):
        cache.update(1, 5, torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4))


# -- quantized layers -----------------------------------------------------------------------------


def packed_tensors(weight: torch.Tensor, scheme: QuantScheme, prefix: str = "") -> dict[str, torch.Tensor]:
    """A Linear's tensors as a pack-quantized checkpoint stores them, built with quant's own math."""
    scale, zero = choose_qparams(weight, scheme)
    out = {
        f"{prefix}weight_packed": pack(quantize(weight, scale, zero, scheme), scheme.bits, dim=1),
        f"{prefix}weight_scale": scale,
        f"{prefix}weight_shape": torch.tensor(weight.shape, dtype=torch.int64),
    }
    if zero is not None:
        out[f"{prefix}weight_zero_point"] = pack(zero, scheme.bits, dim=0)
    return out


@pytest.mark.parametrize("bits", [4, 8, 3])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, -1])
def test_quant_linear_equals_linear_with_the_fake_quantized_weight(bits, symmetric, group_size):
    torch.manual_seed(bits * 10 + symmetric)
    out_features, in_features = 37, 96  # odd out: zero points pack into a partial word along dim 0
    weight, bias, x = torch.randn(out_features, in_features), torch.randn(out_features), torch.randn(2, 5, in_features)
    scheme = QuantScheme(bits, group_size, symmetric)
    layer = QuantLinear(in_features, out_features, scheme, bias=True)
    layer.load_state_dict({**packed_tensors(weight, scheme), "bias": bias})
    layer.use_backend("reference", torch.float32)  # compared at float32 precision (the CPU kernels: test_cpu_linear)
    expected = F.linear(x, fake_quantize(weight, scheme), bias)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x[:, :1]), expected[:, :1], atol=1e-5, rtol=1e-5)  # decode shape, cached weight
    assert layer.weight_packed.dtype == torch.int32 and layer.weight_packed.shape[1] == -(-in_features * bits // 32)


def test_quant_linear_with_act_order_groups():
    torch.manual_seed(0)
    weight, x = torch.randn(16, 64), torch.randn(3, 64)
    scheme = QuantScheme(4, 16, False, actorder="group")
    perm = torch.randperm(64)
    # quantize in activation order: group j holds columns perm[16j:16j+16]
    tensors = packed_tensors(weight[:, perm], QuantScheme(4, 16, False))
    dense_perm = fake_quantize(weight[:, perm], QuantScheme(4, 16, False))
    g_idx = torch.empty(64, dtype=torch.int32)
    g_idx[perm] = torch.arange(64, dtype=torch.int32) // 16
    from quant.packing import unpack

    q = unpack(tensors["weight_packed"], 4, 64)[:, torch.argsort(perm)]  # columns back in model order
    tensors["weight_packed"] = pack(q, 4, dim=1)
    layer = QuantLinear(64, 16, scheme)
    layer.load_state_dict({**tensors, "weight_g_idx": g_idx})
    torch.testing.assert_close(layer(x), F.linear(x, dense_perm[:, torch.argsort(perm)]), atol=1e-5, rtol=1e-5)


def write_quantized(model, tok, path, plan: dict[str, QuantScheme]):
    """Our own minimal pack-quantized writer (independent of quant.checkpoint_write.save): packs the
    planned Linears and leaves ``model`` holding the fake-quantized weights to compare with."""
    path.mkdir()
    tensors = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            module = name.rpartition(".")[0]
            if module in plan and name.endswith(".weight"):
                tensors.update(packed_tensors(t, plan[module], f"{module}."))
                t.copy_(fake_quantize(t, plan[module]))
            elif name != "lm_head.weight" or not model.config.tie_word_embeddings:
                tensors[name] = t.contiguous()
    from safetensors.torch import save_file

    save_file(tensors, path / "model.safetensors")
    config = model.config.to_dict()
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    config["quantization_config"] = quantization_config(plan, [n for n in linears if n not in plan])
    (path / "config.json").write_text(json.dumps(config))
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["llama-untied", "qwen2"])
def test_quantized_checkpoint_runs_with_the_fake_quantized_weights(tmp_path, kind):
    model, tok = tiny_model(kind, seed=2)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    plan = {n: QuantScheme(8, -1, True) if "self_attn" in n else QuantScheme(4, 32, False) for n in linears}
    plan["lm_head"] = QuantScheme(4, 32, True)
    path = write_quantized(model, tok, tmp_path / "q", plan)
    rt = runtime.load(path, linear_backend="reference")  # compared at float32 precision
    # every planned layer is quantized (q/k/v and gate/up joined at load: count their weights)
    hf_linears = dict(model.named_modules())
    assert sum(m.in_features * m.out_features for m in rt.decoder.modules() if isinstance(m, QuantLinear)) == sum(
        hf_linears[n].weight.numel() for n in plan)
    assert hasattr(rt.decoder.model.layers[0].self_attn, "qkv_proj") and hasattr(rt.decoder.model.layers[0].mlp,
                                                                                  "gate_up_proj")
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(rt.logits(ids), expected, atol=1e-4, rtol=1e-4)
    assert rt.num_parameters == model.num_parameters()


def test_quantized_checkpoint_matches_transformers_with_compressed_tensors(tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    from quant.plan import plan_layers
    from quant.quantize import quantize_model

    model, tok = tiny_llama(seed=4)
    plan = plan_layers(model, QuantScheme(4, 32, symmetric=False), ["lm_head"])
    quantized, _ = quantize_model(model, plan, progress=False)
    out = checkpoint_write.save(model, quantized, tmp_path / "q", tokenizer=tok, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 33), generator=torch.Generator().manual_seed(5))
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs(ids).logits
    ours = runtime.load(out, linear_backend="reference").logits(ids)  # compared at float32 precision
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    # and quantization changed something: the comparison is not float against float
    with torch.no_grad():
        assert (model(ids).logits - expected).abs().max() > 1e-3


def test_quantized_weight_shape_is_checked(tmp_path):
    model, tok = tiny_llama(seed=1)
    name = "model.layers.0.mlp.up_proj"
    path = write_quantized(model, tok, tmp_path / "q", {name: QuantScheme(4, 32, True)})
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    tensors[f"{name}.weight_shape"] = torch.tensor([1, 2])
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(checkpoint.CheckpointError, match="up_proj.weight_shape"):
        runtime.load(path)


# -- generation -------------------------------------------------------------------------------------


def test_streaming_gives_text_pieces_and_timings(tiny_dir):
    rt = runtime.load(tiny_dir)
    gen = rt.generate("a single man", max_new_tokens=6, stop_at_eos=False)
    tokens = list(gen)
    assert len(tokens) == 6
    assert "".join(t.text for t in tokens) == gen.text
    assert gen.ttft_s > 0 and len(gen.itl_s) == 5 and gen.mean_itl_s > 0
    assert all(a.t < b.t for a, b in zip(tokens, tokens[1:]))
    again = list(gen)  # iterating again starts a fresh request
    assert [t.id for t in again] == [t.id for t in tokens] and len(gen.itl_s) == 5


def test_multibyte_characters_come_out_whole(tiny_dir):
    rt = runtime.load(tiny_dir)
    tok = rt.tokenizer
    ids = tok("é ü 日本").input_ids  # byte-level BPE: these characters span several tokens
    # force the model to emit exactly these ids by streaming a fake "generation"
    gen = rt.generate([1], max_new_tokens=len(ids), stop_at_eos=False)
    gen.model = type("Forced", (), {**{k: getattr(rt, k) for k in ("tokenizer", "max_positions", "device", "dtype",
                                                                  "eos_token_ids", "new_cache")},
                                    "decoder": ForcedDecoder(rt.decoder, ids)})()
    pieces = [t.text for t in gen]
    assert "".join(pieces) == "é ü 日本"
    assert all("\ufffd" not in p for p in pieces)


class ForcedDecoder:
    """Stands in for the decoder (a decode step's call and a prefill's ``forward_packed``): its
    logits pick the given ids in turn."""

    attention_asked, attention_off = "auto", ()  # what runtime.attention reads to choose a backend

    def __init__(self, decoder, ids):
        self.cfg, self.ids, self.step = decoder.cfg, ids, 0

    def forward_packed(self, input_ids, positions, batch, logits_at):
        return self(input_ids[None], batch, positions[0], last_only=True)[:, -1]

    def __call__(self, inputs, cache, pos, last_only=False):
        logits = torch.zeros(1, 1 if last_only else inputs.shape[1], self.cfg.vocab_size)
        logits[0, -1, self.ids[self.step]] = 1
        self.step += 1
        return logits


def test_stops_at_eos_and_at_max_new_tokens(tiny_dir):
    rt = runtime.load(tiny_dir)
    args = dict(prompt="Lyme", max_new_tokens=12, temperature=2.0, seed=3)  # seeded: varied but repeatable
    first = [t.id for t in rt.generate(**args, stop_at_eos=False)]
    assert len(first) == 12
    j = next(j for j in range(1, 12) if first[j] not in first[:j])
    rt.eos_token_ids = [first[j]]  # pretend that token ends the sequence: it is not yielded
    assert [t.id for t in rt.generate(**args)] == first[:j]


def test_seeded_sampling_is_reproducible(tiny_dir):
    rt = runtime.load(tiny_dir)
    runs = [[t.id for t in rt.generate("Lyme", max_new_tokens=10, temperature=1.0, top_p=0.9, seed=s, stop_at_eos=False)]
            for s in (7, 7, 8)]
    assert runs[0] == runs[1] != runs[2]
    # a tiny nucleus keeps only the top token: sampling becomes greedy
    greedy = [t.id for t in rt.generate("Lyme", max_new_tokens=10, stop_at_eos=False)]
    nucleus = [t.id for t in rt.generate("Lyme", max_new_tokens=10, temperature=1.0, top_p=1e-6, seed=1, stop_at_eos=False)]
    assert nucleus == greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
     ({"top_p": 1.5}, "top_p"), ({"prompt": []}, "empty"), ({"prompt": [10**6]}, "vocabulary")],
)
def test_bad_generation_arguments(tiny_dir, kwargs, message):
    rt = runtime.load(tiny_dir)
    with pytest.raises(ValueError, match=message):
        rt.generate(**{"prompt": "x", **kwargs})


def test_prompt_longer_than_context_is_refused(tiny_dir):
    rt = runtime.load(tiny_dir)
    with pytest.raises(ValueError, match="context"):
        rt.generate([5] * (rt.max_positions + 1))
    # a prompt that fills the context exactly still gets its one next token
    assert len(list(rt.generate([5] * rt.max_positions, max_new_tokens=4, stop_at_eos=False))) == 1


# -- loading and errors -----------------------------------------------------------------------------


def test_unsupported_architecture_names_itself_and_the_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "g")
    with pytest.raises(runtime.UnsupportedModelError, match="gpt2.*llama"):
        runtime.load(tmp_path / "g")


BASE = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2}


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn.*default"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"model_type": "qwen2", "layer_types": ["chunked_attention"]}, "chunked_attention"),
])
def test_unsupported_features_are_named(change, message):
    with pytest.raises(runtime.UnsupportedModelError, match=message):
        runtime.check_supported({**BASE, **change})


def test_old_style_config_and_stored_rotary_frequencies_load(tmp_path):
    """Pre-transformers-5 configs keep rope_theta at the top level; old checkpoints store inv_freq."""
    model, tok = tiny_model("llama-untied")
    path = save_model(model, tok, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["rope_scaling"] = None
    (path / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, path / "model.safetensors")
    ids = torch.arange(20).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(runtime.load(path).logits(ids), model(ids).logits, atol=1e-4, rtol=1e-4)


def test_missing_paths_and_tensors_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        runtime.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        runtime.load(tmp_path / "empty")
    model, tok = tiny_llama()
    d = save_model(model, tok, tmp_path / "m")
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").rename(d / "weights.bak")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        runtime.load(d)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.1.mlp.extra"] = torch.zeros(1)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(checkpoint.CheckpointError, match="up_proj.*extra"):
        runtime.load(d)


def test_loads_without_tokenizer_files_for_token_id_use(tmp_path):
    model, _ = tiny_llama()
    model.save_pretrained(tmp_path / "m")
    rt = runtime.load(tmp_path / "m")
    assert rt.tokenizer is None
    assert rt.logits(torch.tensor([[1, 2, 3]])).shape == (1, 3, model.config.vocab_size)
    assert len(list(rt.generate([1, 2, 3], max_new_tokens=2, stop_at_eos=False))) == 2
    with pytest.raises(ValueError, match="tokenizer"):
        rt.generate("text")


def test_dtype_override(tiny_dir):
    rt = runtime.load(tiny_dir, dtype=torch.bfloat16)
    assert rt.dtype == torch.bfloat16 and rt.decoder.model.embed_tokens.weight.dtype == torch.bfloat16
    out = rt.logits(torch.tensor([[1, 2, 3]]))
    assert out.dtype == torch.float32  # logits always come back as float32
    torch.testing.assert_close(out, runtime.load(tiny_dir).logits(torch.tensor([[1, 2, 3]])), atol=0.1, rtol=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_formula_bit_for_bit(dtype):
    """RMSNorm runs F.rms_norm (one call on a decode step, not five): the same values as HF's
    float32 normalize, round to the activations' dtype, then scale."""
    from runtime.norms import RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-5).to(dtype)
    norm.weight.data = torch.randn(64, generator=g).to(dtype)
    x = (torch.randn(3, 5, 64, generator=g) * 4).to(dtype)
    xf = x.float()
    want = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert torch.equal(norm(x), want)


@pytest.mark.parametrize("start", [3, "per-sequence"])
def test_joined_rope_equals_rotating_q_and_k_apart(start):
    """q and k of a joined qkv_proj are rotated as one tensor (half the ops): bit for bit what
    rotating each, as HF lays them out, gives; per-sequence starts too."""
    from runtime.model import Decoder, DecoderConfig
    from runtime.rope import apply_rope

    cfg = DecoderConfig.from_hf(tiny_llama()[0].config.to_dict())
    decoder = Decoder(cfg)
    decoder.join_projections()
    attention = decoder.model.layers[0].self_attn
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = torch.randn(2, 4, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    cos, sin = decoder.rope(3 if start == 3 else torch.tensor([3, 9]), 4, torch.float32)[0]
    with torch.no_grad():
        q, k, v = attention.project(x, cos, sin, None, 0)
        apart = [t.view(2, 4, -1, d).transpose(1, 2) for t in attention.qkv_proj(x).split([h * d, kv * d, kv * d], -1)]
    assert torch.equal(q, apply_rope(apart[0], cos, sin)) and torch.equal(k, apply_rope(apart[1], cos, sin))
    assert torch.equal(v, apart[2])
