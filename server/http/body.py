"""Request bodies parsed and validated on a worker thread, not on the event loop.

FastAPI parses a declared body on the event loop before the route runs: a 2 MB schema spent
~0.3 s there (json.loads, pydantic, the Unicode check) and every /health and stream on the
server waited. :func:`body_of` is a dependency doing the same work (``json.loads`` then
``model_validate``, so errors read as before) with :func:`asyncio.to_thread`; the loop keeps
running between the thread's GIL slices.

Errors: 415 for a body that is not JSON by its content-type; invalid JSON or fields raise
RequestValidationError, which the app answers with a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from server.http.tokenizer_manager import ApiError

M = TypeVar("M", bound=BaseModel)


def _parse(model: type[M], raw: bytes) -> M:
    try:
        data: Any = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",),
                                       "msg": f"the body is not valid JSON ({exc})"}]) from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]) from exc


def body_of(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A FastAPI dependency returning the request's body as ``model``."""
    async def parse(request: Request) -> M:
        ctype = request.headers.get("content-type", "application/json").split(";")[0]
        if "json" not in ctype.strip().lower():
            raise ApiError(415, f"the body must be JSON (content-type application/json), not "
                           f"{ctype.strip()!r}", param=None)
        return await asyncio.to_thread(_parse, model, await request.body())

    return parse
