"""OpenAI-style API errors: the exception the handlers raise and the body clients receive.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}`` with an
HTTP status: 400 for bad input, 401 without a valid API key, 404 for an unknown route or model
(``code`` "model_not_found", as OpenAI and vLLM answer), 405 with ``Allow``, 413 for a body
over the limit, 429 with ``Retry-After`` when the engine's queue is full, 500 when the engine
failed, 503 when it is not running.
"""

from __future__ import annotations

import json

from fastapi.responses import Response

from kvserve.server.protocol import ErrorInfo, ErrorResponse

UNKNOWN_MODEL_STATUS = 404

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """Raised by request handlers; turned into an OpenAI-style error response."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )

    def response(self) -> Response:
        # ASCII JSON: a message quoting client text can always be encoded.
        return Response(
            json.dumps(self.body().model_dump()),
            status_code=self.status,
            headers=self.headers,
            media_type="application/json",
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, param=param, code=code)
