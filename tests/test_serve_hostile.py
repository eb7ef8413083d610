"""``lowbit serve`` against hostile and absurd requests (issue 34), through a real loopback socket: a body
past the limit is a 413 before it is read, a chat template that loops is a 400 naming it while /health
answers, deep JSON is a 400, a client that leaves mid-body is one log line, and a fuzzed API never
answers 500."""

import http.client
import json
import logging
import socket
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import runtime  # noqa: E402
from served import LiveServer, tiny_checkpoint  # noqa: E402

LIMIT = 2 << 20
LOOPING_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return runtime.load(tiny_checkpoint(tmp_path_factory.mktemp("serve") / "tiny"), kv="fp16-r16")


@pytest.fixture(scope="module")
def server(model):
    live = LiveServer(model, max_batch=4, max_len=128, max_body_bytes=LIMIT, render_time_limit=0.5)
    yield live
    live.stop()


def raw(server, head: bytes, body: bytes = b"", close_early: bool = False) -> bytes:
    """Send ``head`` and ``body`` on a fresh connection; the response's first bytes (b"" if none)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head + body)
        if close_early:
            return b""
        answer = b""
        try:
            while not complete(answer):
                data = s.recv(65536)
                if not data:
                    break
                answer += data
        except ConnectionResetError:
            pass
        return answer


def complete(answer: bytes) -> bool:
    head, sep, body = answer.partition(b"\r\n\r\n")
    length = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    return bool(sep) and bool(length) and len(body) >= length[0]


def health_time(server) -> float:
    started = time.perf_counter()
    status, body = server.request("GET", "/health")
    assert status == 200 and body == {"status": "ok"}
    return time.perf_counter() - started


def test_a_declared_body_past_the_limit_is_413_before_it_is_sent(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 50000000\r\n\r\n")
    started = time.perf_counter()
    answer = raw(server, head, b'{"prompt": "')  # 12 of the 50 MB announced: the answer does not wait for more
    assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer
    assert time.perf_counter() - started < 5
    health_time(server)


def test_a_chunked_body_past_the_limit_is_413_once_the_limit_is_reached(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"a" * 16384
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(LIMIT // len(chunk) + 1))
    answer = raw(server, head, body)
    assert answer.startswith(b"HTTP/1.1 413")


def test_a_body_within_the_limit_is_served(server):
    prompt = "word " * 4000  # 20 kB: within the limit, past the context
    status, body = server.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert status == 413 and body["error"]["code"] == "context_length_exceeded"


def test_a_long_prompt_tokenizes_while_health_answers(server):
    """A prompt of 1.1 MB (within the limit, past the context) takes seconds to tokenize: beside the event
    loop, not on it, so every other connection is answered meanwhile."""
    prompt = "It is a truth universally acknowledged that " * 25000
    answers = {}
    thread = threading.Thread(target=lambda: answers.update(big=server.request(
        "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2})))
    thread.start()
    waits = []
    while thread.is_alive():
        waits.append(health_time(server))
    thread.join()
    status, body = answers["big"]
    assert status == 413 and body["error"]["code"] == "context_length_exceeded"
    assert len(waits) >= 3 and max(waits) < 1.0, waits


def test_a_looping_chat_template_is_a_400_naming_it_and_health_answers_meanwhile(server, model):
    good = model.tokenizer.chat_template
    model.tokenizer.chat_template = LOOPING_TEMPLATE
    answers = {}

    def chat():
        answers["chat"] = server.request("POST", "/v1/chat/completions",
                                         {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})

    try:
        started = time.perf_counter()
        thread = threading.Thread(target=chat)
        thread.start()
        waits = []
        while thread.is_alive():
            waits.append(health_time(server))
        thread.join()
        elapsed = time.perf_counter() - started
    finally:
        model.tokenizer.chat_template = good
    status, body = answers["chat"]
    assert status == 400 and body["error"]["code"] == "chat_template_timeout"
    assert "chat template" in body["error"]["message"] and "time limit of 0.5 s" in body["error"]["message"]
    assert elapsed < 5 and len(waits) >= 2 and max(waits) < 0.5, waits
    status, body = server.request("POST", "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1  # the server is as it was


@pytest.mark.parametrize("body", ["[" * 20000 + "]" * 20000, '{"prompt": ' * 3000 + "1" + "}" * 3000,
                                  '{"prompt": "a", "seed": 1' + "0" * 5000 + "}"],
                         ids=["array", "object", "5000-digit-integer"])
def test_absurd_json_is_a_400_not_a_500(server, body):
    status, answer = server.request("POST", "/v1/completions", body)
    assert status == 400 and answer["error"]["code"] == "invalid_json", answer


@pytest.mark.parametrize("seed", [2 ** 64, 2 ** 70, -1])
def test_a_seed_out_of_range_is_a_400_naming_seed(server, seed):
    status, body = server.request("POST", "/v1/completions", {"prompt": "a", "seed": seed, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "seed", body


def test_the_largest_seed_is_served(server):
    status, body = server.request("POST", "/v1/completions", {"prompt": "a", "seed": 2 ** 64 - 1, "max_tokens": 1})
    assert status == 200, body


def test_clients_leaving_mid_body_are_one_log_line_each(server, caplog):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n")
    with caplog.at_level(logging.INFO):
        for _ in range(5):
            raw(server, head, b'{"prompt": "abc', close_early=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len([r for r in caplog.records if "disconnected" in r.getMessage()]) < 5:
            time.sleep(0.05)
        time.sleep(0.2)  # whatever else the five would log
    gone = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(gone) == 5 and all(r.levelno == logging.INFO for r in gone)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], caplog.text
    health_time(server)


def test_metrics_answer_without_the_api_key_and_v1_does_not(model):
    live = LiveServer(model, max_batch=2, max_len=64, api_key="secret")
    try:
        assert live.request("GET", "/metrics")[0] == 200  # as vLLM: load figures only, documented
        assert live.request("GET", "/v1/models")[0] == 401
        assert live.request("GET", "/v1/models", headers={"Authorization": "Bearer secret"})[0] == 200
    finally:
        live.stop()


# ------------------------------------------------------------------ fuzzing the API (Hypothesis)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2 ** 80, max_value=2 ** 80)
    | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
KEYS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
        "stop", "stream", "stream_options", "n", "ignore_eos", "model", "logprobs", "echo"]
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", 1]),
                                           "content": st.text(max_size=20) | json_values}), max_size=3)
bodies = st.dictionaries(st.sampled_from(KEYS), json_values, max_size=6) | st.fixed_dictionaries(
    {"prompt": st.text(max_size=30) | st.lists(st.integers(-5, 5000), max_size=8),
     "max_tokens": st.integers(-2, 4), "temperature": st.floats(-1, 3) | st.just(float("inf"))},
    optional={"seed": st.integers(-2, 2 ** 70), "top_k": st.integers(-2, 5), "stop": json_values,
              "stream": st.booleans()}) | st.fixed_dictionaries({"messages": messages, "max_tokens": st.integers(0, 3)})


def allowed_nonstandard_json(body) -> str:
    return json.dumps(body, allow_nan=True)  # inf and nan as Python writes them: a client may send them


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzzed_requests_get_a_client_error_or_an_answer_never_a_500(server, body, path):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", path, body=allowed_nonstandard_json(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    assert response.status in (200, 400, 404, 413), (response.status, data[:300])
    if response.status != 200:
        error = json.loads(data)["error"]
        assert error["message"] and error["type"] == "invalid_request_error"
