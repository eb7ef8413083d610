"""Sliding-window rings in the paged KV cache: a sliding layer holds only the blocks of its window,
attention does not change, and the planner, the engine's budget and the allocated cache agree.

The attention tests run a tiny decoder twice over one token history, on a cache that keeps
rings (the model's windows) and on one that keeps every position (no windows given), for every
KV scheme: the window masks the dropped positions, so the logits must be the same.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are built (tests/conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvquant import parse_kv  # noqa: E402
from kvquant.memory import layer_groups, residual_bytes, ring_blocks, sequence_bytes  # noqa: E402
from runtime.cache import KVCache  # noqa: E402
from runtime.cache_lockstep import LockstepCache  # noqa: E402

SCHEMES = ["fp16-r16", "int8-r16", "int4-g16-r16", "int2-g16-r16", "fp8-r16"]
WINDOW = 12  # smaller than the 40-token history, not a multiple of the 16-token block


def tiny_decoder(windows_per_layer=None):
    """A 3-layer Mistral decoder (head_dim 16, every layer sliding), or a Qwen2 one whose layers
    slide as ``windows_per_layer`` says (a Gemma-like mix of sliding and full layers)."""
    from runtime.model import Decoder, DecoderConfig

    family = dict(model_type="mistral")
    if windows_per_layer is not None:  # Qwen2 reads its windows from layer_types
        types = ["full_attention" if w is None else "sliding_attention" for w in windows_per_layer]
        family = dict(model_type="qwen2", layer_types=types)
    cfg = DecoderConfig.from_hf(dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW, **family))
    torch.manual_seed(0)
    return Decoder(cfg).eval()


def run_history(model, cache, ids, chunks):
    """Logits of the prefill, the chunks after it, then one token at a time."""
    out, pos = [], 0
    with torch.inference_mode():
        for T in chunks:
            out.append(model(ids[:, pos:pos + T], cache, pos))
            pos += T
        for pos in range(pos, ids.shape[1]):
            out.append(model(ids[:, pos:pos + 1], cache, pos))
    return torch.cat(out, dim=1)


def ring_and_uncapped(model, scheme, max_len):
    cfg = model.cfg
    shape = (cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim, max_len, torch.float32, "cpu")
    return LockstepCache(*shape, scheme=scheme, windows=cfg.sliding_windows), LockstepCache(*shape, scheme=scheme)


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("mix", [False, True], ids=["mistral", "local-global"])
def test_rings_attend_exactly_as_the_uncapped_cache(name, mix):
    model = tiny_decoder((WINDOW, None, WINDOW) if mix else None)
    scheme = parse_kv(name)
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    ring, uncapped = ring_and_uncapped(model, scheme, 64)
    got = run_history(model, ring, ids, (20, 13))
    want = run_history(model, uncapped, ids, (20, 13))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # at 40 positions, each sliding group holds its ring of ceil(12 / 16) = 1 block per sequence; full ones 2
    groups = ring.groups
    expected = sum(2 if w is None else ring_blocks(w, 16) for w in groups.windows)
    assert ring.pages_held() == 2 * expected
    layer_blocks = lambda c: c.pages_held() * c.groups.size  # noqa: E731 (pages differ in size)
    assert layer_blocks(ring) < layer_blocks(uncapped) == 2 * 2 * 3
    if mix:  # two sliding layers and one full one: groups of one layer each, one page size
        assert groups.windows == (WINDOW, None, WINDOW) and groups.size == 1


@pytest.mark.parametrize("name", ["int4-g16-r16", "int8-r16"])
def test_rings_through_the_attention_kernels(name):
    """The Triton kernels (interpreter on CPU) read a ringed cache: the decode kernel never reads
    before the window, the dense copy for a chunk after cached positions reads dropped blocks as 0,
    the writer skips blocks already out of the window when the write ends."""
    model = tiny_decoder((WINDOW, None, WINDOW))
    model.attention_kernels = True
    scheme = parse_kv(name)
    ids = torch.randint(0, 64, (2, 44), generator=torch.Generator().manual_seed(2))
    ring, uncapped = ring_and_uncapped(model, scheme, 48)
    got = run_history(model, ring, ids, (20, 17))  # the chunk ends past a whole dropped block
    want = run_history(model, uncapped, ids, (20, 17))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # 44 positions: the full layer's 2 blocks; a sliding layer's window (32..43) lies in its residual block
    assert ring.pages_held() == 2 * 2


def test_dequantize_kernel_reads_a_dropped_block_as_zero():
    from runtime.kernels import attention as kernels
    from runtime.kernels import kv_reference as ref

    cache = LockstepCache(1, 2, 2, 16, 64, torch.float16, "cpu", scheme=parse_kv("int4-g16-r16"), windows=(WINDOW,))
    k, v = torch.randn(2, 2, 40, 16).half(), torch.randn(2, 2, 40, 16).half()
    end = cache.prepare_write(0, 0, k, v)
    ref.write_kv(ref.PagedKV.from_cache(cache, 0), torch.zeros(2, dtype=torch.int32), k, v)
    cache.finish_write(0, end)
    paged = ref.PagedKV.from_cache(cache, 0)
    assert paged.block_table[:, 0].tolist() == [-1, -1]  # positions 0..15: out of the window at 40, never placed
    lens = torch.tensor([40, 40], dtype=torch.int32)
    want = ref.dequantize_cache(paged, lens, 40)
    got = kernels.dequantize_cache(paged, lens, 40)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    first = 40 - WINDOW + 1
    assert not want[0][:, :, :first].any() and want[0][:, :, first:].abs().sum(-1).gt(0).all()


def test_a_growing_sequence_keeps_its_ring_and_the_planner_counts_it():
    """The engine's path (reserve at each block boundary, advance): a sliding group holds
    ceil(W / B) pages once past its window, a full one all its blocks, and the bytes held are
    what kvquant.memory.sequence_bytes (the planner's and the budget's count) says."""
    scheme = parse_kv("int4-g16-r16")
    windows = (40, 40, None, 40, 40, None)  # 4 local : 2 global -> groups of 2 layers
    cache = KVCache(6, 2, 1, 16, 512, torch.float16, "cpu", scheme=scheme, windows=windows)
    assert cache.groups.size == 2 and cache.groups.windows == (40, None, 40)
    slot = cache.add_sequence()
    for pos in range(400):
        if (pos + 1) % 16 == 0:
            assert cache.reserve(slot, pos + 1)
        cache.advance(slot, 1)
        held = cache.pages_held()
        assert held == cache.pages_for(pos + 1)
        tokens = pos + 1
        if tokens % 16 == 0:  # whole blocks: the planner's ceil and the cache's fill agree
            counted = sequence_bytes(scheme, 6, 1, 16, tokens, torch.float16, windows)
            assert held * cache.block_bytes() == counted - residual_bytes(scheme, 6, 1, 16, torch.float16)
    assert cache.pages_held() == 25 + 2 * ring_blocks(40, 16)  # 400 positions: 25 full blocks, two rings of 3


def test_layer_groups():
    gemma = tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(62))  # 5 local : 1 global, 62 layers
    g = layer_groups(gemma, max_len=32768)
    assert g.size == 2 and len(g.layers) == 31 and g.windows.count(None) == 5
    assert layer_groups((4096,) * 32, max_len=32768).windows == (4096,)
    assert layer_groups((4096,) * 32, max_len=4096).windows == (None,)  # the window covers max_len: nothing drops
    with pytest.raises(ValueError, match="positive number"):
        layer_groups((0, None))


def test_default_cpu_budget_is_capped_and_an_impossible_one_is_named(monkeypatch):
    from runtime import cache_budget

    class Model:  # what cache_size reads
        decoder = tiny_decoder((None, None, None))
        dtype, device = torch.float16, torch.device("cpu")

    real_cap, source = cache_budget.default_budget(torch.device("cpu"))
    assert 0 < real_cap and "available memory" in source  # psutil is a test dependency
    scheme = parse_kv("fp16-r16")
    monkeypatch.setattr(cache_budget, "default_budget", lambda device: (10**6, "a test cap"))
    budget, pages = cache_budget.cache_size(Model, scheme, None, 4, 64)
    assert budget <= 10**6 and pages >= 1
    with pytest.raises(ValueError, match="a test cap.*cannot hold one sequence of max_len 100,000"):
        cache_budget.cache_size(Model, scheme, None, 4, 100_000)


def test_the_engine_keeps_rings_and_decodes_as_the_uncapped_cache(tmp_path, monkeypatch):
    """A sliding-window model (Mistral, window 8) through the engine on a quantized cache: its greedy
    tokens equal ``Model.generate`` on a cache that keeps every position, and once decoding, each
    sequence holds at most its ring (one 16-token block; none when the window lies in the residual
    block), never its whole history."""
    import runtime
    from runtime.cache import KVCache as Cache
    from runtime.engine import Engine
    from runtime.load import Model
    from runtime.sampling import SamplingParams
    from tiny import save_model, tiny_model

    model = runtime.load(save_model(*tiny_model("mistral-sliding"), tmp_path / "m"), kv="int4-g16-r16")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 150, (n,), generator=g).tolist() for n in (21, 5, 34)]
    engine = Engine(model, max_batch=3, max_len=64, prefill_chunk=16)
    requests = [engine.submit(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in prompts]
    most = 0
    while engine.has_work():
        engine.step()
        decoding = [r for r in engine.running if r.slot is not None and r.slot < engine.decoding]
        for r in decoding:
            if r.computed >= 32:  # two whole blocks of history, and decoding
                held = sum(b >= 0 for b in engine.cache.host_table[r.slot])
                assert held <= ring_blocks(8, 16), (r.computed, engine.cache.host_table[r.slot])
                most = max(most, r.computed)
    assert most >= 40  # the check ran on long sequences

    def uncapped(self, max_len, batch=1, scheme=None, lockstep=True):  # Model.generate on a cache with no rings
        assert not lockstep  # Model.generate runs the engine's steps on a cache of slots
        cfg = self.decoder.cfg
        return Cache(cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, max_len, self.dtype, self.device,
                     scheme=scheme or self.kv_scheme)

    monkeypatch.setattr(Model, "new_cache", uncapped)
    for r, p in zip(requests, prompts):
        want = [t.id for t in model.generate(p, max_new_tokens=24, stop_at_eos=False)]
        assert r.output_ids == want


def test_plan_counts_rings_per_layer_type(tmp_path):
    """``lowbit plan`` on a Gemma-3-shaped config (no weights): local layers at their ring, global
    ones at the whole context, the factor the rings save, and more sequences for it."""
    import json

    from evals import planner

    config = {"model_type": "gemma3_text", "num_hidden_layers": 12, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 128, "hidden_size": 1024, "intermediate_size": 4096,
              "vocab_size": 1000, "sliding_window": 512, "max_position_embeddings": 32768,
              "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(12)]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    p = planner.plan(str(tmp_path), 40 * 10**9, 16384, ["int4"])
    row = p["schemes"][0]
    assert p["attention"]["layer_types"] == [{"window": None, "layers": 2}, {"window": 512, "layers": 10}]
    full, local = row["layer_types"]
    assert full["blocks_per_layer"] == 128 and local["blocks_per_layer"] == 4  # 16,384 / 128; 512 / 128
    scheme = parse_kv("int4")
    windows = planner.sliding_windows(config, 12)
    assert row["bytes_per_sequence"] == sequence_bytes(scheme, 12, 4, 128, 16384, torch.float16, windows)
    assert row["bytes_per_sequence_without_rings"] == sequence_bytes(scheme, 12, 4, 128, 16384, torch.float16)
    assert row["ring_factor"] == pytest.approx(row["bytes_per_sequence_without_rings"] / row["bytes_per_sequence"])
    assert 4 < row["ring_factor"] < 6 and row["max_sequences"] > 4 * row["max_sequences_without_rings"]
    assert "rings save" in planner.plan_text(p)
