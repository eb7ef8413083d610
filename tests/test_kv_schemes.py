"""The KV-cache families registry (kvquant/schemes/): every family round trips, the K/V-split
family runs end to end on the reference path, and every list of schemes a user sees reads it."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from kvquant import KVScheme, bytes_per_token, dequantize_kv, fake_quantize_kv, kv_scheme_from_dict, layout, parse_kv, \
    quantize_kv
from kvquant import schemes
from kvquant.schemes.integer import IntegerFamily, IntGrid
from runtime.cache import KVCache
from runtime.cache_lockstep import LockstepCache
from lowbit_testing.kv_data import keys_with_offset_channels as offset_keys, rel_err

# every family's listed names, and settings each family reads
NAMES = [*schemes.listed_names(), "k8v2", "k2v4", "int4-g32-r64", "k4v2-g16-r32", "fp8-r64", "int8-r32"]
# relative error of a round trip on keys with offset channels (the worst side); fp16 exact
BOUNDS = {"fp16": 0.0, "int8": 0.01, "fp8": 0.06, "int4": 0.12, "int2": 0.6, "k8v4": 0.12, "k8v2": 0.6, "k4v2": 0.6,
          "k2v4": 0.6}
# bytes per token of one head (keys + values) at head_dim 64, group 64, float16 scales, worked out by hand:
# int data D*bits/8 bytes per side; INT8 scale+zero 4 bytes per token; KIVI keys 4*D/G bytes per token
# (one scale+zero per channel every G tokens), values 4*D/G per token
HAND_BYTES = {"fp16": 2 * 128, "int8": 2 * (64 + 4), "int4": 2 * (32 + 4), "int2": 2 * (16 + 4), "fp8": 2 * 64 + 8 / 128,
              "k8v4": (64 + 4) + (32 + 4), "k4v2": (32 + 4) + (16 + 4), "k8v2": (64 + 4) + (16 + 4)}




def base_name(name: str) -> str:
    return name.split("-")[0]


# ------------------------------------------------------------------ names


def test_every_family_is_found_and_lists_names_that_parse_back_to_it():
    assert list(schemes.REGISTRY) == ["fp16", "int8", "kivi", "fp8", "kv-split"]
    for family in schemes.REGISTRY.values():
        assert family.listed, family.name
        for name in family.listed:
            scheme = parse_kv(name)
            assert scheme.family == family.name and scheme.definition is family


@pytest.mark.parametrize("name", NAMES)
def test_names_settings_and_stored_dicts_round_trip(name):
    scheme = parse_kv(name)
    assert parse_kv(scheme.name, default=scheme) == scheme
    if scheme.definition.grouped:  # the name carries group and residual (int8, fp8, fp16 keep the short name)
        assert parse_kv(scheme.name) == scheme
    assert kv_scheme_from_dict(scheme.to_dict()) == scheme  # what checkpoints and recipes store
    legacy = {k: v for k, v in scheme.to_dict().items() if k != "family"}
    assert kv_scheme_from_dict(legacy) == scheme  # written before families: the family is claimed


def test_older_checkpoints_dicts_read_as_before():
    assert kv_scheme_from_dict({"bits": 4, "type": "int", "group_size": 32, "residual": 64}) == parse_kv("int4-g32-r64")
    assert kv_scheme_from_dict({"bits": 8, "type": "float", "group_size": 64, "residual": 128}).family == "fp8"
    assert KVScheme(bits=8, value_bits=4) == parse_kv("k8v4")


def test_an_unknown_name_lists_every_family_and_its_names():
    with pytest.raises(ValueError) as e:
        parse_kv("k3v1")
    msg = str(e.value)
    assert "unknown KV cache scheme 'k3v1'" in msg
    for family in schemes.REGISTRY.values():
        assert f"{family.name}: {family.summary}" in msg
    assert "fp16, int8, int4, int2, fp8, k8v4 or k4v2" in msg


@pytest.mark.parametrize("settings, match", [
    (dict(bits=4, family="int8"), "int8 KV cache stores 8-bit integers"),
    (dict(bits=8, family="kivi"), "same width, 4 or 2 bits"),
    (dict(bits=4, value_bits=4, family="kv-split"), "two different widths.*one width for both is int8, int4 or int2"),
    (dict(bits=4, value_bits=2, type="float"), "FP8.*bits must be 8"),
    (dict(bits=4, family="kiwi"), "unknown KV cache family 'kiwi' \\(did you mean 'kivi'\\?\\)"),
    (dict(bits=4, value_bits=3), "value_bits must be one of 16, 8, 4, 2"),
    (dict(bits=4, value_bits=2, residual=100), "residual 100 is not a multiple of group_size 64"),
])
def test_settings_a_family_cannot_take_are_refused_with_the_reason(settings, match):
    with pytest.raises(ValueError, match=match):
        KVScheme(**settings)


def test_k8v4_keeps_int8_keys_so_its_blocks_need_no_whole_key_groups():
    KVScheme(bits=8, value_bits=4, residual=96, group_size=32)  # per-token keys: residual free
    with pytest.raises(ValueError, match="group_size 64 does not divide head_dim 96"):
        parse_kv("k8v4").check_head_dim(96)  # values still grouped over channels


# ------------------------------------------------- storage and reference math


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("keys", [True, False])
def test_stored_tensors_follow_the_familys_layout(name, keys):
    scheme = parse_kv(name)
    x = offset_keys(2, 3, tokens=scheme.block_size)
    q = quantize_kv(x, scheme, keys)
    parts = layout(scheme, 64, torch.float32, keys)
    for (part, (shape, dtype)), tensor in zip(parts.items(), q):
        assert tuple(tensor.shape) == (2, 3, *shape) and tensor.dtype == dtype, part
    assert all(t is None for t in q[len(parts):])


@pytest.mark.parametrize("name", list(BOUNDS))
def test_round_trip_error_within_the_familys_bound(name):
    scheme = parse_kv(name)
    x = offset_keys(4, 2, seed=3)
    errors = [rel_err(fake_quantize_kv(x, scheme, keys), x) for keys in (True, False)]
    assert max(errors) <= BOUNDS[name]
    assert (max(errors) == 0) == (not scheme.quantized)


@pytest.mark.parametrize("name", list(HAND_BYTES))
def test_bytes_per_token_as_worked_out_by_hand(name):
    assert bytes_per_token(parse_kv(name), 1, 1, 64) == pytest.approx(HAND_BYTES[name])
    assert bytes_per_token(parse_kv(name), 30, 3, 64) == pytest.approx(90 * HAND_BYTES[name])


@pytest.mark.parametrize("split, key_side, value_side", [("k8v4", "int8", "int4"), ("k4v2", "int4", "int2"),
                                                          ("k2v4", "int2", "int4"), ("k8v2-g16", "int8", "int2-g16")])
def test_each_side_of_a_split_is_its_widths_own_scheme_bit_for_bit(split, key_side, value_side):
    x = offset_keys(2, 3, seed=7)
    for keys, same in ((True, key_side), (False, value_side)):
        a, b = quantize_kv(x, parse_kv(split), keys), quantize_kv(x, parse_kv(same), keys)
        assert all(torch.equal(s, t) for s, t in zip(a, b))
        assert torch.equal(dequantize_kv(a, parse_kv(split), keys, 64, torch.float32),
                           dequantize_kv(b, parse_kv(same), keys, 64, torch.float32))


def test_wider_keys_than_values_lose_less_than_the_reverse_on_offset_keys():
    """What the split is for: the same bytes, spent on keys, keep the keys' offset channels."""
    k, v = offset_keys(2, 4, seed=1), torch.randn(2, 4, 128, 64, generator=torch.Generator().manual_seed(2))
    err = {n: rel_err(fake_quantize_kv(k, parse_kv(n), True), k) for n in ("k4v2", "k2v4")}
    assert bytes_per_token(parse_kv("k4v2"), 1, 1, 64) == bytes_per_token(parse_kv("k2v4"), 1, 1, 64)
    assert err["k4v2"] < 0.3 * err["k2v4"]
    assert rel_err(fake_quantize_kv(v, parse_kv("k4v2"), False), v) > rel_err(fake_quantize_kv(v, parse_kv("k2v4"), False), v)


