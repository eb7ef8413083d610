"""Loading the checkpoint, binding the address, the start-up banner, and running uvicorn until a
SIGTERM (or Ctrl-C): uvicorn then stops accepting connections and waits for the open ones, so
running requests finish; the app's lifespan then stops the engine thread, and the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
from pathlib import Path

log = logging.getLogger("lowbit.serve")


def build(model, model_name: str, kv_memory=None, max_batch: int = 32, max_queue: int = 256,
          api_key: str | None = None, aliases: tuple[str, ...] = (), max_body_bytes: int | None = None,
          render_time_limit: float | None = None, **engine_options):
    """``(app, worker)`` for a loaded ``runtime.Model``: what ``serve`` runs, and what tests run in-process.
    ``max_body_bytes`` and ``render_time_limit``: ``create_app``'s (None: its defaults)."""
    from lowbit.serve.app import create_app
    from lowbit.serve.worker import EngineWorker
    from runtime.engine import Engine

    if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
        raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
    engine = Engine(model, kv_memory=kv_memory, max_batch=max_batch, **engine_options)
    worker = EngineWorker(engine, max_queue=max_queue)
    limits = {k: v for k, v in (("max_body_bytes", max_body_bytes), ("render_time_limit", render_time_limit))
              if v is not None}
    return create_app(worker, model_name, api_key=api_key, aliases=aliases, **limits), worker


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free one), bound before the banner so it prints the real port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror} (is another server on that port? try --port)") from None
    sock.listen(2048)
    return sock


def banner(worker, model_name: str, model, host: str, port: int, api_key) -> str:
    engine = worker.engine
    stats = engine.stats()
    shown = f"[{host}]" if ":" in host else host
    return "\n".join([
        f"lowbit serve: http://{shown}:{port}/v1  (OpenAI API; /health, /metrics)",
        f"  model      {model_name}  ({model.path}, {model.device}, {str(model.dtype).removeprefix('torch.')})",
        f"  KV cache   {engine.scheme.name}: {stats['kv_budget_bytes'] / 2**20:,.1f} MiB, {stats['num_blocks']} blocks "
        f"of {stats['block_size']} tokens",
        f"  fits       {engine.sequences_at(engine.max_len)} sequences of the full context ({engine.max_len} tokens) "
        f"at once; --max-batch {stats['max_batch']} running, --max-queue {worker.max_queue} waiting",
        f"  auth       {'API key required on /v1' if api_key else 'none (set LOWBIT_API_KEY to require one)'}; "
        "/health and /metrics are open",
    ])


def serve(ckpt: str, host: str = "127.0.0.1", port: int = 8000, kv: str | None = None, kv_memory=None,
          max_batch: int = 32, max_queue: int = 256, api_key: str | None = None,
          max_body_bytes: int | None = None, device: str | None = None) -> None:
    import uvicorn

    import runtime
    from lowbit.pipeline import default_device

    _exit_cleanly_on_sigterm()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    model = runtime.load(ckpt, device=default_device(device), kv=kv)
    name = Path(ckpt).name or str(ckpt)
    app, worker = build(model, name, kv_memory=kv_memory, max_batch=max_batch, max_queue=max_queue,
                        api_key=api_key, aliases=(str(ckpt),), max_body_bytes=max_body_bytes)
    sock = bind(host, port)
    print(banner(worker, name, model, host, sock.getsockname()[1], api_key), file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=None)
    uvicorn.Server(config).run(sockets=[sock])
    log.info("lowbit serve: drained and stopped")


def _exit_cleanly_on_sigterm() -> None:
    """uvicorn handles SIGTERM while it runs (drain, then stop) and raises it again afterwards: this
    handler makes that, or a SIGTERM during loading, a clean exit 0."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
