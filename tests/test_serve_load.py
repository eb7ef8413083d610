"""``lowbit serve`` under load and faults: 64 concurrent streaming clients over a KV cache too small
for them all (preemption happens), clients that disconnect, and a SIGTERM while a stream runs.
Everything talks to 127.0.0.1 only, with time limits on every wait."""

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

import runtime  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from served import LiveServer, metric, tiny_checkpoint  # noqa: E402

KV = "fp16-r16"  # blocks of 16 tokens: short prompts fill blocks
MAX_LEN = 128
MAX_BATCH, MAX_QUEUE, CLIENTS = 8, 48, 64
PROMPT_LENGTHS = (3, 10, 17, 30, 45, 60, 5, 25)  # mixed, several crossing block boundaries
ROUND_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("serve-load") / "tiny")


@pytest.fixture(scope="module")
def model(checkpoint):
    return runtime.load(checkpoint, kv=KV)


def workload():
    """(prompt ids, max_tokens) for each client: 8 distinct prompts of mixed lengths, 8 clients each."""
    prompts = [[(7 * i + 13 * n) % 150 + 3 for i in range(n)] for n in PROMPT_LENGTHS]
    return [(prompts[c % len(prompts)], 10 + 2 * (c % len(prompts))) for c in range(CLIENTS)]


def tight_budget(model) -> int:
    """Every slot's residual block and 12 pool blocks: 8 sequences of these lengths need more, so
    running ones get preempted; the longest request alone (60 + 24 tokens, 5 blocks) fits."""
    probe = Engine(model, max_batch=MAX_BATCH, max_len=MAX_LEN)
    budget = MAX_BATCH * probe.cache.slot_bytes() + 12 * probe.cache.block_bytes()
    probe.shutdown()
    return budget


async def stream_one(client, prompt, max_tokens):
    try:
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        text, tokens, reasons = "", None, []
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                reasons.append(choice.finish_reason)
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return "done", text, tokens, [r for r in reasons if r]
    except openai.APIStatusError as e:
        return "refused", e.status_code, e.body, None


async def one_round(url):
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=ROUND_TIMEOUT_S)
    try:
        return await asyncio.wait_for(asyncio.gather(*(stream_one(client, p, n) for p, n in workload())),
                                      ROUND_TIMEOUT_S)
    finally:
        await client.close()


def test_64_streaming_clients_over_a_small_cache(model):
    expected = {}
    for prompt, n in workload():  # what each request gives alone, without a server
        if (tuple(prompt), n) not in expected:
            tokens = list(model.generate(prompt, max_new_tokens=n))
            expected[tuple(prompt), n] = ("".join(t.text for t in tokens), len(tokens))
    live = LiveServer(model, max_batch=MAX_BATCH, max_queue=MAX_QUEUE, max_len=MAX_LEN, kv_memory=tight_budget(model))
    rss = []
    try:
        for _ in range(2):
            started = time.monotonic()
            results = asyncio.run(one_round(live.url))
            assert time.monotonic() - started < ROUND_TIMEOUT_S
            done = 0
            for (prompt, n), result in zip(workload(), results):
                if result[0] == "refused":  # only when max_batch run and max_queue wait: a clear 503
                    status, body = result[1:3]
                    assert status == 503 and body["code"] == "server_busy", result
                    continue
                done += 1
                _, text, tokens, reasons = result
                # no token lost or duplicated: the stream is what the request gives alone
                assert (text, tokens) == expected[tuple(prompt), n]
                assert reasons == ["length" if tokens == n else "stop"]
            assert done >= MAX_BATCH + MAX_QUEUE  # all of those were taken, whenever the others came
            assert live.settled(), live.worker.metrics.snapshot  # every request ended, every block is free
            rss.append(psutil.Process().memory_info().rss)
        page = live.request("GET", "/metrics")[1]
        assert metric(page, "lowbit_preemptions_total") > 0
        assert rss[1] - rss[0] < 32 * 2**20, f"memory grew by {(rss[1] - rss[0]) / 2**20:.1f} MiB over a second round"
    finally:
        live.stop()


