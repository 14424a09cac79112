"""OpenAI-style API errors: the exception the handlers raise and the body clients receive.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}`` with an
HTTP status: 400 for bad input (including an unknown model, see
:data:`UNKNOWN_MODEL_STATUS`), 500 when the engine failed, 503 when it is not running.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from kvserve.server.protocol import ErrorInfo, ErrorResponse

# OpenAI and vLLM answer an unknown model with 404; the kvserve issue groups it with the other
# bad inputs (400). We follow the issue; ``code`` is "model_not_found" either way so clients
# can tell it apart.
UNKNOWN_MODEL_STATUS = 400

_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
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
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, param=param, code=code)
