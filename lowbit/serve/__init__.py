"""``lowbit serve``: an OpenAI-compatible HTTP server over the runtime's engine.

``protocol`` (the wire format), ``worker`` (the engine's thread and its queue), ``metrics``
(Prometheus text), ``app`` (the Starlette routes), ``server`` (loading, start-up, uvicorn).
Starlette and uvicorn are the ``serve`` extra: importing this package needs them.
"""

from lowbit.serve.app import create_app
from lowbit.serve.server import bind, build, serve
from lowbit.serve.worker import EngineWorker

__all__ = ["EngineWorker", "bind", "build", "create_app", "serve"]
