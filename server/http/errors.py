"""The OpenAI error object every route answers with (``{"error": {message, type, param,
code}}``), for the server's routes and the data-parallel router alike. Imports only FastAPI's
JSONResponse."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found",
          413: "request_too_large", 415: "unsupported_media_type", 503: "unavailable"}


def error_body(status: int, message: str, type: str = "invalid_request_error",
               param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object, for a JSON response or an SSE error event; ``code`` is the
    status's name (``_CODES``), else the status number as a string."""
    return {"error": {"message": message, "type": type, "param": param,
                      "code": _CODES.get(status, str(status))}}


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """:func:`error_body` as a JSON response with HTTP status ``status``."""
    return JSONResponse(error_body(status, message, type, param), status_code=status,
                        headers=headers)
