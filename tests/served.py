"""A live ``lowbit serve`` app on a loopback port, in a thread of the test process, with a tiny
random model: what the serve tests talk to with the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

from tiny import save_model, tiny_llama

# a tiny chat template, so /v1/chat/completions renders a conversation as a real model's would
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def tiny_checkpoint(path: Path) -> Path:
    # initializer_range 0.3: outputs that change with the context (see tests/test_engine.py)
    model, tok = tiny_llama(hidden=64, layers=2, initializer_range=0.3)
    tok.chat_template = CHAT_TEMPLATE
    return save_model(model, tok, path)


class LiveServer:
    """``build(...)``'s app served by uvicorn on 127.0.0.1 (a free port) until ``stop``."""

    def __init__(self, model, name: str = "tiny", **options):
        import uvicorn

        from lowbit.serve import bind, build

        self.model, self.name = model, name
        self.app, self.worker = build(model, name, **options)
        sock = bind("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def client(self, api_key: str = "unused", **options):
        from openai import OpenAI

        return OpenAI(base_url=self.url, api_key=api_key, max_retries=0, timeout=120, **options)

    def request(self, method: str, path: str, body=None, headers: dict | None = None) -> tuple[int, dict | str]:
        """Raw HTTP (what a client library would never send); the body parsed when it is JSON."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        text = response.read().decode()
        conn.close()
        try:
            return response.status, json.loads(text)
        except json.JSONDecodeError:
            return response.status, text

    def settled(self, timeout: float = 30) -> bool:
        """True once nothing is in flight and every cache block is free again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.worker.metrics.snapshot
            if s["in_flight"] == 0 and s["running"] == 0 and s["waiting"] == 0 and s["blocks_free"] == s["blocks_total"]:
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "the server did not stop"


def metric(text: str, name: str) -> float:
    """One sample's value from a Prometheus text page."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)
