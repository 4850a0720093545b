"""create_app(...): the FastAPI application (no module globals; everything hangs off app.state).

Every error is OpenAI-shaped JSON ``{"error": {message, type, param, code}}``: invalid bodies
are 400 (never FastAPI's 422), unknown routes 404, bodies over the limit 413 before they are
parsed, a missing API key 401.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.http import (
    embedding_routes,
    lora_routes,
    native_routes,
    openai_routes,
    ops_routes,
    rerank_routes,
    responses_routes,
)
from server.http.auth import APIKeyMiddleware
from server.http.body import document_bodies
from server.http.drain import Drain, DrainGate
from server.http.errors import ApiError, api_error_response, error_response
from server.http.responses_items import ResponseStore
from server.http.tokenizer_manager import TokenizerManager


class BodySizeLimit:
    """Pure-ASGI middleware: 413 when Content-Length, or the bytes actually received, exceed
    ``max_bytes``, before any route parses the body. A body without Content-Length (chunked
    transfer encoding) is read here, up to ``max_bytes``, and replayed to the app; events
    after the body (a client disconnect) pass through untouched."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        """ASGI entry point (one HTTP request or lifespan event)."""
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = error_response(413, f"body over {self.max_bytes} bytes")
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None:  # the HTTP parser holds the client to the length it declared
            if length.isdigit() and int(length) > self.max_bytes:
                return await too_big(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks, seen = [], 0
        while True:
            event = await receive()
            if event["type"] != "http.request":  # gone before the body ended: nothing to serve
                return None
            chunks.append(event.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_bytes:
                return await too_big(scope, receive, send)
            if not event.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def create_app(manager: TokenizerManager, *, model_name: str, model_path: str | None,
               api_key: str | None = None, max_body_bytes: int = 8 << 20,
               responses_store_size: int = 1024, incremental_streaming_output: bool = False,
               server_args: dict[str, Any] | None = None, drain_timeout: float = 30.0
               ) -> FastAPI:
    """Build the app around a TokenizerManager (whose receive loop starts with the app).
    ``app.state.drain`` (:class:`server.http.drain.Drain`, ``drain_timeout`` seconds) is the
    shutdown the launcher starts on SIGTERM."""
    # registers the middleware stack in order (outermost first) and the routers; splitting it
    # would hide that order

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        manager.start()
        yield
        await manager.close()

    app = FastAPI(title="sgl-adapters server", lifespan=lifespan)
    app.state.manager = manager
    app.state.model_name = model_name
    app.state.model_path = model_path
    app.state.server_args = server_args or {}
    app.state.metrics = ops_routes.ServerMetrics()
    app.state.response_store = ResponseStore(responses_store_size)
    app.state.incremental_streaming_output = incremental_streaming_output
    app.state.drain = Drain(drain_timeout)
    manager.observers.append(app.state.metrics.observe)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError):
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        # a list over its bound (e.g. too many messages) is a too-large request
        status = 413 if first.get("type") == "too_long" else 400
        return error_response(status, f"{loc or 'body'}: {first.get('msg', 'invalid request')}",
                              param=loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:  # name the route: a bare "Not Found" reads as a missing model
            return error_response(404, f"route {request.method} {request.url.path} is not "
                                  "served by this server (OpenAI routes: /v1/models, "
                                  "/v1/completions, /v1/chat/completions, /v1/responses, "
                                  "/v1/embeddings)",
                                  "invalid_request_error")
        if exc.status_code == 405:
            return error_response(405, f"{request.method} is not allowed on "
                                  f"{request.url.path}", "invalid_request_error")
        return error_response(exc.status_code, str(exc.detail),
                              "invalid_request_error" if exc.status_code < 500 else "server_error")

    routers = [openai_routes.router, responses_routes.router, embedding_routes.router,
               rerank_routes.router, native_routes.router, lora_routes.router,
               ops_routes.router]
    for router in routers:
        app.include_router(router)
    document_bodies(app, routers)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(DrainGate, drain=app.state.drain)  # outermost: refuses before auth
    return app