def read_events(sock_file, count):
    """The first ``count`` SSE data lines of a raw HTTP response."""
    events = []
    while len(events) < count:
        line = sock_file.readline()
        assert line, "the server closed the stream early"
        if line.startswith(b"data: "):
            events.append(line)
    return events


def start_stream(port, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def slow_steps(live, seconds: float = 0.02) -> None:
    """Make each engine step take a while, as a real model's would: the tiny one finishes 100
    tokens before a client could leave."""
    step = live.worker.engine.step

    def slow_step():
        time.sleep(seconds)
        step()

    live.worker.engine.step = slow_step


def test_a_client_that_disconnects_frees_its_blocks(model):
    live = LiveServer(model, max_batch=2, max_queue=4, max_len=MAX_LEN)
    slow_steps(live)
    try:
        total = live.worker.metrics.snapshot["blocks_total"]
        body = b'{"prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], "max_tokens": 100, ' \
               b'"temperature": 0, "stream": true, "stream_options": {"include_usage": true}}'
        streaming = start_stream(live.port, body)
        read_events(streaming.makefile("rb"), 3)  # mid-stream
        assert live.worker.metrics.snapshot["blocks_free"] < total
        streaming.close()
        whole = start_stream(live.port, body.replace(b'"stream": true', b'"stream": false'))
        time.sleep(0.3)  # a non-streaming request whose client leaves before the answer
        whole.close()
        assert live.settled(), live.worker.metrics.snapshot
        page = live.request("GET", "/metrics")[1]
        assert metric(page, "lowbit_requests_aborted_total") == 2
        assert metric(page, "lowbit_generation_tokens_total") < 200  # neither ran to its 100 tokens
        r = live.client().completions.create(model="tiny", prompt="It is", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens >= 1  # and the server serves on
    finally:
        live.stop()


def test_a_full_queue_answers_503_and_a_closed_worker_too(model):
    live = LiveServer(model, max_batch=1, max_queue=0, max_len=MAX_LEN)
    slow_steps(live)
    try:
        body = b'{"prompt": [5, 6, 7], "max_tokens": 100, "temperature": 0, "stream": true}'
        busy = start_stream(live.port, body)
        read_events(busy.makefile("rb"), 1)
        status, answer = live.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and answer["error"]["code"] == "server_busy"
        busy.close()
        assert live.settled()
        live.worker.close(timeout=30)  # as at shutdown: the engine is gone, requests are refused
        status, answer = live.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and answer["error"]["code"] == "server_shutting_down"
        assert live.request("GET", "/health")[0] == 503
    finally:
        live.stop()


def test_sigterm_drains_the_running_stream_and_exits_0(checkpoint):
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen([sys.executable, "-m", "lowbit.cli", "serve", str(checkpoint), "--port", "0",
                             "--kv", KV, "--max-batch", "4"], stderr=subprocess.PIPE, text=True, env=env, cwd=root)
    try:
        banner = []
        while not banner or "auth" not in banner[-1]:
            line = proc.stderr.readline()
            assert line, "the server exited: " + "".join(banner)
            banner.append(line)
        text = "".join(banner)
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", text).group(1))
        assert "tiny" in text and "fp16" in text and "sequences of the full context (512 tokens)" in text
        body = b'{"prompt": [5, 6, 7, 8], "max_tokens": 400, "temperature": 0, "ignore_eos": true, "stream": true, ' \
               b'"stream_options": {"include_usage": true}}'
        stream = start_stream(port, body)
        lines = stream.makefile("rb")
        read_events(lines, 2)
        proc.send_signal(signal.SIGTERM)
        rest = lines.read().decode()  # the server finishes this stream before it stops
        assert rest.count("data: ") > 100 and "data: [DONE]" in rest  # most of it made after the SIGTERM
        assert '"completion_tokens": 400' in rest
        assert proc.wait(timeout=60) == 0
        log = proc.stderr.read()
        assert re.search(r"request \w+ completion stream: 4 prompt \+ 400 output tokens, length", log), log
        with pytest.raises(OSError):  # after shutdown nothing listens
            socket.create_connection(("127.0.0.1", port), timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
