"""The OpenAI error object every route answers with (``{"error": {message, type, param,
code}}``), for the server's routes and the data-parallel router alike, and :class:`ApiError`,
the exception a route raises to answer with one. Imports only FastAPI's JSONResponse."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """An error answered to the client: HTTP ``status``, OpenAI ``type``, ``param``, and extra
    headers (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.headers = headers or {}


_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found",
          413: "request_too_large", 415: "unsupported_media_type", 503: "unavailable"}


def error_body(status: int, message: str, type: str = "invalid_request_error",
               param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object, for a JSON response or an SSE error event; ``code`` is the
    status's name (``_CODES``), else the status number as a string."""
    return {"error": {"message": message, "type": type, "param": param,
                      "code": _CODES.get(status, str(status))}}


def api_error_response(exc: ApiError) -> JSONResponse:
    """``exc`` as an OpenAI error response with its status and headers."""
    return error_response(exc.status, exc.message, exc.type, exc.param, exc.headers)


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """:func:`error_body` as a JSON response with HTTP status ``status``."""
    return JSONResponse(error_body(status, message, type, param), status_code=status,
                        headers=headers)
