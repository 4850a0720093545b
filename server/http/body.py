"""Request bodies parsed and validated on a worker thread, not on the event loop.

FastAPI parses a declared body on the event loop before the route runs: a 2 MB schema spent
~0.3 s there (json.loads, pydantic, the Unicode check) and every /health and stream on the
server waited. :func:`body_of` is a dependency doing the same work (decoding, see
:func:`_decode`, then ``model_validate``, so errors read as before) with
:func:`asyncio.to_thread`; the loop keeps running between the thread's GIL slices (a C decoder
holds the GIL for a whole call, so the faster one is used).

Errors: 415 for a body that is not JSON by its content-type; invalid JSON or fields raise
RequestValidationError, which the app answers with a 400 naming the field.

FastAPI does not see such a body, so :func:`document_bodies` puts them back into the app's
OpenAPI schema (clients and fuzzers read the request schemas there).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from server.http.errors import ApiError

M = TypeVar("M", bound=BaseModel)


def _decode(raw: bytes) -> Any:
    """JSON ``raw`` as Python data. msgspec first (a 2 MB schema: p50 48 ms holding the GIL,
    json 62 ms: the event loop waits that long); what it refuses (lone surrogates, NaN, numbers out
    of float range, invalid JSON) is decoded again by ``json``, whose result or error the
    validators turn into a 400 naming the field. Raises ValueError."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return json.loads(raw)


def _parse(model: type[M], raw: bytes) -> M:
    try:
        data: Any = _decode(raw)
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

    parse.body_model = model  # type: ignore[attr-defined]  # read by document_bodies
    return parse


def document_bodies(app: FastAPI, routers: Sequence[APIRouter]) -> None:
    """Make ``app.openapi()`` describe the bodies of the ``routers``' routes that take one
    through :func:`body_of` (a requestBody referring to the model under components/schemas)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        bodies = [(route, dep.call.body_model) for router in routers for route in router.routes
                  for dep in getattr(getattr(route, "dependant", None), "dependencies", ())
                  if hasattr(dep.call, "body_model")]
        refs, defs = models_json_schema(
            [(m, "validation") for m in dict.fromkeys(m for _, m in bodies)],
            ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(
            defs.get("$defs", {}))
        for route, model in bodies:
            for method in route.methods:
                schema["paths"][route.path][method.lower()]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": refs[(model, "validation")]}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
