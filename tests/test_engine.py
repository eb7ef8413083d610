"""The serving engine: continuous batching gives each request what the plain runtime gives it alone.

Tiny random Llama models on the CPU reference path; one test runs the Triton attention kernels
in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU).
"""

import pytest
import torch

import runtime
from kvquant import parse_kv
from runtime.cache import KVCache
from runtime.cache_lockstep import LockstepCache
from runtime.engine import Engine, EngineClosedError
from runtime.attention import kernels_for
from runtime.units import parse_bytes
from runtime.generate import TextStream
from runtime.sampling import SamplingParams, sample
from tiny import save_model, tiny_llama, tiny_tokenizer

FP16 = "fp16-r16"  # blocks of 16 tokens: short prompts already fill and page blocks
INT4 = "int4-g16-r16"
LENGTHS = (5, 21, 9, 34, 14)  # prompts of different lengths, several crossing block boundaries


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # initializer_range 0.3: outputs that change with the context (HF's 0.02 repeats one token),
    # so a request that attended to the wrong sequence or position would show
    model, tok = tiny_llama(hidden=64, layers=2, initializer_range=0.3)  # head_dim 16: the kernels take it
    return save_model(model, tok, tmp_path_factory.mktemp("engine") / "m")


@pytest.fixture(scope="module")
def models(model_dir):
    return {kv: runtime.load(model_dir, kv=kv) for kv in (FP16, INT4)}


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 150, (n,), generator=g).tolist() for n in LENGTHS]


_plain_cache = {}


def plain(model, prompt, n, **kwargs):
    """The plain runtime's tokens for one request alone (memoized: the reference is slow on 2 cores)."""
    key = (id(model), tuple(prompt), n, tuple(sorted(kwargs.items())))
    if key not in _plain_cache:
        _plain_cache[key] = [t.id for t in model.generate(prompt, max_new_tokens=n, stop_at_eos=False, **kwargs)]
    return _plain_cache[key]


def greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


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


# ----------------------------------------------------------------------- streaming, stops, metrics


def test_streaming_drives_the_engine_and_metrics_are_sane(models, prompts):
    model = models[FP16]
    engine = Engine(model, max_batch=4, max_len=64)
    a, b = engine.submit(prompts[0], greedy(8)), engine.submit(model.tokenizer.decode(prompts[2]), greedy(5))
    assert b.prompt_ids == model.tokenizer(model.tokenizer.decode(prompts[2])).input_ids  # text prompts too
    streamed = list(a)  # iterating a alone runs the engine: b advances too
    assert [t.id for t in streamed] == a.output_ids and b.finished and len(b.output_ids) == 5
    assert "".join(t.text for t in streamed) == a.text == model.tokenizer.decode(a.output_ids)
    assert [t.t for t in streamed] == sorted(t.t for t in streamed)
    m = a.metrics
    assert m.prompt_tokens == len(prompts[0]) and m.output_tokens == 8 and len(m.itl_s) == 7
    assert 0 < m.ttft_s <= m.e2e_s and all(x > 0 for x in m.itl_s)
    assert m.ttft_s + sum(m.itl_s) == pytest.approx(m.e2e_s, rel=1e-6, abs=1e-6)
    assert m.tokens_per_s == pytest.approx(8 / m.e2e_s) and m.decode_tokens_per_s > 0
    stats = engine.stats()
    assert stats["output_tokens"] == 13 and stats["finished"] == 2 and stats["preemptions"] == 0
    assert stats["throughput_tokens_per_s"] == pytest.approx(13 / stats["span_s"])
    assert stats["kv_scheme"] == "fp16" and stats["attention"] == "reference" and stats["cuda_graph_buckets"] == []
    assert set(a.metrics.to_dict()) >= {"ttft_s", "mean_itl_s", "tokens_per_s", "e2e_s"}


def test_stop_strings_and_stop_ids(models, prompts):
    model = models[FP16]
    full_ids = plain(model, prompts[1], 12)
    text = model.tokenizer.decode(full_ids)
    stop = text[len(text) // 2: len(text) // 2 + 2]  # two characters from the middle of the output
    assert stop.strip(), text
    engine = Engine(model, max_len=64)
    r = engine.submit(prompts[1], SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True))
    pieces = [t.text for t in r]
    assert r.finish_reason == "stop" and r.text == text[: text.index(stop)] == "".join(pieces)
    assert r.output_ids == full_ids[: len(r.output_ids)]
    by_id = engine.submit(prompts[1], SamplingParams(max_tokens=12, stop_token_ids=[full_ids[4]], ignore_eos=True))
    by_id.result()
    assert by_id.finish_reason == "stop" and by_id.output_ids == full_ids[: full_ids.index(full_ids[4])]
    model.eos_token_ids, saved = [full_ids[3]], model.eos_token_ids
    try:  # the model's EOS ends a request unless ignore_eos
        assert engine.submit(prompts[1], max_tokens=12).result().output_ids == full_ids[: full_ids.index(full_ids[3])]
    finally:
        model.eos_token_ids = saved


