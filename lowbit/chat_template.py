"""Rendering a model's chat template under a time limit.

A chat template is code that comes with the model's files (Jinja, run in transformers' sandbox): the
sandbox keeps it from touching the machine, not from looping, and one nested loop of 100,000 x 100,000
would hang ``lowbit serve`` or ``lowbit generate --chat`` for good. The render runs with a trace
function that checks a deadline at every line of the compiled template, so a render past its limit
stops with :class:`TemplateTimeout` in the thread that runs it (a thread cannot be killed from outside).
The trace makes a render a few times slower; a normal one takes about a millisecond.
"""

from __future__ import annotations

import sys
import time

RENDER_TIME_LIMIT_S = 5.0  # a real template renders a long conversation in milliseconds


class TemplateTimeout(Exception):
    """A chat template ran past its time limit."""


def render_chat(tokenizer, turns: list[dict], time_limit: float | None = None) -> str:
    """``tokenizer.apply_chat_template(turns)`` as text with the generation prompt, or TemplateTimeout
    once it has run ``time_limit`` seconds (default ``RENDER_TIME_LIMIT_S``)."""
    time_limit = RENDER_TIME_LIMIT_S if time_limit is None else time_limit
    deadline = time.monotonic() + time_limit

    def trace(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateTimeout(f"the model's chat template ran past its time limit of {time_limit:g} s "
                                  "(it loops or builds something huge); fix chat_template in the model's "
                                  "tokenizer_config.json or chat_template.jinja")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    finally:
        sys.settrace(previous)