# --------------------------------------------------- the runtime, end to end


@pytest.mark.parametrize("name", ["k8v4-g32-r64", "k4v2-g32-r64"])
def test_a_split_cache_holds_quantized_blocks_and_an_exact_residual_in_both_cache_modes(name):
    scheme = parse_kv(name)
    k, v = offset_keys(2, 3, tokens=150, seed=1), torch.randn(2, 3, 150, 64)
    lockstep = LockstepCache(1, 2, 3, 64, 160, torch.float32, "cpu", scheme=scheme)
    slots = KVCache(1, 2, 3, 64, 160, torch.float32, "cpu", scheme=scheme)
    for _ in range(2):
        slots.add_sequence()
    pos = 0
    for size in [50, 1, 30, 40, 1, 3, 25]:  # chunks across block boundaries, decode steps
        lockstep.update(0, pos, k[:, :, pos:pos + size], v[:, :, pos:pos + size])
        for s in range(2):
            slots.write_sequence(0, s, pos, k[s, :, pos:pos + size], v[s, :, pos:pos + size])
            slots.advance(s, size)
        pos += size
    keys, values = lockstep.read(0, 150)
    for b in range(2):  # blocks 0..127 quantized on their own; 128..149 exact
        span = slice(64 * b, 64 * (b + 1))
        assert torch.equal(keys[:, :, span], fake_quantize_kv(k[:, :, span], scheme, True))
        assert torch.equal(values[:, :, span], fake_quantize_kv(v[:, :, span], scheme, False))
    assert torch.equal(keys[:, :, 128:], k[:, :, 128:]) and torch.equal(values[:, :, 128:], v[:, :, 128:])
    layer = slots.pool.layer(0)
    assert layer[0].scale.shape[-2:] == layout(scheme, 64, torch.float32, True)["scale"][0]
    nbytes = KVCache(3, 2, 2, 64, 1024, torch.float16, "cpu", scheme=scheme)
    residual = 2 * 3 * 2 * 2 * scheme.residual * 64 * 2
    assert nbytes.nbytes() == bytes_per_token(scheme, 3, 2, 64) * 2 * 1024 + residual + nbytes.block_table.numel() * 4


