"""Helpers shared by the routes: OpenAI-style error bodies, SSE framing, and running one or
more request streams while watching for a client disconnect (which cancels them; cancelling a
stream aborts its request in the scheduler).

Streaming rule: a route awaits :func:`start_streams` before it returns a StreamingResponse, so
every failure known before the first token is an ordinary HTTP error; later failures are SSE
error events (:func:`guarded`), never a silently cut connection."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Sequence

from fastapi import Request

from server import protocol as P
from server.http.errors import ApiError, error_body
from server.http.tokenizer_manager import TokenizerManager


def manager_of(request: Request) -> TokenizerManager:
    """The app's TokenizerManager (kept on app.state: no module globals)."""
    return request.app.state.manager


def sse(data: Any) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def check_finish(out: P.ReqOutput) -> None:
    """A request that ended with an error raises ApiError (the status its finish reason
    names, e.g. 400 for a constraint that dead-ends, else 500): an error response, or an SSE
    error event once a stream has started."""
    if out.finish_reason and out.finish_reason.get("type") == "error":
        status = out.finish_reason.get("status") or 500
        raise ApiError(status, out.finish_reason.get("message", "internal error"),
                       type="invalid_request_error" if status < 500 else "server_error")


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects. Once the body is read, the ASGI receive channel
    has nothing but ``http.disconnect`` to deliver (uvicorn blocks the call until then), so
    one waiting call replaces polling ``request.is_disconnected()``: that poll, every 0.1 s per
    waiting request, was ~40% of the HTTP process's CPU under 8 concurrent prefills, which it
    took from the model's threads on a 2-core machine."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _wait_all(request: Request, tasks: Sequence[asyncio.Future]) -> None:
    """Until every task is done, or the client disconnects (CancelledError); the first task to
    fail re-raises its exception. The caller cancels what is left."""
    watcher = asyncio.ensure_future(_disconnected(request))
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending | {watcher},
                                               return_when=asyncio.FIRST_COMPLETED)
            failed = [t for t in done if t is not watcher and t.exception() is not None]
            if failed:
                raise failed[0].exception()
            if watcher in done:  # a receive that failed counts as a disconnect too
                if not watcher.cancelled():
                    watcher.exception()  # retrieved: no "never retrieved" warning
                raise asyncio.CancelledError("client disconnected")
            pending.discard(watcher)
    finally:
        watcher.cancel()


async def start_streams(request: Request, streams: Sequence[AsyncIterator[P.ReqOutput]]
                        ) -> list[AsyncIterator[P.ReqOutput]]:
    """Wait for every stream's first output before the response starts, so a request the
    scheduler refuses (a grammar that does not compile, a budget exceeded) fails with the same
    HTTP error whether it streams or not. Returns iterators that yield that first output again
    and then the rest. Raises ApiError (the others are cancelled, aborting their requests) or
    CancelledError when the client disconnects meanwhile."""
    firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
    try:
        await _wait_all(request, firsts)
    except BaseException:
        for t in firsts:
            t.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        raise

    async def replay(first: P.ReqOutput, rest):
        try:
            yield first
            if first.finish_reason is None:
                async for out in rest:
                    yield out
        finally:
            await rest.aclose()  # closing aborts the request if it is still running

    return [replay(t.result(), s) for t, s in zip(firsts, streams)]


async def guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """SSE framing for failures after the headers: an ApiError (the scheduler died, a batch
    failed) becomes ``data: {"error": {...}}`` then ``data: [DONE]`` and a clean close."""
    try:
        async for event in events:
            yield event
    except ApiError as exc:
        yield sse(error_body(exc.status, exc.message, exc.type, exc.param))
        yield SSE_DONE


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
        await _wait_all(request, tasks)
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merge(streams: Sequence[AsyncIterator[P.ReqOutput]]
                ) -> AsyncIterator[tuple[int, P.ReqOutput]]:
    """Interleave several streams as (stream index, output); cancelling the consumer cancels
    (and so aborts) every stream. An ApiError from any stream is re-raised.

    The hand-over queue holds one output per stream: a consumer blocked on a client that
    stops reading stops pulling the streams, so their outputs wait in the tokenizer manager,
    which merges them into one chunk when the client reads again (or aborts the request once
    it has waited ``--stream-stall-timeout``). An unbounded queue here kept pulling: 104 MB of
    top-20 logprob chunks piled up for a client that read nothing, each rendered on its own."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
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
                check_finish(item)
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The OpenAI usage object (tokens), cached prompt tokens included."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def token_logprobs(manager: TokenizerManager, outs: Sequence[P.ReqOutput]
                   ) -> list[dict[str, Any]]:
    """Chat-style logprob entries ``{"token", "logprob", "bytes", "top_logprobs"}`` of the
    outputs' generated tokens (chat ``logprobs.content`` and Responses ``output_text.logprobs``
    share this shape)."""
    content = []
    tops = [top for o in outs for top in o.output_top_logprobs]
    for k, (lp, t) in enumerate(p for o in outs for p in o.output_token_logprobs):
        tok = manager.decode([t])
        content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                        "top_logprobs": [{"token": manager.decode([tt]), "logprob": tlp,
                                          "bytes": list(manager.decode([tt]).encode())}
                                         for tlp, tt in (tops[k] if k < len(tops) else [])]})
    return content


def openai_finish_reason(reason: dict[str, Any] | None) -> str | None:
    """"stop" (EOS, a stop string or id), "length", or "abort" (aborted by the server or
    the API); an internal error never gets here (it is an error response or event)."""
    if reason is None:
        return None
    return reason["type"] if reason["type"] in ("length", "abort") else "stop"
