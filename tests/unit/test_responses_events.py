"""The typed event sequence of a streamed /v1/responses reply, fed with scheduler outputs
(the live-server tests cover the same through the openai SDK; here the reasoning-then-answer
hand-over, which a random-weight model does not produce on demand, is pinned exactly)."""

from __future__ import annotations

import asyncio
import json

from server import protocol as P
from server.http.responses_items import ResponsesRequest, response_object
from server.http.responses_routes import _Reply, _ResponseEvents


async def _outputs(texts, finish):
    for k, text in enumerate(texts):
        yield P.ReqOutput("r", [k], text=text, completion_tokens=k + 1,
                          finish_reason=finish if k == len(texts) - 1 else None)


def _events(texts, state, finish=None, tools=None):
    body = ResponsesRequest(input="q")
    events = _ResponseEvents(response_object("resp_1", 0.0, "m", body, "in_progress", []))
    reply = _Reply(None, state, tools or {}, bool(tools), False)

    def finished(outs, output):
        return response_object("resp_1", 0.0, "m", body, "completed", output)

    async def run():
        return [e async for e in events.run(_outputs(texts, finish or {"type": "stop"}),
                                            reply, finished)]
    frames = asyncio.run(run())
    out = []
    for frame in frames:
        head, data = frame.split("\n", 1)
        payload = json.loads(data[len("data: "):])
        assert head == "event: " + payload["type"]
        out.append(payload)
    return out


def test_reasoning_then_answer_events():
    evs = _events(["<think>", "<think>why", "<think>why</think>", "<think>why</think>So",
                   "<think>why</think>So yes"], state="maybe")
    kinds = [e["type"] for e in evs]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",  # reasoning
        "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",  # message
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert evs[4]["delta"] == "why" and evs[5]["text"] == "why"
    assert [e["output_index"] for e in evs if e["type"] == "response.output_item.done"] == [0, 1]
    assert "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta") \
        == "So yes"
    final = evs[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"][0]["text"] == "So yes"
    # the final items keep the ids the stream announced
    added = [e["item"]["id"] for e in evs if e["type"] == "response.output_item.added"]
    assert added == [o["id"] for o in final["output"]]


def test_tool_reply_is_sent_whole_as_a_function_call():
    tools = {"f": {"name": "f", "parameters": {"type": "object"}}}
    call = '{"name": "f", "arguments": {"x": 1}}'
    evs = _events([call[:10], call], state=None, tools=tools)
    kinds = [e["type"] for e in evs]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"]
    assert evs[2]["item"]["arguments"] == "" and evs[2]["item"]["status"] == "in_progress"
    assert json.loads(evs[4]["arguments"]) == {"x": 1} and evs[4]["name"] == "f"
    # text that is not a call is a message, sent whole
    evs = _events(["plain", "plain text"], state=None, tools=tools)
    assert [e["type"] for e in evs][2:5] == ["response.output_item.added",
                                             "response.content_part.added",
                                             "response.output_text.delta"]
    assert evs[-1]["response"]["output"][0]["content"][0]["text"] == "plain text"