def test_a_model_decodes_through_a_split_cache_between_its_two_widths():
    """A tiny model's logits through k8v4 sit between int8's and int4's distance from fp16's."""
    from runtime.model import Decoder, DecoderConfig

    cfg = DecoderConfig.from_hf(dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    torch.manual_seed(0)
    model = Decoder(cfg).eval()
    ids = torch.randint(0, 64, (1, 48), generator=torch.Generator().manual_seed(3))

    def logits(name):
        cache = LockstepCache(2, 1, 2, cfg.head_dim, 64, torch.float32, "cpu", scheme=parse_kv(name))
        with torch.inference_mode():
            return torch.cat([model(ids[:, :32], cache, 0)] + [model(ids[:, p:p + 1], cache, p) for p in range(32, 48)], 1)

    base = logits("fp16-r16")
    gap = {n: rel_err(logits(f"{n}-g16-r16"), base) for n in ("int8", "k8v4", "int4")}
    assert 0 < gap["int8"] < gap["k8v4"] < gap["int4"]


def test_a_family_without_kernels_takes_another_backend_and_says_why():
    """The Triton backend refuses a family that declares no kernel: an engine of a model that runs
    the kernels warns and takes the next backend of the priority list; asked for by name, an error."""
    from runtime.attention import engine_attention
    from runtime.kernels.paged import unsupported_reason
    from runtime.model import Decoder, DecoderConfig

    scheme = parse_kv("k8v4")
    assert unsupported_reason(scheme, 64, torch.float16) == "the kv-split family (it declares no Triton kernel)"
    assert unsupported_reason(parse_kv("int4"), 64, torch.float16) is None
    decoder = Decoder(DecoderConfig.from_hf(dict(model_type="llama", vocab_size=64, hidden_size=128,
                                                 intermediate_size=128, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=1)))
    decoder.attention_kernels = True  # the model runs the kernels (here in the interpreter)
    with pytest.warns(UserWarning, match="k8v4-g64-r128: no attention kernel for the kv-split family"):
        choice = engine_attention(decoder, scheme, torch.float16, "cpu")
    assert choice.name == "cpu-folded" and choice.rejected[0].name == "triton"
    with pytest.raises(ValueError, match="Triton attention kernels do not support the kv-split family"):
        engine_attention(decoder, scheme, torch.float16, "cpu", attention="triton")


# ------------------------------------------- a family added by one declaration


class PerTokenInt4(IntegerFamily):
    """What the registry was built for: a per-token INT4 cache, which KVScheme could not express
    when KIVI was inferred from the bit width."""

    name, summary, pattern, listed, order, grouped = "pt", "INT4 per token", r"pt(?P<bits>4)", ("pt4",), 25, True

    def settings(self, match):
        return {"bits": int(match["bits"])}

    def base_name(self, scheme):
        return f"pt{scheme.bits}"

    def grids(self, scheme):
        grid = IntGrid(scheme.bits, scheme.group_size)
        return grid, grid


@pytest.fixture
def with_per_token_int4(monkeypatch):
    monkeypatch.setattr(schemes, "REGISTRY", dict(schemes.REGISTRY))
    monkeypatch.setattr(schemes, "_PATTERNS", dict(schemes._PATTERNS))
    return schemes.register(PerTokenInt4())


def test_a_new_family_is_one_declaration_away_from_every_user(with_per_token_int4):
    from evals import diagnose

    scheme = parse_kv("pt4-g32-r64")
    assert scheme == KVScheme(bits=4, family="pt", group_size=32, residual=64) and scheme.name == "pt4-g32-r64"
    assert "int2, pt4, fp8" in schemes.names_text()  # listed in its order
    x = offset_keys(1, 2, tokens=64)
    assert torch.equal(fake_quantize_kv(x, scheme, False), fake_quantize_kv(x, parse_kv("int4-g32-r64"), False))
    cache = LockstepCache(1, 1, 2, 64, 100, torch.float32, "cpu", scheme=scheme)
    cache.update(0, 0, x, x)
    stored_keys = cache.read(0, 64)[0]
    assert torch.equal(stored_keys, fake_quantize_kv(x, parse_kv("int4-g32-r64"), False))  # per token, not KIVI's
    cfg = type("Cfg", (), {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64})()
    assert "pt4 0.28x" in diagnose._kv_ratios(type("M", (), {"decoder": type("D", (), {"cfg": cfg})()})())


# ------------------------------------------------- every list a user sees


def test_the_planner_diagnose_and_every_kv_help_list_the_split_family():
    from evals import diagnose, planner
    from lowbit.cli import main

    assert {"k8v4", "k4v2"} <= set(planner.DEFAULT_SCHEMES)
    cfg = type("Cfg", (), {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64})()
    ratios = diagnose._kv_ratios(type("M", (), {"decoder": type("D", (), {"cfg": cfg})()})())
    assert ratios == "int8 0.53x, int4 0.28x, int2 0.16x, fp8 0.50x, k8v4 0.41x, k4v2 0.22x"
    runner = CliRunner()
    commands = [c for c, cmd in main.commands.items() if any("--kv" in p.opts for p in cmd.params)]
    assert sorted(commands) == ["diagnose", "doctor", "eval", "generate", "plan", "serve", "speed"]
    for command in commands:
        text = " ".join(runner.invoke(main, [command, "--help"], terminal_width=1000).output.split())
        assert "k8v4" in text and "k4v2" in text, command


def test_a_recipe_stores_a_split_scheme_and_reads_it_back():
    from lowbit.recipe import RecipeError
    from lowbit.recipe_parse import parse_recipe

    base = {"model": "m", "weights": {"bits": 4}}
    recipe = parse_recipe({**base, "kv_cache": {"bits": 8, "value_bits": 4, "group_size": 32}})
    assert recipe.kv_cache == parse_kv("k8v4-g32")
    assert parse_recipe({**base, "kv_cache": parse_kv("k4v2").to_dict()}).kv_cache == parse_kv("k4v2")
    with pytest.raises(RecipeError, match="kv_cache.family.*must be one of fp16, int8, kivi, fp8, kv-split"):
        parse_recipe({**base, "kv_cache": {"family": "kiwi"}})
