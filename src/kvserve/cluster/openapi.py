"""The OpenAPI document of `kvserve route` (served at GET /openapi.json).

Owns the description of the router's own routes. Request and response bodies of the proxied
API are the engine server's wire models (:mod:`kvserve.server.protocol`, pydantic; imported
when the document is first asked for, so the router starts without them): the router
forwards bodies unchanged, so an engine's schema is the router's. Every error is OpenAI's
shape, ``{"error": {"message", "type", "param", "code"}}`` with ``code`` a string or null.
"""

from __future__ import annotations

from typing import Any

import kvserve

_ERROR_STATUSES = {
    "400": "Malformed or invalid request",
    "401": "Missing or wrong API key",
    "404": "Unknown model (or route)",
    "405": "Method not allowed on this route (see the `Allow` header)",
    "408": "Request not received in time",
    "413": "Request body over the limit",
    "429": "An engine's queue is full (see `Retry-After`)",
    "502": "Every endpoint tried failed",
    "503": "Overloaded or no healthy endpoint (see `Retry-After`)",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors(*codes: str) -> dict[str, Any]:
    return {
        c: {
            "description": _ERROR_STATUSES[c],
            "content": {"application/json": {"schema": _ref("ErrorResponse")}},
        }
        for c in codes
    }


def _proxied(summary: str, request: str, response: str, chunk: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {
                "200": {
                    "description": "The engine's answer, or with `stream: true` its server-sent"
                    f" events (`data: <{chunk}>` lines, then `data: [DONE]`)",
                    "headers": {
                        "x-kvserve-endpoint": {
                            "description": "The endpoint that served the request",
                            "schema": {"type": "string"},
                        }
                    },
                    "content": {
                        "application/json": {"schema": _ref(response)},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors("400", "404", "408", "413", "429", "502", "503"),
            },
        }
    }


def _get(summary: str, content: dict[str, Any], *errors: str) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "responses": {"200": {"description": "OK", "content": content}, **_errors(*errors)},
        }
    }


def router_openapi(secured: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """The document; ``secured``: the paths that need a bearer key."""
    from pydantic.json_schema import models_json_schema

    from kvserve.server import protocol as p

    models = [
        (p.CompletionRequest, "validation"),
        (p.ChatCompletionRequest, "validation"),
        (p.CompletionResponse, "serialization"),
        (p.ChatCompletionResponse, "serialization"),
        (p.ChatCompletionChunk, "serialization"),
        (p.ModelList, "serialization"),
        (p.ErrorResponse, "serialization"),
    ]
    _, top = models_json_schema(models, ref_template="#/components/schemas/{model}")
    schemas = top["$defs"]
    # The router's errors: `code` is a string or null (never an int), as in OpenAI's API.
    schemas["ErrorInfo"]["properties"]["code"] = {"anyOf": [{"type": "string"}, {"type": "null"}]}
    schemas["RouterHealth"] = {
        "type": "object",
        "properties": {
            "status": {"type": "string", "enum": ["ok", "unavailable"]},
            "healthy_endpoints": {"type": "integer"},
        },
        "required": ["status", "healthy_endpoints"],
    }
    json_of = lambda name: {"application/json": {"schema": _ref(name)}}  # noqa: E731
    any_json = {"application/json": {"schema": {"type": "object"}}}
    paths: dict[str, Any] = {
        "/v1/completions": _proxied(
            "Text completion", "CompletionRequest", "CompletionResponse", "CompletionResponse"
        ),
        "/v1/chat/completions": _proxied(
            "Chat completion",
            "ChatCompletionRequest",
            "ChatCompletionResponse",
            "ChatCompletionChunk",
        ),
        "/v1/models": _get("Models the healthy endpoints serve", json_of("ModelList")),
        "/health": _get("Whether any endpoint is healthy (503 if none)", json_of("RouterHealth")),
        "/metrics": _get(
            "Prometheus metrics of the router", {"text/plain": {"schema": {"type": "string"}}}
        ),
        "/router/state": _get("Endpoints, their health and load, the KV index", any_json),
        "/version": _get("kvserve version", any_json),
        "/openapi.json": _get("This document", any_json),
    }
    paths["/health"]["get"]["responses"]["503"] = {
        "description": "No healthy endpoint",
        "content": json_of("RouterHealth"),
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "kvserve router", "version": kvserve.__version__},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in paths.items():
            if path in secured:
                for op in item.values():
                    op["security"] = [{"bearer": []}]
                    op["responses"].update(_errors("401"))
    return doc
