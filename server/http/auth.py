"""API-key auth: a pure decision function and a thin ASGI middleware.

Every route needs the key (``Authorization: Bearer <key>``, or ``x-api-key``) when one is set,
except the health and metrics routes. The comparison is constant-time. The middleware is plain
ASGI (not Starlette's BaseHTTPMiddleware), so it passes ``receive`` through untouched and client
disconnects keep reaching the handlers, which turn them into aborts.
"""

from __future__ import annotations

import hmac
import json

OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})


def is_authorized(path: str, headers: dict[str, str], api_key: str | None) -> bool:
    """True when the request may proceed. ``headers`` keys are lower-case."""
    if api_key is None or path in OPEN_PATHS:
        return True
    auth = headers.get("authorization", "")
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
    return hmac.compare_digest(token.encode(), api_key.encode())


class APIKeyMiddleware:
    """Pure-ASGI middleware: 401 (OpenAI-shaped) for a request without the key
    (:func:`is_authorized`) on every route but /health, /health_generate and /metrics; no key
    configured lets everything through."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        """ASGI entry point (one HTTP request or lifespan event)."""
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if is_authorized(scope["path"], headers, self.api_key):
            return await self.app(scope, receive, send)
        body = json.dumps({"error": {"message": "invalid or missing API key",
                                     "type": "authentication_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
