"""The engine's requests from outside: streaming and metrics, stop strings and ids, parameters and
requests it refuses (named), a shut-down engine, and ``lowbit bench``'s refusal and smoke mode.
"""

import pytest
import torch

from runtime.engine import Engine, EngineClosedError
from runtime.generate import TextStream
from runtime.sampling import SamplingParams, sample
from runtime.units import parse_bytes
from tiny import tiny_tokenizer
from engine_setup import FP16, greedy, model_dir, models, plain, prompts  # noqa: F401 (fixtures)


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
