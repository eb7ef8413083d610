"""The OpenAI wire format: request bodies checked into engine work, responses and errors shaped as
OpenAI's (``{"error": {"message", "type", "param", "code"}}``), so existing clients read them.

Every check names the parameter it refuses; the ranges come from ``runtime.SamplingParams``
(one home for what a valid temperature is), the types are checked here first, so a string where
a number belongs is a 400 naming it, never a 500.
"""

from __future__ import annotations

import numbers
import time
import uuid
from dataclasses import dataclass, field

from lowbit.chat_template import RENDER_TIME_LIMIT_S, TemplateTimeout, render_chat
from runtime.sampling import SamplingParams


class APIError(Exception):
    """An error the client gets back, in OpenAI's shape, with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad_param(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_parameter")


# Parameters of the OpenAI API this server does not implement, with the value that means "off":
# a request that asks for one gets a 400 naming it rather than an answer that silently ignored it.
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "logit_bias": (None, {}), "tools": (None, []), "response_format": (None, {"type": "text"})}


@dataclass
class Work:
    """What one HTTP request asks of the engine: its prompt (text or token ids) and sampling."""

    prompt: str | list[int]
    sampling: dict  # SamplingParams fields; max_tokens None: the rest of the context
    stream: bool
    include_usage: bool
    chat: bool  # a chat-template prompt: its special tokens are in the text already
    model: str | None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _typed(body: dict, name: str, check, what: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise bad_param(name, f"'{name}' must be {what}, got {type(value).__name__} {value!r:.60}")
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_param("stop", "'stop' must be a non-empty string or a list of them")
    return tuple(stop)


def _sampling(body: dict, max_tokens_names: tuple[str, ...]) -> dict:
    for name, off in UNSUPPORTED.items():
        if body.get(name) not in off:
            raise bad_param(name, f"'{name}' is not supported by this server")
    n = _typed(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise bad_param("n", f"'n' must be 1 (one completion per request), got {n}")
    max_tokens = None
    for name in max_tokens_names:
        max_tokens = _typed(body, name, _is_int, "an integer", max_tokens)
        if max_tokens is not None and max_tokens < 1:
            raise bad_param(name, f"'{name}' must be at least 1, got {max_tokens}")
    top_k = _typed(body, "top_k", _is_int, "an integer", 0)
    fields = dict(temperature=_typed(body, "temperature", _is_number, "a number", 1.0),
                  top_p=_typed(body, "top_p", _is_number, "a number", 1.0),
                  top_k=0 if top_k == -1 else top_k,  # -1: off, as vLLM spells it
                  seed=_typed(body, "seed", _is_int, "an integer"), stop=_stop(body),
                  # vLLM's extension: a fixed output length, for benchmarks
                  ignore_eos=_typed(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false", False))
    for name, value in fields.items():  # one at a time, so the error names the parameter
        try:
            SamplingParams(**{name: value})
        except ValueError as e:
            raise bad_param(name, str(e)) from None
    return {**fields, "max_tokens": max_tokens}


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _typed(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    options = _typed(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    usage = _typed(options, "include_usage", lambda v: isinstance(v, bool), "true or false", False)
    return stream, usage


def _model(body: dict) -> str | None:
    return _typed(body, "model", lambda v: isinstance(v, str), "a string")


def completion_work(body) -> Work:
    """A ``/v1/completions`` body: one prompt, text or token ids (or a list holding one)."""
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # the batch form with one prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_param("prompt", "one prompt per request: send several prompts as several requests")
    if isinstance(prompt, list) and not all(_is_int(t) for t in prompt):
        raise bad_param("prompt", "'prompt' given as a list must hold token ids (integers)")
    if not isinstance(prompt, (str, list)):
        raise bad_param("prompt", "'prompt' is required: a string or a list of token ids")
    stream, usage = _stream_flags(body)
    return Work(prompt, _sampling(body, ("max_tokens",)), stream, usage, chat=False, model=_model(body))


def chat_work(body, tokenizer, time_limit: float = RENDER_TIME_LIMIT_S) -> Work:
    """A ``/v1/chat/completions`` body, its messages rendered with the model's chat template (stopped
    after ``time_limit`` seconds: a 400 naming the template). It runs code from the model's files:
    call it off the event loop."""
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_param("messages", "'messages' is required: a non-empty list of {role, content} objects")
    turns = [_message(m, i) for i, m in enumerate(messages)]
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_param("messages", "this model's tokenizer has no chat template: use /v1/completions with a "
                                    "plain prompt, or serve a checkpoint whose tokenizer_config.json has one")
    try:
        prompt = render_chat(tokenizer, turns, time_limit)
    except TemplateTimeout as e:
        raise APIError(400, str(e), param="messages", code="chat_template_timeout") from None
    except Exception as e:  # a template may refuse a conversation (e.g. roles not alternating)
        raise bad_param("messages", f"the chat template refused these messages: {e}") from None
    stream, usage = _stream_flags(body)
    sampling = _sampling(body, ("max_tokens", "max_completion_tokens"))
    return Work(prompt, sampling, stream, usage, chat=True, model=_model(body))


def _message(m, i: int) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
        raise bad_param(f"messages[{i}]", "each message needs a 'role' of system, developer, user or assistant")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text ones
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise bad_param(f"messages[{i}].content", "only text content parts are supported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad_param(f"messages[{i}].content", "'content' must be a string or a list of text parts")
    return {"role": "system" if m["role"] == "developer" else m["role"], "content": content}


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


# ------------------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _choice(work: Work, text: str | None, finish: str | None, first: bool = False) -> dict:
    if not work.chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    if not work.stream:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}
    delta = {} if text is None and not first else {"content": text or ""}
    if first:
        delta["role"] = "assistant"
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


def _envelope(work: Work, model: str, chunk: bool) -> dict:
    kind = ("chat.completion" if work.chat else "text_completion") + (".chunk" if chunk and work.chat else "")
    return {"id": ("chatcmpl-" if work.chat else "cmpl-") + work.id, "object": kind, "created": work.created,
            "model": model}


def full_response(work: Work, model: str, text: str, finish: str, counts: dict) -> dict:
    return {**_envelope(work, model, False), "choices": [_choice(work, text, finish)], "usage": counts}


def chunk(work: Work, model: str, text: str | None, finish: str | None = None, first: bool = False) -> dict:
    return {**_envelope(work, model, True), "choices": [_choice(work, text, finish, first)]}


def usage_chunk(work: Work, model: str, counts: dict) -> dict:
    return {**_envelope(work, model, True), "choices": [], "usage": counts}
