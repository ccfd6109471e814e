"""The OpenAI-compatible HTTP API in front of an EngineClient (FastAPI, served by uvicorn).

    POST /v1/chat/completions   POST /v1/completions     (SSE when "stream": true)
    GET  /v1/models             GET  /health              GET /metrics (Prometheus, vLLM names)

Every refusal is an OpenAI error object with its status: 400 (malformed JSON, bad
sampling values, a prompt past max_model_len), 401 (a missing or wrong API key), 403 (on
a keyless server, a Host or Origin that is not this machine's: guards.py), 404 (an unknown
model or path), 413 (a body over `max_body_bytes`, by default sized from the model's
context), 415 (on a keyless server, a body that is not JSON). A surprise is a 500 with
one line, never a traceback; no request can stop the engine. /health is 200 while the
engine serves and 503, saying why, once it stopped (an engine process that died) or while
it does not respond (its process stopped or hung). With an
API key, every path but /health needs `Authorization: Bearer KEY`, compared in constant time.

The event loop only moves bytes: a body is refused by its size before it is parsed, and
parsing, the chat template and tokenizing run on a worker thread, so one huge request
never stalls /health or the streams of others. A client that hangs up before its body is
in, or before its reply is ready, costs one log line.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from paged_chat.engine.clients.client_protocol import EngineClient
from paged_chat.engine.core.errors import EngineDeadError, describe_error
from paged_chat.engine.core.outputs import RequestOutput
from paged_chat.server.api_types import ChatCompletionRequest, CompletionRequest, error_body
from paged_chat.server.guards import LocalOnlyGuard, normalize_origin
from paged_chat.server.metrics import metrics_registry
from paged_chat.server.serving import ApiError, Job, OpenAIServing, cache_partition
from paged_chat.server.tool_calls import DefaultToolChoice

# A body may hold this many bytes per token of the model's context (a token's JSON is ~4
# characters, ~12 escaped: a wide margin), and 1 MiB whatever the context.
BODY_BYTES_PER_TOKEN = 64
MIN_BODY_BYTES = 2**20
logger = logging.getLogger("paged_chat.server")
Parsed = TypeVar("Parsed", bound=BaseModel)


class ClientLeft(Exception):
    """The client hung up before its reply was ready; its engine requests were aborted."""


def build_app(client: EngineClient, model_names: Sequence[str] = (), api_key: str | None = None,
              max_body_bytes: int | None = None, allowed_origins: Sequence[str] = (),
              share_cache_with_tui: bool = False, defaults: dict[str, Any] | None = None,
              tool_choice: DefaultToolChoice = "auto") -> FastAPI:
    """The API for `client`'s model; requests may name it by its own name or by any of
    `model_names` (e.g. the spec it was loaded from). `allowed_origins`: web origins a
    keyless server takes besides loopback ones (guards.py). `share_cache_with_tui`: API
    requests may hit the cached prefixes of requests that do not come through the API (a
    TUI's tabs under `--serve`); by default they never do (serving.cache_partition).
    `defaults` are the sampling values a request that omits them gets (`serve`: the model's
    generation config, else the `[chat]` settings, as `ask`'s), listed per model in
    /v1/models as `sampling_defaults`; `tool_choice` that of a request with tools that
    omits it (tool_calls.default_tool_choice), listed there as `tool_choice_default`."""
    names = list(dict.fromkeys([client.info.name, *model_names]))
    serving = OpenAIServing(client, names, cache_partition(api_key, share_cache_with_tui),
                            defaults, tool_choice)
    context = client.info.max_model_len
    limit = max_body_bytes or max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * context)
    too_large = f"the request body is over this server's limit of {limit} bytes" + (
        "" if max_body_bytes else f" (sized from the model's context of {context} tokens)")
    registry = metrics_registry(client, serving.model)
    expected = f"Bearer {api_key}".encode() if api_key else None

    def authorize(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if expected is not None and not hmac.compare_digest(given, expected):
            raise ApiError(401, "a valid API key is required: send `Authorization: Bearer KEY`")

    app = FastAPI(title="paged-chat", docs_url=None, redoc_url=None, openapi_url=None)
    origins = [normalize_origin(origin) for origin in allowed_origins]  # a bad one fails here
    app.add_middleware(LocalOnlyGuard, allowed_origins=origins, keyless=api_key is None)
    guarded = [Depends(authorize)]

    @app.get("/health")
    async def health() -> Response:
        if not client.running:
            reason = client.last_error or "it was shut down"
            return JSONResponse(error_body(f"the engine is not running: {reason}", 503),
                                status_code=503)
        if client.capabilities.restart and not client.responding:
            return JSONResponse(error_body("the engine is not responding: its process is "
                                           "stopped or hung", 503), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics", dependencies=guarded)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        info = client.info
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "paged-chat",
             "root": info.name, "max_model_len": info.max_model_len,
             "sampling_defaults": serving.defaults,
             "tool_choice_default": serving.tool_choice} for name in names]}

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        body = await _body(request, limit, too_large)
        job = await _job_off_loop(serving.chat_job, ChatCompletionRequest, body)
        return await _respond(serving, request, job)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        body = await _body(request, limit, too_large)
        job = await _job_off_loop(serving.completion_job, CompletionRequest, body)
        return await _respond(serving, request, job)

    _add_error_handlers(app)
    return app


async def _body(request: Request, limit: int, too_large: str) -> bytes:
    """The request's body, refused (413) once it is declared or read past `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, too_large)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, too_large)
    return bytes(body)


async def _job_off_loop(make_job: Callable[[Parsed], Job], model: type[Parsed], body: bytes) -> Job:
    """The body parsed as `model` and made a Job (chat template, tokenizer) on a worker thread."""
    return await asyncio.to_thread(lambda: make_job(model.model_validate_json(body)))


async def _respond(serving: OpenAIServing, request: Request, job: Job) -> Response:
    """The whole body, or an SSE stream that starts once the first delta is in (so a
    request the engine refuses gets its status, not a 200 with an error inside)."""
    if not job.stream:
        return JSONResponse(await _unless_disconnected(request, serving.complete(job)))
    outputs = serving.outputs(job)
    try:
        first = await _unless_disconnected(request, anext(outputs))
    except BaseException:
        await outputs.aclose()
        raise
    return EventSourceResponse(_sse(serving.chunks(job, _prepend(first, outputs))))


async def _prepend(first: tuple[int, RequestOutput], rest: AsyncIterator[tuple[int, RequestOutput]]
                   ) -> AsyncIterator[tuple[int, RequestOutput]]:
    async with aclosing(rest):
        yield first
        async for item in rest:
            yield item


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """SSE events of the chunks, then `[DONE]`; an error mid-stream is an error event (the
    headers are gone), as vLLM sends it."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield format_sse_event(data_str=json.dumps(chunk))
    except Exception as error:
        status, message = _status(error)
        yield format_sse_event(data_str=json.dumps(error_body(message, status)))
    yield format_sse_event(data_str="[DONE]")


Result = TypeVar("Result")


async def _unless_disconnected(request: Request, work: Awaitable[Result]) -> Result:
    """`work`'s result; if the client leaves first, `work` is cancelled (aborting its engine
    requests) and ClientLeft raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        raise ClientLeft
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _status(error: Exception) -> tuple[int, str]:
    """The status and one line for an error."""
    if isinstance(error, ApiError):
        return error.status, error.message
    if isinstance(error, ValidationError):
        return 400, "; ".join(_validation_line(item) for item in error.errors())
    if isinstance(error, ValueError):
        return 400, str(error)
    if isinstance(error, EngineDeadError):
        return 503, str(error)
    logger.error("unexpected error serving a request: %s", describe_error(error))
    return 500, describe_error(error)


def _validation_line(item: dict[str, Any]) -> str:
    where = ".".join(str(part) for part in item["loc"])
    return f"{where}: {item['msg']}" if where else item["msg"]


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, error: Exception) -> JSONResponse:
        status, message = _status(error)
        param = error.param if isinstance(error, ApiError) else None
        return JSONResponse(error_body(message, status, param), status_code=status)

    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(error.detail), error.status_code),
                            status_code=error.status_code)

    async def client_gone(request: Request, error: ClientDisconnect) -> Response:
        logger.warning("a client hung up before its request body was in: %s %s",
                       request.method, request.url.path)
        return Response(status_code=400)  # nobody reads it

    async def client_left(request: Request, error: ClientLeft) -> Response:
        logger.warning("a client hung up before its reply was ready: %s %s",
                       request.method, request.url.path)
        return Response(status_code=400)  # nobody reads it

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(ClientDisconnect, client_gone)
    app.add_exception_handler(ClientLeft, client_left)
    for kind in (ApiError, ValueError, EngineDeadError):
        app.add_exception_handler(kind, api_error)
    app.add_exception_handler(Exception, api_error)
