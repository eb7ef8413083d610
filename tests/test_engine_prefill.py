"""Batched prefill: several sequences' prompt chunks packed into one forward.

Eight prompts of different lengths (1 to 40 tokens, crossing blocks of 16, in chunks of 16 so
later chunks read earlier ones back from the cache) prefilled together give each sequence the
logits of its prompt prefilled alone by the plain runtime, and the same greedy token. The
float32 tiny model's logits agree within 1e-4 (measured: at most 1.0e-5; the GEMMs run on
M = all the packed tokens instead of one prompt's, so the sums round in another order).
"""

import itertools

import pytest
import torch

import runtime
from kvquant import parse_kv
from runtime.cache import KVCache
from runtime.engine import Engine
from runtime.attention import PackedBatch
from runtime.generate import prefill_chunks
from engine_setup import FP16, INT4, greedy, model_dir, models, plain, prompts  # noqa: F401 (fixtures)

LENGTHS = (5, 21, 9, 34, 14, 1, 16, 40)
CHUNK = 16


@pytest.fixture(scope="module")
def eight_prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 150, (n,), generator=g).tolist() for n in LENGTHS]


def packed_prefill(model, prompts, kv, kernels):
    """Each prompt's last logits, every prompt's chunks prefilled in rounds of one packed forward."""
    cfg = model.decoder.cfg
    cache = KVCache(cfg.num_layers, len(prompts), cfg.num_kv_heads, cfg.head_dim, 64, model.dtype, model.device,
                    scheme=parse_kv(kv))
    for slot, p in enumerate(prompts):
        cache.add_sequence(slot)
        assert cache.reserve(slot, len(p))
    done, last, forwards = [0] * len(prompts), {}, 0
    while len(last) < len(prompts):
        slots = [s for s, p in enumerate(prompts) if done[s] < len(p)]
        chunks = [prefill_chunks(done[s], len(prompts[s]), CHUNK)[0] for s in slots]
        batch = PackedBatch(cache, slots, [a for a, _ in chunks], [prompts[s][a:b] for s, (a, b) in zip(slots, chunks)],
                            kernels)
        with torch.inference_mode():
            logits = model.decoder.forward_packed(batch.input_ids, batch.positions, batch, batch.logits_at)
        forwards += 1
        assert logits.shape == (len(slots), cfg.vocab_size)  # the last token of each sequence only
        for s, (a, b), row in zip(slots, chunks, logits):
            cache.advance(s, b - a)
            done[s] = b
            if b == len(prompts[s]):
                last[s] = row
    assert forwards == -(-max(LENGTHS) // CHUNK)  # one forward per round, not one per sequence
    return [last[s] for s in range(len(prompts))]


def single_prefill(model, prompt):
    """The plain runtime's last logits for one prompt alone (its own cache, the same chunks)."""
    cache = model.new_cache(64)
    with torch.inference_mode():
        for a, b in prefill_chunks(0, len(prompt), CHUNK):
            logits = model.decoder(torch.tensor([prompt[a:b]], device=model.device), cache, a, last_only=True)
    return logits[0, -1]


@pytest.mark.parametrize("kv,kernels", [(FP16, False), (INT4, False), (INT4, True)])
def test_prefill_of_8_prompts_in_one_forward_equals_8_single_prefills(models, eight_prompts, kv, kernels):
    model = models[kv]
    packed = packed_prefill(model, eight_prompts, kv, kernels)
    for prompt, got in zip(eight_prompts, packed):
        want = single_prefill(model, prompt)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert int(got.argmax()) == int(want.argmax())


def test_the_engine_prefills_waiting_prompts_together(models, eight_prompts):
    model = models[INT4]
    engine = Engine(model, max_batch=8, max_len=64, prefill_chunk=64)
    requests = [engine.submit(p, greedy(3)) for p in eight_prompts]
    engine.step()  # 64 prompt tokens a step, oldest first: the prompts of 5, 21 and 9 (not the 34 next)
    assert engine.stats()["prefill_forwards"] == 1
    assert [r.computed for r in requests[:4]] == [5, 21, 9, 0] and all(len(r.output_ids) == 1 for r in requests[:3])
    engine.run()
    assert [r.output_ids for r in requests] == [plain(model, p, 3, prefill_chunk=64) for p in eight_prompts]
    assert engine.stats()["prefill_forwards"] < len(eight_prompts)


@pytest.mark.parametrize("kv", ["fp16-r16", "int8-r16", "int4-g16-r16", "int2-g16-r16", "fp8-r16", "k4v2-g16-r16"])
def test_every_kv_scheme_gives_generates_tokens_with_joins_preemption_and_chunks(model_dir, prompts, kv):
    """Packed prefill under everything the scheduler does: five requests through three slots
    (joins), a pool too small for all to grow (preemption, replay) and chunks of 16."""
    model = runtime.load(model_dir, kv=kv)
    probe = Engine(model, max_batch=3, max_len=64).cache
    tight = Engine(model, max_batch=3, max_len=64, kv_memory=3 * probe.slot_bytes() + 3 * probe.block_bytes(),
                   prefill_chunk=16)
    requests = tight.generate(prompts, greedy(20))
    assert tight.stats()["preemptions"] >= 1
    assert [r.output_ids for r in requests] == [plain(model, p, 20, prefill_chunk=16) for p in prompts]


def flash_semantics(q, k, v, cu_queries, cu_keys, max_query, max_key, window):
    """FlashAttention-2's variable-length forward as its interface defines it, written out densely
    (what the CUDA route is handed; CPU has no such kernel): sequence i's queries are rows
    cu_queries[i] .. cu_queries[i+1], its keys cu_keys[i] .. cu_keys[i+1]; causal aligned at the
    end; a window of w positions is window_size_left = w - 1."""
    cq, ck = cu_queries.tolist(), cu_keys.tolist()
    assert max_query == max(b - a for a, b in zip(cq, cq[1:])) and max_key == max(b - a for a, b in zip(ck, ck[1:]))
    out = []
    for (qa, qb), (ka, kb) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
        tq, tk = qb - qa, kb - ka
        pos = torch.arange(tk - tq, tk)[:, None]
        key = torch.arange(tk)[None]
        allowed = (key <= pos) & ((key > pos - window) if window else True)
        qi, ki, vi = (t.transpose(0, 1)[None] for t in (q[qa:qb], k[ka:kb], v[ka:kb]))
        o = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed, enable_gqa=True)
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("kv,kernels", [(INT4, False), (INT4, True)])
def test_packed_prefill_attends_in_one_call_per_layer(models, eight_prompts, kv, kernels, monkeypatch):
    """Where FlashAttention-2 runs, a packed forward hands each layer's attention for all its
    sequences to one variable-length call. Here that call is its interface written out densely:
    the packed layout, the cumulative lengths and the maxima the batch builds give each prompt
    its single-prefill logits, with chunks after cached positions (their keys from the cache)."""
    import runtime.attention_math as attention

    calls = []

    def recorded(*args):
        calls.append(args[5:7])
        return flash_semantics(*args)

    monkeypatch.setattr(attention, "flash_varlen_ok", lambda q, window: True)
    monkeypatch.setattr(attention, "flash_varlen", recorded)
    model = models[kv]
    packed = packed_prefill(model, eight_prompts, kv, kernels)
    layers, rounds = model.decoder.cfg.num_layers, -(-max(LENGTHS) // CHUNK)
    assert len(calls) == layers * rounds  # one per layer per forward, not one per sequence
    assert (16, 32) in calls  # a round of chunks after 16 cached positions: keys reach 32
    for prompt, got in zip(eight_prompts, packed):
        want = single_prefill(model, prompt)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention-2 runs on CUDA only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
def test_flash_varlen_equals_the_per_sequence_reference(dtype, window):
    from runtime.attention_math import flash_varlen, varlen_reference

    g = torch.Generator().manual_seed(0)
    query_lengths, key_lengths = [5, 1, 16, 9], [5, 17, 48, 9]  # from position 0, and chunks after cached ones
    q = torch.randn(sum(query_lengths), 8, 64, generator=g).to("cuda", dtype)
    k, v = (torch.randn(sum(key_lengths), 2, 64, generator=g).to("cuda", dtype) for _ in range(2))
    cu = [torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device="cuda")
          for n in (query_lengths, key_lengths)]
    got = flash_varlen(q, k, v, *cu, max(query_lengths), max(key_lengths), window)
    want = varlen_reference(q.float(), k.float(), v.float(), query_lengths, key_lengths, window)
    torch.testing.assert_close(got.float(), want, atol=2e-2 if dtype == torch.bfloat16 else 2e-3, rtol=0)
