"""The OpenAI-compatible HTTP API in front of an EngineClient (FastAPI, served by uvicorn).

    POST /v1/chat/completions   POST /v1/completions     (SSE when "stream": true)
    GET  /v1/models             GET  /health              GET /metrics (Prometheus, vLLM names)

Every refusal is an OpenAI error object with its status: 400 (malformed JSON, bad
sampling values, a prompt past max_model_len), 401 (a missing or wrong API key), 404
(an unknown model or path), 413 (a body over `max_body_bytes`). A surprise is a 500 with
one line, never a traceback; no request can stop the engine. /health is 200 while the
engine serves and 503, saying why, once it stopped (an engine process that died). With an
API key, every path but /health needs `Authorization: Bearer KEY`, compared in constant time.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged_chat.engine.clients.protocol import EngineClient
from paged_chat.engine.errors import EngineDeadError, describe_error
from paged_chat.engine.request import RequestOutput
from paged_chat.server.metrics import metrics_registry
from paged_chat.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from paged_chat.server.serving import ApiError, Job, OpenAIServing

MAX_BODY_BYTES = 4 * 2**20
logger = logging.getLogger("paged_chat.server")
Parsed = TypeVar("Parsed", bound=BaseModel)


def build_app(client: EngineClient, model_names: Sequence[str] = (), api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, defaults: dict[str, Any] | None = None
              ) -> FastAPI:
    """The API for `client`'s model; requests may name it by its own name or by any of
    `model_names` (e.g. the spec it was loaded from). `defaults` are the sampling values a
    request that omits them gets (`serve`: the `[chat]` settings, as `ask`'s), listed per
    model in /v1/models as `sampling_defaults`."""
    names = list(dict.fromkeys([client.info.name, *model_names]))
    serving = OpenAIServing(client, names, defaults)
    registry = metrics_registry(client, serving.model)
    expected = f"Bearer {api_key}".encode() if api_key else None

    def authorize(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if expected is not None and not hmac.compare_digest(given, expected):
            raise ApiError(401, "a valid API key is required: send `Authorization: Bearer KEY`")

    app = FastAPI(title="paged-chat", docs_url=None, redoc_url=None, openapi_url=None)
    guarded = [Depends(authorize)]

    @app.get("/health")
    async def health() -> Response:
        if client.running:
            return Response(status_code=200)
        reason = client.last_error or "it was shut down"
        return JSONResponse(error_body(f"the engine is not running: {reason}", 503),
                            status_code=503)

    @app.get("/metrics", dependencies=guarded)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        info = client.info
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "paged-chat",
             "root": info.name, "max_model_len": info.max_model_len,
             "sampling_defaults": serving.defaults} for name in names]}

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest, max_body_bytes)
        return await _respond(serving, request, serving.chat_job(body))

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest, max_body_bytes)
        return await _respond(serving, request, serving.completion_job(body))

    _add_error_handlers(app)
    return app


async def _parse(request: Request, model: type[Parsed], limit: int) -> Parsed:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is over the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body is over the limit of {limit} bytes")
    return model.model_validate_json(bytes(body))


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
    requests) and so is the handler."""
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
        raise asyncio.CancelledError("the client disconnected")
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

    app.add_exception_handler(StarletteHTTPException, http_error)
    for kind in (ApiError, ValueError, EngineDeadError):
        app.add_exception_handler(kind, api_error)
    app.add_exception_handler(Exception, api_error)
