"""API keys of the engine server: where they come from and the bearer check (ASGI middleware).

As in vLLM: with keys configured, every ``/v1/*`` request needs ``Authorization: Bearer <key>``
matching one of them, else 401 in OpenAI's error shape (``code`` "invalid_api_key"). Other
paths are open unless ``api_key_all_endpoints`` (then everything but ``/health`` needs it).
Keys are compared as SHA-256 digests with :func:`hmac.compare_digest`, against every key, so
the time taken says nothing about how much of a key matched.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.server.errors import APIError

# Environment variables holding a key, read when no --api-key is given (vLLM's name first).
API_KEY_ENV_VARS = ("VLLM_API_KEY", "KVSERVE_API_KEY")
OPEN_PATHS = frozenset({"/health"})


def resolve_api_keys(
    flag_keys: Iterable[str] | None, environ: Mapping[str, str] | None = None
) -> list[str]:
    """The keys a server accepts: the ``--api-key`` flags, else the environment's keys."""
    keys = [k for k in (flag_keys or ()) if k]
    if keys:
        return keys
    environ = os.environ if environ is None else environ
    return list(dict.fromkeys(environ[v] for v in API_KEY_ENV_VARS if environ.get(v)))


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeyMiddleware:
    """Refuses requests without a valid bearer key before the app reads their body."""

    def __init__(self, app: ASGIApp, api_keys: Iterable[str], all_endpoints: bool = False):
        self.app = app
        self._digests = [_digest(k.encode()) for k in api_keys]
        self.all_endpoints = all_endpoints

    def _guarded(self, path: str) -> bool:
        if path in OPEN_PATHS:
            return False
        return self.all_endpoints or path == "/v1" or path.startswith("/v1/")

    def _authorized(self, scope: Scope) -> bool:
        header = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return False
        digest = _digest(token.strip())
        ok = False
        for d in self._digests:  # no early exit
            ok |= hmac.compare_digest(digest, d)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or not self._digests
            or not self._guarded(scope["path"])
            or self._authorized(scope)
        ):
            await self.app(scope, receive, send)
            return
        has_header = any(n == b"authorization" for n, _ in scope.get("headers", ()))
        message = (
            "Incorrect API key provided."
            if has_header
            else "Missing API key: send it as 'Authorization: Bearer <key>'."
        )
        error = APIError(
            message, 401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
        await error.response()(scope, receive, send)
