"""The HTTP side: a Starlette app speaking the OpenAI API over an :class:`EngineWorker`.

Handlers never touch the engine: they check the body (``protocol``), hand the work to the worker
and read its job's events. A streaming response is started only once the engine took the request,
so a refused one gets its real status (400, 413, 503) instead of a 200 and a broken stream. A client
that disconnects (mid-stream, or while its request waits) aborts it, which frees its cache blocks.

Hostile input keeps the event loop free: a body is read up to ``max_body_bytes`` (a larger declared
length is a 413 before any of it is read), and the chat template (code from the model's files) and the
tokenizer run in threads, the template under a time limit. ``/health`` and ``/metrics`` need no API key,
as vLLM's do: they say how busy the server is, never what it was asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from lowbit.chat_template import RENDER_TIME_LIMIT_S
from lowbit.serve import protocol
from lowbit.serve.protocol import APIError
from lowbit.serve.worker import EngineWorker, Job

log = logging.getLogger("lowbit.serve")
MAX_BODY_BYTES = 4 << 20  # 4 MiB: about a million tokens of text, past any context this serves


def error_response(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def create_app(worker: EngineWorker, model_name: str, api_key: str | None = None,
               aliases: tuple[str, ...] = (), max_body_bytes: int = MAX_BODY_BYTES,
               render_time_limit: float = RENDER_TIME_LIMIT_S) -> Starlette:
    """The app; its lifespan starts the worker and, at shutdown (after the server drained the open
    connections), stops it. ``aliases``: other names a request may give for the model (its path).
    ``max_body_bytes``: larger request bodies get a 413; ``render_time_limit``: seconds a chat template
    may run (past it: a 400 naming the template)."""
    names = {model_name, *aliases}

    def authorize(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if api_key is not None and not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")

    def check_model(work: protocol.Work) -> None:
        if work.model is not None and work.model not in names:
            raise APIError(404, f"the model '{work.model}' does not exist here; this server serves '{model_name}'",
                           param="model", code="model_not_found")

    async def body_of(request: Request):
        return parse_json(await read_body(request, max_body_bytes))

    async def completions(request: Request) -> Response:
        authorize(request)
        work = protocol.completion_work(await body_of(request))
        check_model(work)
        return await run_work(request, work)

    async def chat_completions(request: Request) -> Response:
        authorize(request)
        body = await body_of(request)
        work = await asyncio.to_thread(protocol.chat_work, body, worker.engine.model.tokenizer, render_time_limit)
        check_model(work)
        return await run_work(request, work)

    async def run_work(request: Request, work: protocol.Work) -> Response:
        started = time.perf_counter()
        ids = await asyncio.to_thread(worker.prompt_ids, work)  # a long prompt tokenizes beside the loop
        job = worker.submit(work, ids)  # a refusal (400, 413, 503) raises here, before any response starts
        if work.stream:
            return StreamingResponse(sse(job, started), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await whole(request, job, started)

    async def whole(request: Request, job: Job, started: float) -> Response:
        try:
            text, finish, counts = await until_disconnect(request, job, collect(job))
        except BaseException:
            worker.abort(job)
            raise
        log_request(job, finish, counts, started)
        return JSONResponse(protocol.full_response(job.work, model_name, text, finish, counts))

    async def sse(job: Job, started: float):
        work, finished = job.work, False
        try:
            if work.chat:  # the role comes first, as OpenAI sends it
                yield _event(protocol.chunk(work, model_name, None, first=True))
            while True:
                event = await job.events.get()
                if event[0] == "delta":
                    if event[1]:
                        yield _event(protocol.chunk(work, model_name, event[1]))
                elif event[0] == "error":
                    yield _event(event[1].body())
                    finished = True
                    break
                else:
                    _, finish, counts = event
                    finished = True
                    yield _event(protocol.chunk(work, model_name, None if work.chat else "", finish))
                    if work.include_usage:
                        yield _event(protocol.usage_chunk(work, model_name, counts))
                    log_request(job, finish, counts, started)
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # cancelled: the client went away mid-stream
                worker.abort(job)

    async def models(request: Request) -> Response:
        authorize(request)
        card = {"id": model_name, "object": "model", "created": int(started_at), "owned_by": "lowbit",
                "max_model_len": worker.context, "kv_cache": worker.engine.scheme.name if worker.engine.cache else None}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        alive = worker.engine.cache is not None
        return JSONResponse({"status": "ok" if alive else "stopped"}, status_code=200 if alive else 503)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(worker.metrics.render(), media_type="text/plain; version=0.0.4")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        await asyncio.to_thread(worker.close)

    started_at = time.time()
    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    handlers = {APIError: _api_error, ClientGone: _client_gone, HTTPException: _http_error, Exception: _internal_error}
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)


async def collect(job: Job) -> tuple[str, str, dict]:
    """A job's whole text, finish reason and usage, once it ends."""
    pieces = []
    while True:
        event = await job.events.get()
        if event[0] == "delta":
            pieces.append(event[1])
        elif event[0] == "error":
            raise event[1]
        else:
            return "".join(pieces), event[1], event[2]


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, or a 413 once it is longer than ``limit`` bytes: at once when its declared
    length is, else when that much has arrived (a chunked body), never holding more than ``limit``."""
    declared = request.headers.get("content-length", "")
    too_long = APIError(413, f"the request body is larger than this server's limit of {limit:,} bytes "
                             "(lowbit serve --max-body)", code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_long
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_long
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone(f"the client disconnected after sending {size:,} bytes of its request body") from None
    return b"".join(chunks)


def parse_json(data: bytes):
    try:
        return json.loads(data)
    except RecursionError:  # the parser recurses once per level: 100,000 nested brackets
        raise APIError(400, "the request body nests JSON too deeply", code="invalid_json") from None
    except ValueError as e:  # bad JSON, bad UTF-8, an integer of more than 4,300 digits
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


async def until_disconnect(request: Request, job: Job, awaitable):
    """``awaitable``'s result, or ClientGone if the client disconnects first."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ClientGone(f"the client of request {job.work.id} disconnected")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def log_request(job: Job, finish: str, counts: dict, started: float) -> None:
    work, r = job.work, job.request
    ttft = r.metrics.ttft_s
    log.info("request %s %s%s: %d prompt + %d output tokens, %s, TTFT %s, %.3f s", work.id,
             "chat" if work.chat else "completion", " stream" if work.stream else "", counts["prompt_tokens"],
             counts["completion_tokens"], finish, f"{ttft * 1000:.0f} ms" if ttft is not None else "-",
             time.perf_counter() - started)


async def _api_error(request: Request, e: APIError) -> Response:
    log.info("%s %s: %d %s%s", request.method, request.url.path, e.status, e.message,
             f" (param {e.param})" if e.param else "")
    return error_response(e)


async def _client_gone(request: Request, e: ClientGone) -> Response:
    log.info("%s %s: %s", request.method, request.url.path, e)  # one line: a client going away is no fault here
    return Response(status_code=499)  # nobody reads it: nginx's "client closed request"


async def _http_error(request: Request, e: HTTPException) -> Response:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=kind))


async def _internal_error(request: Request, e: Exception) -> Response:
    log.exception("request failed")
    return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error",
                                   kind="server_error"))