def test_text_stream_holds_back_a_stop_string_split_over_tokens():
    tok = tiny_tokenizer()
    ids = tok("Anne Elliot walked").input_ids
    stream = TextStream(tok, stop=("Elliot",))
    out = "".join(stream.push(ids[: i + 1], done=i == len(ids) - 1) for i in range(len(ids)) if not stream.stopped)
    assert out == "Anne " and stream.stopped


# ----------------------------------------------------------------------------- kernels


def test_triton_attention_kernels_through_the_engine(models, model_dir, prompts):
    """The GPU path, run in the Triton interpreter: quantize-on-write and decode attention over
    sequences of different lengths in one launch, and the fused small ops (add + RMSNorm, RoPE,
    SiLU-and-multiply); prompts shorter than a block, so the plain CPU path (which prefills
    through the quantizer) computes the same thing."""
    model = runtime.load(model_dir, kv=INT4)
    model.decoder.use_kernels(True)
    short = [p[:n] for p, n in zip(prompts, (5, 12, 9))]
    engine = Engine(model, max_batch=3, max_len=32, attention="triton")
    requests = engine.generate(short, greedy(14))  # 12 + 14 crosses a block: one is quantized
    assert engine.stats()["attention"] == "triton"
    assert [r.output_ids for r in requests] == [plain(models[INT4], p, 14) for p in short]


def test_chunked_prefill_through_the_kernels(model_dir, prompts):
    """Later chunks read the earlier ones back through the dequantize kernel (fp16 blocks: the
    same values the plain runtime's one-shot prefill attends to)."""
    model = runtime.load(model_dir, kv=FP16)
    engine = Engine(model, max_batch=2, max_len=48, prefill_chunk=16, attention="triton")
    requests = engine.generate([prompts[3], prompts[0]], greedy(6))  # 34 tokens: chunks at 0, 16, 32
    assert [r.output_ids for r in requests] == [plain(model, p, 6) for p in (prompts[3], prompts[0])]


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


def test_padded_decode_buckets_as_the_cuda_graphs_run_them(models, prompts):
    """The CUDA-graph decode step, run eagerly (no GPU here to capture it): static inputs for a
    bucket of rows, padding rows that write into free slots, the kernels' lengths bounded by the
    block table instead of the batch. Three sequences use the bucket of 4; prefilling sequences
    sit in high rows, so padding never touches them."""
    from runtime.execution import DecodeGraph, DecodeGraphs

    model = models[INT4]
    short = [p[:n] for p, n in zip(prompts, (5, 12, 9))]
    engine = Engine(model, max_batch=6, max_len=32, attention="triton")
    engine.executor.graphs = DecodeGraphs(model.decoder, engine.cache, capture=False, buckets=(2, 4))
    used, run = [], DecodeGraph.run

    def counted(self, tokens, starts):
        used.append((self.batch, self.fills))  # the bucket, and whether it writes filled blocks
        assert self.fills == any((s + 1) % engine.cache.block_size == 0 for s in starts)
        return run(self, tokens, starts)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(DecodeGraph, "run", counted)
        requests = engine.generate(short, [greedy(n) for n in (8, 5, 3)])  # 3, then 2, then 1 decoding
    assert {b for b, _ in used} == {2, 4} and len(used) == engine.stats()["decode_steps"]
    assert {f for _, f in used} == {False, True}  # 12 + 8 tokens: a block fills on one step
    assert [r.output_ids for r in requests] == [plain(model, p, n) for p, n in zip(short, (8, 5, 3))]


