"""``lowbit serve`` through the official ``openai`` client, as users call it: completions, chat,
streaming, stop strings, seeds, usage, and errors in OpenAI's shape. A tiny random model on the
CPU, served on a loopback port by a thread of this process (tests/served.py)."""

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import runtime  # noqa: E402
from served import LiveServer, metric, tiny_checkpoint  # noqa: E402

MAX_LEN = 128  # the served context: short, so "up to the context" runs are quick


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return runtime.load(tiny_checkpoint(tmp_path_factory.mktemp("serve") / "tiny"), kv="fp16-r16")


@pytest.fixture(scope="module")
def server(model):
    live = LiveServer(model, max_batch=4, max_len=MAX_LEN)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def reference(model, prompt, n: int, **sampling) -> tuple[str, int]:
    """``model.generate``'s text and token count for the same request, alone, without a server."""
    tokens = list(model.generate(prompt, max_new_tokens=n, **sampling))
    return "".join(t.text for t in tokens), len(tokens)


@pytest.mark.parametrize("prompt", ["It is a truth universally", [5, 80, 17, 33, 120, 9, 61]])
def test_greedy_completion_equals_model_generate(model, client, prompt):
    text, count = reference(model, prompt, 20)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    prompt_tokens = len(model.tokenizer(prompt).input_ids) if isinstance(prompt, str) else len(prompt)
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == ("length" if count == 20 else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        prompt_tokens, count, prompt_tokens + count)
    assert r.model == "tiny" and r.object == "text_completion"


def test_streaming_gives_the_same_text_piece_by_piece_and_usage(model, client):
    text, count = reference(model, "Anne Elliot walked", 24)
    stream = client.completions.create(model="tiny", prompt="Anne Elliot walked", max_tokens=24, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == text and len([p for p in pieces if p]) > 1  # streamed, not sent whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == count == 24 and not chunks[-1].choices


def test_stream_ends_with_done(server):
    status, body = server.request("POST", "/v1/completions", {"prompt": "It is", "max_tokens": 3, "stream": True})
    events = [line for line in body.split("\n") if line]
    assert status == 200 and events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_chat_renders_the_template_and_streams(model, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who walked at Lyme?"}]
    rendered = model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = model.tokenizer(rendered, add_special_tokens=False).input_ids
    text, count = reference(model, ids, 16)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), count)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=16,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_stop_string_ends_the_text_before_it(model, client):
    text, _ = reference(model, "It is a truth", 30)
    at = next(i for i in range(4, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop = text[at:at + 2]
    r = client.completions.create(model="tiny", prompt="It is a truth", max_tokens=30, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].text == text[:text.find(stop)] and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt="It is a truth", max_tokens=30, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text[:text.find(stop)]


def test_seeded_sampling_is_reproducible_and_is_the_runtime_s(model, client):
    kw = dict(model="tiny", prompt="Anne Elliot", max_tokens=16, temperature=1.0, top_p=0.9)
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (8, 9, 10)}
    assert a == b and others - {a}  # the seed decides the draw
    assert a == reference(model, "Anne Elliot", 16, temperature=1.0, top_p=0.9, seed=7)[0]
    top_k = client.completions.create(seed=7, extra_body={"top_k": 1}, **kw).choices[0].text
    assert top_k == reference(model, "Anne Elliot", 16)[0]  # top_k 1 is greedy, whatever the temperature


def test_huge_max_tokens_ends_at_the_context(model, client):
    prompt = [5, 80, 17, 33]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=10**9, temperature=0)
    text, count = reference(model, prompt, MAX_LEN - len(prompt))  # what fits in the served context
    assert (r.choices[0].text, r.usage.completion_tokens) == (text, count)
    assert r.choices[0].finish_reason == ("length" if count == MAX_LEN - len(prompt) else "stop")


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert server.request("GET", "/health") == (200, {"status": "ok"})
    client.completions.create(model="tiny", prompt="It is", max_tokens=5, temperature=0)
    status, page = server.request("GET", "/metrics")
    assert status == 200
    assert metric(page, "lowbit_requests_running") == 0 and metric(page, "lowbit_requests_waiting") == 0
    assert metric(page, "lowbit_kv_cache_blocks_used") == 0 and metric(page, "lowbit_kv_cache_blocks_free") > 0
    assert metric(page, "lowbit_generation_tokens_total") >= 5 and metric(page, "lowbit_preemptions_total") == 0
    assert metric(page, "lowbit_time_to_first_token_seconds_count") >= 1
    assert metric(page, 'lowbit_inter_token_latency_seconds_bucket{le="+Inf"}') >= 4
    assert "# TYPE lowbit_time_to_first_token_seconds histogram" in page
    assert metric(page, "lowbit_generation_tokens_per_second") >= 0


BAD = [  # body, status, param
    ({"prompt": "hi", "n": 2}, 400, "n"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "seed": -3}, 400, "seed"),
    ({"prompt": "hi", "logprobs": 3}, 400, "logprobs"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 2, 99999]}, 400, "prompt"),
    ({"prompt": [1, "two"]}, 400, "prompt"),
    ({"prompt": ["one", "two"]}, 400, "prompt"),
    ({"prompt": list(range(3, 3 + MAX_LEN))}, 413, "prompt"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ([1, 2], 400, None),
    ('{"prompt": "hi", ', 400, None),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"{s}-{p}-{i}" for i, (_, s, p) in enumerate(BAD)])
def test_bad_requests_get_openai_errors_naming_the_parameter(server, body, status, param):
    got, answer = server.request("POST", "/v1/completions", body)
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param


def test_errors_reach_the_client_as_exceptions_and_the_server_lives_on(server, client, model, monkeypatch):
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        client.completions.create(model="tiny", prompt="hi", n=3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi")
    with pytest.raises(openai.BadRequestError):  # a bad parameter of a stream fails before the stream starts
        client.completions.create(model="tiny", prompt="hi", stream=True, top_p=0)
    monkeypatch.setattr(model.tokenizer, "chat_template", None)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert server.request("GET", "/nowhere")[0] == 404 and server.request("GET", "/v1/completions")[0] == 405
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_api_key_is_required_when_set(model):
    live = LiveServer(model, max_batch=2, max_len=MAX_LEN, api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            live.client(api_key="wrong").models.list()
        status, answer = live.request("POST", "/v1/completions", {"prompt": "hi"})
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"
        assert live.request("GET", "/health")[0] == 200  # probes need no key
        r = live.client(api_key="s3cret").completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert r.usage.completion_tokens >= 1
    finally:
        live.stop()


@pytest.mark.slow
def test_smollm2_chat_through_the_server_equals_model_generate():
    from quant import models

    try:
        path = models.resolve("smollm2-135m")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    smol = runtime.load(path)
    live = LiveServer(smol, name="smollm2-135m", max_batch=2, kv_memory="64MB")
    try:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        rendered = smol.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = smol.tokenizer(rendered, add_special_tokens=False).input_ids
        text, count = reference(smol, ids, 24)
        client = live.client()
        r = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == text and r.usage.completion_tokens == count
        assert "Paris" in text  # a real model answers, through the template
        streamed = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24,
                                                  temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == text
        completion = client.completions.create(model="smollm2-135m", prompt="The capital of France is",
                                               max_tokens=8, temperature=0)
        assert completion.choices[0].text == reference(smol, "The capital of France is", 8)[0]
    finally:
        live.stop()
