"""The OpenAI Responses API: ``POST /v1/responses`` (plain or streamed as typed SSE events),
``GET /v1/responses/{id}`` and ``DELETE /v1/responses/{id}``.

A request is admitted through the chat path (:mod:`server.http.responses_items` maps the
fields), so the radix cache, grammars, tools and reasoning parsers behave exactly as on
``/v1/chat/completions``. A stream sends ``response.created``, ``response.in_progress``, then
per output item ``response.output_item.added`` / ``content_part.added`` / text deltas /
``..done`` events, and ends with ``response.completed`` (or ``response.incomplete`` when
``max_output_tokens`` cut the reply); every event carries ``type`` and ``sequence_number``.
A reply that may be a tool call (function tools, tool_choice not "none") is sent whole once it
is known to be a call or text, as on chat. A failure after the headers is an ``error`` event.
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from server import protocol as P
from server.http.admission import admit_chat
from server.http.body import body_of
from server.http.errors import ApiError
from server.http.responses import (
    check_finish,
    collect,
    manager_of,
    merge,
    start_streams,
    token_logprobs,
)
from server.http.responses_items import (
    ResponsesRequest,
    as_chat_messages,
    chat_request,
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
    response_object,
    usage,
)
from server.http.tokenizer_manager import TokenizerManager
from server.http.tools import as_tool_call
from server.reasoning import ReasoningStream, split

router = APIRouter()


def _status(finish: dict[str, Any] | None) -> tuple[str, str | None]:
    """(response status, incomplete reason) of a finished generation."""
    kind = (finish or {}).get("type")
    if kind == "length":
        return "incomplete", "max_output_tokens"
    return ("cancelled", None) if kind == "abort" else ("completed", None)


class _Reply:
    """What one generation says, as Responses output items: the reasoning (with a reasoning
    parser), then a function call or a message."""

    def __init__(self, manager: TokenizerManager, state: str | None, tools: dict[str, dict],
                 use_tools: bool, want_logprobs: bool):
        self.manager, self.state = manager, state
        self.tools, self.use_tools, self.want_logprobs = tools, use_tools, want_logprobs

    def items(self, outs: list[P.ReqOutput], ids: dict[str, str] | None = None
              ) -> list[dict[str, Any]]:
        """The output items of a finished generation (``outs``: all its outputs). ``ids``:
        the item ids a stream already announced, by type ("reasoning", "message")."""
        ids = ids or {}
        final = outs[-1]
        status, _ = _status(final.finish_reason)
        reasoning, text = split(final.text, self.state) if self.state is not None \
            else (None, final.text)
        items = [reasoning_item(ids.get("reasoning") or new_id("rs"), reasoning)] \
            if reasoning else []
        call = as_tool_call(text, self.tools) if self.use_tools else None
        if call is not None:
            items.append(function_call_item(new_id("fc"), call))
        else:
            lp = token_logprobs(self.manager, outs) if self.want_logprobs else None
            items.append(message_item(ids.get("message") or new_id("msg"), text, "completed"
                                      if status == "completed" else "incomplete", lp))
        return items

    def usage(self, final: P.ReqOutput, output: list[dict[str, Any]]) -> dict[str, Any]:
        thought = "".join(i["content"][0]["text"] for i in output if i["type"] == "reasoning")
        reasoning_tokens = min(len(self.manager.encode(thought)), final.completion_tokens) \
            if thought else 0
        return usage(final.prompt_tokens, final.completion_tokens, final.cached_tokens,
                     reasoning_tokens)


@router.post("/v1/responses")
async def create_response(request: Request, body: ResponsesRequest = Depends(body_of(ResponsesRequest))):
    """OpenAI Responses (``POST /v1/responses``), plain or as SSE events; chained by
    ``previous_response_id``."""
    manager = manager_of(request)
    store = request.app.state.response_store
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        _, history = store.get(body.previous_response_id, param="previous_response_id")
    chat, conversation = chat_request(body, history)
    inputs, tools, use_tools = await admit_chat(manager, chat)
    reply = _Reply(manager, inputs[0].reasoning_state, tools, use_tools, chat.logprobs)
    rid, created, model = new_id("resp"), time.time(), request.app.state.model_name

    def finished(outs: list[P.ReqOutput], output: list[dict[str, Any]] | None = None
                 ) -> dict[str, Any]:
        final = outs[-1]
        output = output if output is not None else reply.items(outs)
        status, reason = _status(final.finish_reason)
        response = response_object(rid, created, model, body, status, output,
                                   reply.usage(final, output), reason)
        if body.store:
            store.put(response, conversation + as_chat_messages(output))
        return response

    stream = manager.generate(inputs[0])
    if body.stream:
        [stream] = await start_streams(request, [stream])
        events = _ResponseEvents(response_object(rid, created, model, body, "in_progress", []))
        return StreamingResponse(events.run(stream, reply, finished),
                                 media_type="text/event-stream")
    [outs] = await collect(request, [stream])
    check_finish(outs[-1])
    return finished(outs)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> dict:
    """A stored response (``GET /v1/responses/{id}``); 404 when unknown."""
    response, _ = request.app.state.response_store.get(response_id)
    return response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict:
    """Forget a stored response (``DELETE /v1/responses/{id}``); 404 when unknown."""
    request.app.state.response_store.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


class _ResponseEvents:
    """The typed SSE events of one streamed response. Items stream one at a time: ``open``
    announces an item, ``delta`` extends its text, ``close`` ends it with its final form."""

    def __init__(self, response: dict[str, Any]):
        self.response = response  # the in-progress object of response.created
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.item: dict[str, Any] | None = None  # the open item
        self.text = ""

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def open(self, item: dict[str, Any]) -> list[str]:
        self.item, self.text = item, ""
        if item["type"] == "function_call":
            return [self.event("response.output_item.added", output_index=len(self.output),
                               item={**item, "arguments": "", "status": "in_progress"})]
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []} \
            if item["type"] == "message" else {"type": "reasoning_text", "text": ""}
        shell = {**item, "content": [], "status": "in_progress"}
        return [self.event("response.output_item.added", output_index=len(self.output),
                           item=shell),
                self.event("response.content_part.added", content_index=0, part=part,
                           **self._where())]

    def delta(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[str]:
        if not text and not logprobs:
            return []
        self.text += text
        kind = self.item["type"]
        if kind == "function_call":
            return [self.event("response.function_call_arguments.delta", delta=text,
                               **self._where())]
        if kind == "reasoning":
            return [self.event("response.reasoning_text.delta", content_index=0, delta=text,
                               **self._where())]
        return [self.event("response.output_text.delta", content_index=0, delta=text,
                           logprobs=logprobs or [], **self._where())]

    def close(self, item: dict[str, Any]) -> list[str]:
        """End the open item with its final form ``item`` (same id)."""
        where, kind = self._where(), item["type"]
        if kind == "function_call":
            events = [self.event("response.function_call_arguments.done", name=item["name"],
                                 arguments=item["arguments"], **where)]
        else:
            part = item["content"][0]
            done = "response.output_text.done" if kind == "message" else \
                "response.reasoning_text.done"
            extra = {"logprobs": part.get("logprobs") or []} if kind == "message" else {}
            events = [self.event(done, content_index=0, text=part["text"], **extra, **where),
                      self.event("response.content_part.done", content_index=0, part=part,
                                 **where)]
        events.append(self.event("response.output_item.done", output_index=len(self.output),
                                 item=item))
        self.output.append(item)
        self.item = None
        return events

    def whole(self, item: dict[str, Any]) -> list[str]:
        """Open, fill and close an item known only at the end (a tool call, or the text of a
        reply that might have been one)."""
        text = item["arguments"] if item["type"] == "function_call" else \
            item["content"][0]["text"]
        lp = item["content"][0].get("logprobs") if item["type"] == "message" else None
        return self.open(item) + self.delta(text, lp) + self.close(item)

    async def run(self, stream: AsyncIterator[P.ReqOutput], reply: _Reply, finished
                  ) -> AsyncIterator[str]:
        """All events: created, in_progress, the items, then completed / incomplete (or an
        ``error`` event for a failure after the headers)."""
        try:
            yield self.event("response.created", response=self.response)
            yield self.event("response.in_progress", response=self.response)
            outs: list[P.ReqOutput] = []
            parts = ReasoningStream(reply.state or "off")
            ids = {"reasoning": new_id("rs"), "message": new_id("msg")}
            async for _, out in merge([stream]):
                outs.append(out)
                if reply.use_tools:
                    continue  # sent whole at the end, once known to be a call or text
                thought, said = parts.feed(out.text, final=out.finish_reason is not None)
                for kind, text in (("reasoning", thought), ("message", said)):
                    if not text:
                        continue
                    if self.item is not None and self.item["type"] != kind:
                        for e in self.close(reasoning_item(ids["reasoning"], parts.sent_reasoning)):
                            yield e
                    if self.item is None:
                        shell = reasoning_item(ids[kind], "") if kind == "reasoning" else \
                            message_item(ids[kind], "", "in_progress")
                        for e in self.open(shell):
                            yield e
                    lp = token_logprobs(reply.manager, [out]) \
                        if kind == "message" and reply.want_logprobs else None
                    for e in self.delta(text, lp):
                        yield e
            for item in reply.items(outs, None if reply.use_tools else ids):
                if self.item is not None and self.item["id"] == item["id"]:
                    events = self.close(item)
                elif item["id"] in {i["id"] for i in self.output}:
                    continue  # the reasoning item, closed when the answer began
                else:
                    events = self.whole(item)
                for e in events:
                    yield e
            response = finished(outs, self.output)
            kind = "response.completed" if response["status"] == "completed" else \
                "response.incomplete"
            yield self.event(kind, response=response)
        except ApiError as exc:
            yield self.event("error", code=str(exc.status), message=exc.message,
                             param=exc.param)