def test_a_scheme_without_kernels_falls_back_with_a_warning_or_fails_clearly(models):
    odd = parse_kv("int4-g8-r24")  # block 24: the kernels take powers of two
    with pytest.warns(UserWarning, match="reference"):
        assert kernels_for(odd, 64, torch.float16, torch.device("cuda")) is False
    with pytest.raises(ValueError, match="do not support block size"):
        kernels_for(odd, 64, torch.float16, torch.device("cpu"), attention="triton")
    assert kernels_for(parse_kv("int4"), 64, torch.float16, torch.device("cpu")) is False  # CPU: the reference


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.2}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"seed": -3}, "seed"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"max_tokens": 2.5}, "max_tokens"),
])
def test_invalid_sampling_parameters_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_requests_and_a_shut_down_engine(models):
    model = models[FP16]
    engine = Engine(model, max_batch=2, max_len=64)
    with pytest.raises(ValueError, match="context"):
        engine.submit([5] * 65)
    with pytest.raises(ValueError, match="empty"):
        engine.submit([])
    with pytest.raises(ValueError, match="vocabulary"):
        engine.submit([10**6])
    with pytest.raises(ValueError, match="temperature"):
        engine.submit([5, 6], temperature=-1)
    probe = Engine(model, max_batch=1, max_len=64).cache
    small = Engine(model, max_batch=1, max_len=64, kv_memory=probe.slot_bytes() + 2 * probe.block_bytes())
    with pytest.raises(ValueError, match="whole cache has"):  # could never fit, even alone: refused, not hung
        small.submit([5] * 60, max_tokens=4)
    with pytest.raises(ValueError, match="holds no cache block"):
        Engine(model, max_batch=2, kv_memory="1KB")
    with pytest.raises(ValueError, match="max_len"):
        Engine(model, max_len=10**6)
    with pytest.raises(ValueError, match="cuda_graphs"):  # CUDA only: refused on the CPU, not ignored
        Engine(model, max_len=64, cuda_graphs=True)
    running = engine.submit([5, 6, 7], max_tokens=30)
    engine.step()
    engine.shutdown()
    assert running.finish_reason == "abort" and len(list(running)) == 1  # what it had, then it ends
    with pytest.raises(EngineClosedError, match="shut down"):
        engine.submit([5, 6])
    with pytest.raises(EngineClosedError):
        engine.step()


def test_parse_bytes_and_sample_top_k():
    assert parse_bytes("2GB") == 2 * 10**9 and parse_bytes("1.5MiB") == 3 * 2**19 and parse_bytes(123) == 123
    with pytest.raises(ValueError, match="size in bytes"):
        parse_bytes("lots")
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    draws = {sample(logits, 5.0, 1.0, torch.Generator().manual_seed(s), top_k=2) for s in range(40)}
    assert draws == {1, 2}


# ----------------------------------------------------------------------------- lowbit bench


def test_bench_refuses_without_a_gpu_and_runs_its_smoke_mode(tmp_path):
    import json

    from click.testing import CliRunner

    from lowbit.cli import main

    runner = CliRunner()
    if not torch.cuda.is_available():
        refused = runner.invoke(main, ["bench"])
        assert refused.exit_code != 0 and "CUDA GPU" in refused.output and "--smoke" in refused.output
    bad = runner.invoke(main, ["bench", "--smoke", "--configs", "w3"])
    assert bad.exit_code != 0 and "w4g128" in bad.output
    out = tmp_path / "bench.json"
    run = runner.invoke(main, ["bench", "--smoke", "--configs", "w4g128+kv-int4", "--json", str(out)])
    assert run.exit_code == 0, run.output
    record = json.loads(out.read_text())
    assert record["smoke"] and record["model"]["weights"].startswith("random")
    assert record["provenance"]["device"]["type"] == "cpu" and record["provenance"]["commit"]
    engine, hf = record["engine"], record["transformers"]
    assert len(engine) == 2 * 2 + 1 and len(hf) == 2 * 2  # batches x prompt lengths (+ the arrivals run)
    assert {r["kv_scheme"] for r in engine} == {"int4-g16-r16"}
    for r in engine + hf:
        assert r["output_tokens"] == r.get("batch", r.get("requests")) * r["output_len"]
        assert r["output_tokens_per_s"] > 0 and r["ttft_s"]["mean"] > 0
    assert engine[-1]["mode"] == "continuous" and engine[-1]["requests"] == 4


# ----------------------------------------------------------------------------- the decode step's cost


def decoding_engine(model_dir, prompts, attention, steps_left=20):
    """A bf16 engine (the GPU's dtype, so casts count) whose three requests all decode."""
    model = runtime.load(model_dir, kv=INT4, dtype=torch.bfloat16)
    engine = Engine(model, max_batch=4, max_len=64, attention=attention)
    for p in prompts[:3]:  # 5, 21 and 9 tokens: the first and last cross into block 1 while decoding
        engine.submit(p, greedy(steps_left))
    while not engine.all_decoding:
        engine.step()
    return engine


