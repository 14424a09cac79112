"""The FastAPI application of one engine: routes, request bodies, error mapping, health, metrics.

Owns the HTTP surface: POST /v1/completions and /v1/chat/completions (delegated to
:class:`OpenAIServing`), GET /v1/models, /health, /metrics, /version, and /openapi.json.
Generation bodies are read here, not by FastAPI: at most ``max_request_body_bytes`` (else
413), decoded by msgspec (strict JSON: a lone UTF-16 surrogate, NaN or a nesting too deep is
a 400, never a 500), checked against the request limits, then validated by pydantic. Every
error leaves as an OpenAI-style error body (405 with ``Allow``); a client that disconnects
before its non-streaming response is ready aborts its requests (streaming responses abort
through the SSE generator). With API keys configured, :class:`ApiKeyMiddleware` checks them
before any body is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvserve
from kvserve.config import ServerConfig
from kvserve.engine.core_client import EngineClient
from kvserve.server.admission import AdmissionControl
from kvserve.server.auth import ApiKeyMiddleware
from kvserve.server.errors import APIError
from kvserve.server.limits import RequestLimits, max_prompt_chars
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from kvserve.server.serving import OpenAIServing
from kvserve.server.tokenizer_pool import TokenizerPool
from kvserve.server.tokenizer_worker import malloc_trim

logger = logging.getLogger(__name__)

# After a request body this large, freed memory is handed back to the OS (malloc_trim).
_TRIM_AFTER_BYTES = 1 << 20
# \uD800-\uDBFF not followed by \uDC00-\uDFFF, or the latter without the former.
_LONE_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


def _error(status: int, description: str) -> dict[str, Any]:
    return {"description": description, "model": ErrorResponse}


_GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _error(400, "Invalid request (the error names the parameter)"),
    401: _error(401, "Missing or wrong API key (when the server has keys)"),
    404: _error(404, "Unknown model (code model_not_found)"),
    413: _error(413, "Request body over --max-request-body-bytes"),
    429: _error(429, "The engine's queue is full; retry after Retry-After seconds"),
    500: _error(500, "The engine failed"),
    503: _error(503, "The engine is not running"),
}


def _sse_response(chunk: type[BaseModel], what: str) -> dict[int | str, dict[str, Any]]:
    """The 200 response: JSON, or with ``stream: true`` server-sent events."""
    return {
        200: {
            "description": f"The {what} (JSON), or with stream=true a text/event-stream of "
            f"`data: <{chunk.__name__} JSON>` events ending with `data: [DONE]`",
            "content": {
                "text/event-stream": {
                    "schema": {"type": "string", "description": f"SSE of {chunk.__name__}"}
                }
            },
        },
        **_GENERATION_ERRORS,
    }


def _validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """One line per offending top-level field (union branches folded), and the first field."""
    by_field: dict[str, list[str]] = {}
    for err in errors:
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


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, at most ``limit`` bytes (413 as soon as it is known to be more)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestLimits(max_request_body_bytes=limit).body_too_large(int(declared))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestLimits(max_request_body_bytes=limit).body_too_large(size)
        chunks.append(chunk)
    return b"".join(chunks)


def _decode_json(body: bytes) -> dict[str, Any]:
    if not body.strip():
        raise APIError("The request body is empty; send a JSON object")
    try:
        data = msgspec.json.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        message = f"Invalid JSON body: {exc}"
        if _LONE_SURROGATE.search(body):
            message += " (a lone UTF-16 surrogate such as \\ud800 is not valid text)"
        raise APIError(message) from None
    except RecursionError:
        raise APIError("Invalid JSON body: nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError("The request body must be a JSON object (Content-Type: application/json)")
    return data


def _validate(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = _validation_message(exc.errors())
        raise APIError(message, 400, param=param) from None


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


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def build_app(engine: EngineClient, config: ServerConfig | None = None) -> FastAPI:
    """The app serving ``engine`` (on a thread of this process, or in an engine-core process);
    starts the engine thread on startup (idempotent)."""
    config = config or ServerConfig()
    metrics = ServerMetrics(engine.model_name, engine.stats, engine.has_connector)
    limits = RequestLimits.from_config(config)
    tokenizer_dir = engine.config.tokenizer or engine.config.model
    tokenizers = TokenizerPool.acquire(engine.tokenizer, tokenizer_dir, config.tokenizer_workers)
    admission = AdmissionControl(engine, engine.config.max_num_seqs, config.max_waiting_requests)
    serving = OpenAIServing(
        engine,
        metrics,
        tokenizers,
        admission,
        max_prompt_chars(engine.tokenizer, engine.max_model_len),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            tokenizers.release()

    app = FastAPI(
        title="kvserve",
        version=kvserve.__version__,
        description="OpenAI-compatible API of one kvserve engine.",
        lifespan=lifespan,
    )
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.serving = serving
    app.state.tokenizers = tokenizers
    app.state.admission = admission
    app.state.limits = limits
    if config.api_key:
        app.add_middleware(
            ApiKeyMiddleware, api_keys=config.api_key, all_endpoints=config.api_key_all_endpoints
        )

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(list(exc.errors()))
        return APIError(message, 400, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return APIError(str(exc.detail), exc.status_code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return APIError(f"internal server error: {exc!r}", 500).response()

    async def generate(request: Request, model: type[BaseModel], check: Any, run: Any) -> Response:
        body = b""
        try:
            try:
                body = await _read_body(request, limits.max_request_body_bytes)
                data = _decode_json(body)
                check(data)
                req = _validate(model, data)
                del data
                return await _until_disconnected(request, run(req))
            except APIError as exc:
                metrics.request_rejected(exc.status)
                raise
        finally:
            if len(body) >= _TRIM_AFTER_BYTES:
                del body
                await asyncio.get_running_loop().run_in_executor(None, malloc_trim)

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses=_sse_response(CompletionResponse, "completion"),
        summary="Create a completion (SSE when stream is true)",
        openapi_extra=_body_schema(CompletionRequest),
    )
    async def create_completion(request: Request) -> Response:
        return await generate(
            request,
            CompletionRequest,
            lambda d: limits.check_completion(d, engine.max_model_len),
            serving.create_completion,
        )

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses=_sse_response(ChatCompletionChunk, "chat completion"),
        summary="Create a chat completion (SSE when stream is true)",
        openapi_extra=_body_schema(ChatCompletionRequest),
    )
    async def create_chat_completion(request: Request) -> Response:
        return await generate(
            request, ChatCompletionRequest, limits.check_chat, serving.create_chat_completion
        )

    @app.get("/v1/models", response_model=ModelList, responses={401: _GENERATION_ERRORS[401]})
    async def list_models() -> ModelList:
        card = ModelCard(
            id=engine.model_name, root=engine.config.model, max_model_len=engine.max_model_len
        )
        return ModelList(data=[card])

    @app.get(
        "/health",
        responses={
            200: {
                "description": "The engine runs",
                "content": {"application/json": {"example": {"status": "ok"}}},
            },
            503: _error(503, "The engine loop failed or is not running"),
        },
    )
    async def health() -> Response:
        if engine.is_alive:
            return Response(b'{"status":"ok"}', media_type="application/json")
        reason = f"engine loop failed: {engine.error!r}" if engine.error else "engine not running"
        return APIError(reason, 503).response()

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvserve.__version__}

    def openapi() -> dict[str, Any]:
        """FastAPI's schema plus the two request bodies this app reads itself."""
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                tree = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(tree.pop("$defs", {}))
                components[model.__name__] = tree
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
