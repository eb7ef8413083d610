"""The serving engine: continuous batching gives each request what the plain runtime gives it alone.

Tiny random Llama models on the CPU reference path (tests/engine_setup.py): the cache's sequences,
batching, joins, a full cache, preemption, seeds and chunked prefill. Streaming, stops and bad
input: tests/test_engine_requests.py; the Triton kernels and a decode step's cost:
tests/test_engine_kernels.py.
"""

import pytest
import torch

import runtime
from kvquant import parse_kv
from runtime.cache import KVCache
from runtime.cache_lockstep import LockstepCache
from runtime.engine import Engine
from runtime.sampling import SamplingParams
from tiny import save_model, tiny_tokenizer
from engine_setup import FP16, INT4, greedy, model_dir, models, plain, prompts  # noqa: F401 (fixtures)


# ----------------------------------------------------------------------------- the cache


def test_cache_sequences_have_their_own_lengths_and_blocks():
    scheme = parse_kv(INT4)
    cache = KVCache(2, 3, 2, 16, 64, torch.float32, "cpu", scheme=scheme, num_blocks=4)
    together = LockstepCache(2, 1, 2, 16, 64, torch.float32, "cpu", scheme=scheme)
    k, v = torch.randn(2, 2, 37, 16), torch.randn(2, 2, 37, 16)
    a, b = cache.add_sequence(), cache.add_sequence()
    assert cache.reserve(a, 37) and cache.free_blocks == 2  # 37 positions fill two blocks of 16
    for lo, hi in ((0, 20), (20, 37)):  # two writes per layer, then the length moves on
        for layer in range(2):
            cache.write_sequence(layer, a, lo, k[layer, :, lo:hi], v[layer, :, lo:hi])
            together.update(layer, lo, k[None, layer, :, lo:hi], v[None, layer, :, lo:hi])
        cache.advance(a, hi - lo)
    cache.write_sequence(0, b, 0, k[0, :, :3], v[0, :, :3])  # another length in the same cache
    for layer in range(2):
        got, want = cache.read_sequence(layer, a, 37), together.read(layer, 37)
        assert torch.equal(got[0], want[0][0]) and torch.equal(got[1], want[1][0])
    assert cache.seq_lengths[:2] == [37, 0]
    with pytest.raises(ValueError, match="holds 37 positions"):
        cache.write_sequence(0, a, 30, k[0, :, :1], v[0, :, :1])
    assert not cache.reserve(b, 64) and cache.free_blocks == 2  # 4 blocks needed, 2 free: nothing taken
    cache.swap_sequences(a, 2)  # a's sequence moves to row 2, row a is free again
    assert torch.equal(cache.read_sequence(1, 2, 37)[0], together.read(1, 37)[0][0])
    assert cache.free_slot_ids == [a] and cache.seq_lengths[2] == 37
    cache.free_sequence(2)
    assert cache.free_blocks == 4 and (cache.block_table[2] == -1).all()
    with pytest.raises(ValueError, match="holds no sequence"):
        cache.read_sequence(0, 2, 1)


# ----------------------------------------------------------------------------- batching


@pytest.mark.parametrize("kv", [FP16, INT4])
def test_batched_greedy_equals_each_request_alone(models, prompts, kv):
    """The key property: batched with others of different lengths, joining as slots free up, each
    request's greedy tokens are the plain runtime's (the quantized cache included)."""
    model = models[kv]
    lengths = [12, 7, 10, 5, 9]  # they leave at different steps, and later ones join
    engine = Engine(model, max_batch=3, max_len=64)
    requests = engine.generate(prompts, [greedy(n) for n in lengths])
    assert [r.output_ids for r in requests] == [plain(model, p, n) for p, n in zip(prompts, lengths)]
    assert all(r.finish_reason == "length" for r in requests)
    stats = engine.stats()
    assert stats["decode_steps"] < sum(lengths) - len(lengths)  # sequences really shared decode steps
    assert engine.cache.free_slots == 3 and engine.cache.free_blocks == engine.cache.num_blocks  # all left


def test_requests_join_between_steps_and_leave_when_done(models, prompts):
    model = models[FP16]
    engine = Engine(model, max_batch=4, max_len=64)
    first = engine.submit(prompts[0], greedy(4))
    second = engine.submit(prompts[1], greedy(10))
    for _ in range(2):
        engine.step()
    assert len(first.output_ids) == len(second.output_ids) == 2 and not first.finished
    late = engine.submit(prompts[2], greedy(6))  # arrives while the others decode
    engine.step()
    assert late in engine.running and len(engine.running) == 3
    while not first.finished:
        engine.step()
    assert first not in engine.running and first.slot is None and not second.finished
    engine.run()
    for r, n in ((first, 4), (second, 10), (late, 6)):
        assert r.output_ids == plain(model, r.prompt_ids, n)


def test_full_cache_makes_requests_wait(models, prompts):
    model = models[FP16]
    probe = Engine(model, max_batch=2, max_len=64)
    # two slots, but pool blocks for one request at a time (34 + 8 tokens: 2 blocks, 1 spare)
    budget = 2 * probe.cache.slot_bytes() + 3 * probe.cache.block_bytes()
    engine = Engine(model, max_batch=2, max_len=64, kv_memory=budget)
    assert engine.cache.num_blocks == 3
    a, b = engine.submit(prompts[3], greedy(8)), engine.submit(prompts[1], greedy(8))
    engine.step()
    assert a in engine.running and list(engine.waiting) == [b]  # b waits: its blocks are not free
    engine.run()
    assert a.output_ids == plain(model, prompts[3], 8) and b.output_ids == plain(model, prompts[1], 8)


