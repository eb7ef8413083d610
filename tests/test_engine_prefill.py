"""Batched prefill: several sequences' prompt chunks packed into one forward.

Eight prompts of different lengths (1 to 40 tokens, crossing blocks of 16, in chunks of 16 so
later chunks read earlier ones back from the cache) prefilled together give each sequence the
logits of its prompt prefilled alone by the plain runtime, and the same greedy token. The
float32 tiny model's logits agree within 1e-4 (measured: at most 1.0e-5; the GEMMs run on
M = all the packed tokens instead of one prompt's, so the sums round in another order).
"""

import pytest
import torch

import runtime
from kvquant import parse_kv
from runtime.cache import KVCache
from runtime.engine import Engine
from runtime.attention import PackedBatch
from runtime.generate import prefill_chunks
from test_engine import FP16, INT4, greedy, model_dir, models, plain, prompts  # noqa: F401 (fixtures)

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


@pytest.mark.parametrize("kv", ["fp16-r16", "int8-r16", "int4-g16-r16", "int2-g16-r16", "fp8-r16"])
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
