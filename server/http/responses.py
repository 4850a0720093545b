"""Helpers shared by the routes: OpenAI-style error bodies, SSE framing, and running one or
more request streams while watching for a client disconnect (which cancels them; cancelling a
stream aborts its request in the scheduler)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse

from server import protocol as P
from server.http.tokenizer_manager import ApiError, TokenizerManager

DISCONNECT_POLL_S = 0.1


def manager_of(request: Request) -> TokenizerManager:
    """The app's TokenizerManager (kept on app.state: no module globals)."""
    return request.app.state.manager


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    code = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found",
            413: "request_too_large", 415: "unsupported_media_type", 503: "unavailable"}
    return JSONResponse({"error": {"message": message, "type": type, "param": param,
                                   "code": code.get(status, str(status))}},
                        status_code=status, headers=headers)


def api_error_response(exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.type, exc.param, exc.headers)


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def check_finish(out: P.ReqOutput) -> None:
    """A request that ended with an internal error becomes a 500 for non-streaming clients."""
    if out.finish_reason and out.finish_reason.get("type") == "error":
        raise ApiError(500, out.finish_reason.get("message", "internal error"),
                       type="server_error")


async def collect(request: Request, streams: Sequence[AsyncIterator[P.ReqOutput]]
                  ) -> list[list[P.ReqOutput]]:
    """Run the streams to completion concurrently; all outputs of each, in order.

    A client disconnect cancels them (aborting their requests) and raises CancelledError; an
    ApiError from any stream cancels the others and is re-raised.
    """
    async def drain(stream):
        return [o async for o in stream]

    tasks = [asyncio.ensure_future(drain(s)) for s in streams]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=DISCONNECT_POLL_S,
                                               return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in done if t.exception() is not None]
            if failed:
                raise failed[0].exception()
            if not pending:
                return [t.result() for t in tasks]
            if await request.is_disconnected():
                raise asyncio.CancelledError("client disconnected")
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merge(streams: Sequence[AsyncIterator[P.ReqOutput]]
                ) -> AsyncIterator[tuple[int, P.ReqOutput]]:
    """Interleave several streams as (stream index, output); cancelling the consumer cancels
    (and so aborts) every stream. An ApiError from any stream is re-raised."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def openai_finish_reason(reason: dict[str, Any] | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason["type"] == "length" else "stop"