def test_the_kv_scheme_sets_how_many_sequences_fit_a_budget(models):
    engines = {kv: Engine(models[FP16], max_batch=64, max_len=64, kv_memory="2MB", kv=kv) for kv in (FP16, INT4)}
    for e in engines.values():  # what is allocated is what the budget says (the block table aside)
        assert 2_000_000 - e.cache.block_bytes() < e.cache.nbytes() - e.cache.block_table.numel() * 4 <= 2_000_000
    fp16, int4 = engines[FP16], engines[INT4]
    assert int4.cache.num_blocks > 3 * fp16.cache.num_blocks
    assert fp16.sequences_at(64) < int4.sequences_at(64) == 64
    assert int4.stats()["sequences_at_max_len"] == 64


@pytest.mark.parametrize("sampled", [False, True])
def test_preemption_recomputes_and_gives_the_same_tokens(models, prompts, sampled):
    """A pool too small for every running sequence to grow: the newest is preempted and later
    recomputes its cache; outputs (seeded sampling too) do not change."""
    model = models[FP16]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0 if sampled else 0.0, seed=i)
              for i in range(3)]
    roomy = Engine(model, max_batch=3, max_len=64)
    want = [r.output_ids for r in roomy.generate(prompts[:3], params)]
    budget = 3 * roomy.cache.slot_bytes() + 4 * roomy.cache.block_bytes()  # 5 needed to finish all three
    tight = Engine(model, max_batch=3, max_len=64, kv_memory=budget)
    requests = tight.generate(prompts[:3], params)
    assert tight.stats()["preemptions"] > 0 and sum(r.metrics.preemptions for r in requests) > 0
    assert [r.output_ids for r in requests] == want
    if not sampled:
        assert want == [plain(model, p, 24) for p in prompts[:3]]


def test_int4_output_does_not_depend_on_preemption_or_where_chunks_fall(models, prompts):
    """A quantized cache: a later prefill chunk reads earlier ones through the quantizer, so the
    chunks are cut at multiples of prefill_chunk whatever else runs, and a preempted request
    replays its outputs through decode steps (each token reads what it read the first time)
    instead of prefilling them. So the engine gives model.generate's tokens at the same chunking,
    under preemption and joins; a prompt within one chunk gives the one-forward generate's."""
    model = models[INT4]
    lengths = (28,) * 5
    probe = Engine(model, max_batch=3, max_len=64).cache
    budget = 3 * probe.slot_bytes() + 3 * probe.block_bytes()  # 3 blocks for up to 3 growing sequences
    tight = Engine(model, max_batch=3, max_len=64, kv_memory=budget, prefill_chunk=16)
    requests = tight.generate(prompts, [greedy(n) for n in lengths])  # 34 tokens: chunks at 0, 16, 32
    assert tight.stats()["preemptions"] >= 3
    assert [r.output_ids for r in requests] == [plain(model, p, n, prefill_chunk=16) for p, n in zip(prompts, lengths)]
    for p, n, r in zip(prompts, lengths, requests):
        if len(p) <= 16:
            assert r.output_ids == plain(model, p, n)


def test_seeds_reproduce_sampled_output_in_any_batch(models, prompts):
    model = models[FP16]
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = Engine(model, max_batch=1, max_len=64).generate([prompts[0]], params)[0].output_ids
    engine = Engine(model, max_batch=4, max_len=64)
    others = [engine.submit(p, SamplingParams(max_tokens=6, temperature=0.8, seed=i))
              for i, p in enumerate(prompts[1:])]
    batched = engine.submit(prompts[0], params)
    other_seed = engine.submit(prompts[0], SamplingParams(**{**params.__dict__, "seed": 8}))
    engine.run()
    assert batched.output_ids == alone != other_seed.output_ids
    assert all(r.finished for r in others)
    # top_k=1 keeps only the best token: sampling becomes greedy
    top1 = Engine(model, max_len=64).generate([prompts[0]], SamplingParams(max_tokens=10, temperature=2.0, top_k=1,
                                                                            seed=3, ignore_eos=True))[0]
    assert top1.output_ids == plain(model, prompts[0], 10)


def test_chunked_prefill_of_a_long_prompt(models, prompts):
    model = models[FP16]
    long_prompt = prompts[3] + prompts[1]  # 55 tokens, prefilled 16 per step
    engine = Engine(model, max_len=80, prefill_chunk=16)
    decoding = engine.submit(prompts[0], greedy(8))
    engine.step()
    long = engine.submit(long_prompt, greedy(6))
    steps_with_both = 0
    while not long.output_ids:
        before = len(decoding.output_ids)
        engine.step()
        steps_with_both += len(decoding.output_ids) > before
    assert engine.stats()["prefill_tokens"] == len(prompts[0]) + len(long_prompt)
    assert steps_with_both >= 3  # the running request kept decoding while the long prompt came in
    engine.run()
    assert long.output_ids == plain(model, long_prompt, 6) and decoding.output_ids == plain(model, prompts[0], 8)


def test_sliding_window_model_through_the_engine(tmp_path, prompts):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    tok = tiny_tokenizer()
    config = MistralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                           sliding_window=8, initializer_range=0.3, eos_token_id=tok.eos_token_id)
    model = runtime.load(save_model(MistralForCausalLM(config).eval(), tok, tmp_path / "m"), kv=FP16)
    requests = Engine(model, max_batch=3, max_len=64).generate(prompts[:3], greedy(10))
    assert [r.output_ids for r in requests] == [plain(model, p, 10) for p in prompts[:3]]