@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_a_decode_step_reads_the_device_once_and_copies_inputs_once(model_dir, prompts, attention):
    """Counted with runtime.counting on CPU: the only host sync of a decode step is the read of
    the sampled tokens, the inputs go in with one copy, and a step where a sequence crosses into a
    new block adds one copy of its block-table row, never a read of the table. (The reference
    path's quantizer makes small constant tensors when a block fills: copies, not syncs.)"""
    from runtime.counting import decode_step_counts

    engine = decoding_engine(model_dir, prompts, attention)
    crossings = 0
    for _ in range(8):
        lengths = [r.computed for r in engine.scheduler.decoders()]
        crossing = any((n + 1) % engine.cache.block_size == 0 for n in lengths)
        counts = decode_step_counts(engine)
        assert counts["syncs"] == 1 and counts["ops"]["sync:tolist"] == 1, counts["ops"]
        if attention == "triton" or not crossing:
            assert counts["input_copies"] == 1 + crossing, (lengths, counts["ops"])
        crossings += crossing
    assert crossings >= 1


def test_a_decode_step_launches_9_kernels_per_layer_plus_the_block_write_when_one_fills(model_dir, prompts):
    """The CUDA path's launches, counted on CPU (ATen ops that run a kernel, plus Triton launches;
    a quantized GEMM counts as one, split-K adds a reduction): two add+RMSNorm, the q/k/v GEMM,
    RoPE writing k and v into the cache's residual blocks, decode attention (and its split combine
    when it splits), o_proj, the gate/up GEMM, SiLU-and-multiply, down_proj; the block write only
    on a step where some sequence fills a block (the host knows which)."""
    from runtime.counting import decode_step_counts

    engine = decoding_engine(model_dir, prompts, "triton")
    engine.model.decoder.use_kernels(True)
    seen = set()
    for _ in range(8):
        fills = any((r.computed + 1) % engine.cache.block_size == 0 for r in engine.scheduler.decoders())
        counts = decode_step_counts(engine)
        combine = counts["ops"].get("triton:_combine_kernel", 0) // counts["layers"]  # 0 or 1: splits or not
        assert counts["syncs"] == 1 and counts["launches_per_layer"] == [9 + fills + combine] * counts["layers"], counts
        assert counts["ops"]["triton:_add_rmsnorm_kernel"] == 2 * counts["layers"] + 1  # + the final norm
        assert "triton:_write_residual_kernel" not in counts["ops"]  # the RoPE launch wrote k and v
        assert counts["ops"].get("triton:_write_blocks_kernel", 0) == (counts["layers"] if fills else 0)
        seen.add(fills)
    assert seen == {False, True}


def test_every_gemm_m_bucket_is_tuned_before_the_first_request(monkeypatch):
    """On CUDA the engine asks quant_matmul's tuner for every M bucket a step can take at start-up
    (a GPU times the candidates then, not on a request): here the tuner is replaced by a recorder,
    and every M from 1 to the largest falls in a bucket that was asked."""
    from types import SimpleNamespace

    from quant.affine import QuantScheme
    from runtime.execution import warm_matmul_tuning
    from runtime.kernels import quant_matmul
    from runtime.linear import QuantLinear

    layer = QuantLinear(64, 32, QuantScheme(4, 32, True))
    decoder = torch.nn.Sequential(torch.nn.Linear(2, 2), layer)
    assert warm_matmul_tuning(decoder, 24) == 0  # the dense reference (CPU): nothing to tune
    layer._kernel = SimpleNamespace(qweight=torch.zeros(1))  # as materialize leaves it on a GPU
    asked = []
    monkeypatch.setattr(quant_matmul, "choose_config", lambda M, kw, dtype, device: asked.append(M))
    assert warm_matmul_tuning(decoder, 40) == len(asked) == len(set(asked))
    assert {quant_matmul.m_bucket(M) for M in range(1, 41)} == set(asked)  # 1 .. 16 one by one, then 32, 64


def test_model_generate_decodes_with_the_engines_launches(model_dir, prompts):
    """Model.generate runs its steps through the engine's Executor: a decode step makes the
    engine's launches (9 per layer, the block write when a block fills, the split combine when
    attention splits), one host sync (the sampler's read) and one input copy (two when a block
    fills: its block-table row)."""
    from runtime.counting import generate_step_counts

    model = runtime.load(model_dir, kv=INT4, dtype=torch.bfloat16)
    model.decoder.use_kernels(True)
    model.decoder.attention_kernels = True
    tokens = iter(model.generate(prompts[0], max_new_tokens=16, stop_at_eos=False))  # 5 tokens: block 0 fills
    next(tokens)
    seen = set()
    for position in range(5, 17):
        fills = (position + 1) % 16 == 0
        counts = generate_step_counts(model, tokens)
        combine = counts["ops"].get("triton:_combine_kernel", 0) // counts["layers"]
        assert counts["launches_per_layer"] == [9 + fills + combine] * counts["layers"], counts["ops"]
        assert counts["syncs"] == 1 and counts["input_copies"] == 1 + fills, counts["ops"]
        seen.add(fills)
    assert seen == {False, True}
