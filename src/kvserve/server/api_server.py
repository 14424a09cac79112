"""The FastAPI application of one engine: routes, error mapping, health and metrics.

Owns the HTTP surface: POST /v1/completions and /v1/chat/completions (delegated to
:class:`OpenAIServing`), GET /v1/models, /health, /metrics, /version, and FastAPI's
/openapi.json. Every error, including invalid JSON and wrong types (FastAPI's 422), leaves as
an OpenAI-style error body; a client that disconnects before its non-streaming response is
ready aborts its requests (streaming responses abort through the SSE generator).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvserve
from kvserve.config import ServerConfig
from kvserve.engine.async_engine import AsyncEngine
from kvserve.server.errors import APIError
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from kvserve.server.serving import OpenAIServing

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse},
    500: {"model": ErrorResponse},
    503: {"model": ErrorResponse},
}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line per offending top-level field (union branches folded), and the first field."""
    by_field: dict[str, list[str]] = {}
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", err.get("msg"))
            return f"Invalid JSON body: {detail}", None
        if not loc and err.get("type") == "missing":
            return "The request body is empty; send a JSON object", None
        if not loc and err.get("type") in ("model_attributes_type", "dict_type"):
            return "The request body must be a JSON object (Content-Type: application/json)", None
        msgs = by_field.setdefault(loc[0] if loc else "", [])
        where = ".".join(loc[1:])
        # Union branches name the branch type in the location, not a position: leave it out.
        msg = str(err.get("msg"))
        msg = f"{where}: {msg}" if where and not where.replace(".", "").isalpha() else msg
        if msg not in msgs:
            msgs.append(msg)
    parts = [f"{f}: {' or '.join(m)}" if f else " or ".join(m) for f, m in by_field.items()]
    param = next((f for f in by_field if f), None)
    return "; ".join(parts) or "Invalid request", param


async def _until_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Await ``work`` unless the client disconnects first (then cancel it: aborts requests)."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():  # client gone: nobody reads this
        return Response(status_code=499)
    return task.result()


def build_app(engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    """The app serving ``engine``; starts the engine thread on startup (idempotent)."""
    config = config or ServerConfig()
    llm = engine.engine
    metrics = ServerMetrics(
        llm.model_name, engine.stats, getattr(llm, "connector", None) is not None
    )
    serving = OpenAIServing(engine, metrics, config.max_n)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield

    app = FastAPI(
        title="kvserve",
        version=kvserve.__version__,
        description="OpenAI-compatible API of one kvserve engine.",
        lifespan=lifespan,
    )
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return APIError(message, 400, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(str(exc.detail), exc.status_code).response()

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(f"internal server error: {exc!r}", 500).response()

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses=_ERRORS,
        summary="Create a completion (SSE when stream is true)",
    )
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await _until_disconnected(request, serving.create_completion(body))

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses=_ERRORS,
        summary="Create a chat completion (SSE when stream is true)",
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await _until_disconnected(request, serving.create_chat_completion(body))

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        card = ModelCard(id=llm.model_name, root=llm.config.model, max_model_len=llm.max_model_len)
        return ModelList(data=[card])

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if engine.is_alive:
            return Response(status_code=200)
        reason = f"engine loop failed: {engine.error!r}" if engine.error else "engine not running"
        return APIError(reason, 503).response()

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvserve.__version__}

    return app
