"""Engine.abort and the engine on a thread of its own: what a server relies on.

An aborted request leaves the queue or the batch at the engine's next step, gives back every
cache block and slot it held, ends its stream with finish_reason "abort", and the requests
batched with it give the same greedy tokens as if it had never been there.
"""

import queue
import threading

import pytest

from runtime.engine import Engine
from engine_setup import FP16, INT4, greedy, model_dir, models, plain, prompts  # noqa: F401 (fixtures)

STAGES = {  # when the victim (34 prompt tokens, prefilled in chunks of 16) is aborted
    "waiting": lambda engine, r: r in engine.waiting,
    "prefill": lambda engine, r: 0 < r.computed < len(r.prompt_ids),
    "decode": lambda engine, r: len(r.output_ids) >= 2,
}


@pytest.mark.parametrize("kv", [FP16, INT4])
@pytest.mark.parametrize("when", list(STAGES))
def test_abort_frees_the_request_and_leaves_the_others_tokens_unchanged(models, prompts, kv, when):
    model = models[kv]
    engine = Engine(model, max_batch=2 if when == "waiting" else 3, max_len=64, prefill_chunk=16)
    free = engine.cache.free_blocks, engine.cache.free_slots
    others = [engine.submit(prompts[i], greedy(12)) for i in (0, 2)]
    streamed = []
    victim = engine.submit(prompts[3], greedy(20), on_token=streamed.append)
    engine.step()
    while not STAGES[when](engine, victim):
        engine.step()
    engine.abort(victim.id if when == "decode" else victim)  # by id or by the request
    assert victim.finish_reason is None  # queued: the engine's next step applies it
    engine.step()
    assert victim.finish_reason == "abort" and victim.slot is None
    assert victim not in engine.running and victim not in engine.waiting
    assert streamed[-1] is None and [t.id for t in streamed[:-1]] == victim.output_ids
    assert [t.id for t in victim] == victim.output_ids  # iteration ends after what it had
    assert (when == "decode") == (len(victim.output_ids) >= 2)
    engine.run()
    assert [r.output_ids for r in others] == [plain(model, r.prompt_ids, 12) for r in others]
    assert (engine.cache.free_blocks, engine.cache.free_slots) == free
    stats = engine.stats()
    assert stats["aborted"] == 1 and stats["finished"] == 2 and stats["running"] == stats["waiting"] == 0


def test_abort_gives_back_the_blocks_free_before_submit_at_once(models, prompts):
    engine = Engine(models[INT4], max_batch=2, max_len=64, prefill_chunk=16)
    before = engine.cache.free_blocks, engine.cache.free_slots
    r = engine.submit(prompts[3], greedy(20))
    for _ in range(5):  # 3 prefill chunks, 2 decode steps: 35 positions, 2 pool blocks and the residual
        engine.step()
    assert engine.cache.free_blocks == before[0] - 2 and engine.cache.free_slots == before[1] - 1
    engine.abort(r)
    engine.abort(r)  # twice, or after it ended: nothing more happens
    engine.abort(12345)  # an unknown id: nothing happens
    engine.step()
    assert (engine.cache.free_blocks, engine.cache.free_slots) == before and r.finish_reason == "abort"
    assert not engine.has_work() and engine.stats()["aborted"] == 1


def test_submit_and_abort_from_other_threads_while_the_engine_runs_in_its_own(models, prompts):
    model = models[FP16]
    engine = Engine(model, max_batch=4, max_len=64)
    stop = threading.Event()

    def engine_thread():
        while not stop.is_set():
            if engine.wait_for_work(0.05):
                engine.step()

    thread = threading.Thread(target=engine_thread, daemon=True)
    thread.start()
    try:
        streams = [queue.Queue(), queue.Queue()]
        kept = engine.submit(prompts[0], greedy(10), on_token=streams[0].put)
        victim = engine.submit(prompts[1], greedy(40), on_token=streams[1].put)
        first = [streams[1].get(timeout=60) for _ in range(2)]
        engine.abort(victim)
        tokens = {0: [], 1: first}
        for i, stream in enumerate(streams):
            while (token := stream.get(timeout=60)) is not None:
                tokens[i].append(token)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert [t.id for t in tokens[0]] == kept.output_ids == plain(model, prompts[0], 10)
    assert victim.finish_reason == "abort" and [t.id for t in tokens[1]] == victim.output_ids
    assert 2 <= len(victim.output_ids) < 40
    assert engine.cache.free_blocks == engine.cache.num_blocks and engine.cache.free_slots == 4
