"""Graceful drain (SIGTERM, SIGINT, or the launching process gone): an honest shutdown.

1. From the signal on, every new request, /health included, is answered 503 with
   ``Retry-After`` (the seconds left to the drain), on a listener that stays open: a load
   balancer sees the replica leave instead of connection errors. /metrics stays readable.
2. Requests in flight run on until they finish or ``timeout`` seconds pass.
3. Then those still running end as a scheduler failure does: a stream with an SSE error event
   (code ``unavailable``) and ``data: [DONE]``, a non-streaming request with a 503, so no
   client sees a cut connection. Only then does the HTTP server stop.
"""

from __future__ import annotations

import asyncio
import math
import time

from server.http.errors import error_response
from server.http.tokenizer_manager import TokenizerManager

STILL_SERVED = frozenset({"/metrics"})


class Drain:
    """Drain state shared by the middleware and the drain task. ``timeout``: seconds in-flight
    requests may run after the drain begins."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.deadline: float | None = None  # time.monotonic() seconds

    @property
    def draining(self) -> bool:
        """True once the drain has begun."""
        return self.deadline is not None

    def begin(self) -> bool:
        """Start draining; False when already draining."""
        if self.deadline is not None:
            return False
        self.deadline = time.monotonic() + self.timeout
        return True

    def retry_after(self) -> int:
        """Whole seconds until the drain ends (at least 1)."""
        left = 0.0 if self.deadline is None else self.deadline - time.monotonic()
        return max(1, math.ceil(left))

    async def run(self, manager: TokenizerManager, poll: float = 0.05,
                  grace: float = 5.0) -> None:
        """Wait until no request is in flight or the deadline passes; then fail what is left
        (503 / SSE error event) and wait up to ``grace`` seconds for those handlers to send
        it. Call after :meth:`begin`."""
        while manager.in_flight and time.monotonic() < self.deadline:
            await asyncio.sleep(poll)
        if not manager.in_flight:
            return
        manager.fail_all(f"the server is shutting down (its {self.timeout:g} s drain ended); "
                         "retry the request", scheduler_gone=False)
        end = time.monotonic() + grace
        while manager.in_flight and time.monotonic() < end:
            await asyncio.sleep(poll)


class DrainGate:
    """Pure-ASGI middleware: while draining, a new request gets 503 + Retry-After before any
    route runs (requests already admitted are not affected)."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        """ASGI entry point (one HTTP request or lifespan event)."""
        if scope["type"] == "http" and self.drain.draining \
                and scope["path"] not in STILL_SERVED:
            refuse = error_response(503, "the server is shutting down; retry on another "
                                    "replica or after Retry-After", "server_error",
                                    headers={"Retry-After": str(self.drain.retry_after()),
                                             "Connection": "close"})
            return await refuse(scope, receive, send)
        return await self.app(scope, receive, send)
