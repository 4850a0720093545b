"""The OpenAI Responses API (``/v1/responses``) through the real openai SDK (create, stream,
parse) and langchain-openai's ``ChatOpenAI(use_responses_api=True)``: every reply must equal
what the same conversation gets on ``/v1/chat/completions``, since both admit through the chat
path."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server.http.errors import ApiError
from server.http.responses_items import ResponseStore


@pytest.fixture
def client(healthy):
    return openai.OpenAI(base_url=healthy.url + "/v1", api_key="unused", max_retries=0)


def _chat_text(client, messages, max_tokens=12, **kw):
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens,
                                       temperature=0, **kw)
    return r.choices[0].message.content, r.usage


def test_create_equals_chat_with_instructions_and_usage(client):
    r = client.responses.create(model="m", input="Tell me about radix trees.",
                                instructions="Be brief.", max_output_tokens=12, temperature=0)
    want, chat_usage = _chat_text(client, [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Tell me about radix trees."}])
    assert r.object == "response" and r.id.startswith("resp_")
    assert [o.type for o in r.output] == ["message"]
    assert r.output_text == want
    assert r.usage.input_tokens == chat_usage.prompt_tokens
    assert r.usage.output_tokens == chat_usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the chat request ran the same prompt just before: all but the last token was cached
    again = client.responses.create(model="m", input="Tell me about radix trees.",
                                    instructions="Be brief.", max_output_tokens=12,
                                    temperature=0)
    assert again.usage.input_tokens_details.cached_tokens >= again.usage.input_tokens - 1
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":  # 12 tokens of a random model: usually cut by the limit
        assert r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.output_tokens == 12


def test_input_items_and_previous_response_id(client):
    items = [{"role": "developer", "content": "Answer in one word."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Name a "},
                          {"type": "input_text", "text": "colour."}]}]
    first = client.responses.create(model="m", input=items, max_output_tokens=8, temperature=0)
    second = client.responses.create(model="m", input="And another one?", max_output_tokens=8,
                                     temperature=0, previous_response_id=first.id)
    # the same conversation sent whole on chat gives the same reply
    history = [{"role": "system", "content": "Answer in one word."},
               {"role": "user", "content": "Name a colour."},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And another one?"}]
    want, chat_usage = _chat_text(client, history, max_tokens=8)
    assert second.output_text == want
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat_usage.prompt_tokens
    # retrieve and delete
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="m", input="hi", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"
    # store=false: answered, but not kept
    unstored = client.responses.create(model="m", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_stream_typed_events_equal_the_plain_reply(client):
    # 48 tokens: unread deltas are coalesced into one chunk, so a short reply could arrive whole
    kw = dict(model="m", input="Write a line about caches.", max_output_tokens=48,
              temperature=0)
    plain = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          "response.completed" if plain.status == "completed"
                          else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(e.delta for e in deltas) == plain.output_text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in deltas)
    final = events[-1].response
    assert final.output_text == plain.output_text and final.output[0].id == item_id
    assert final.usage.output_tokens == plain.usage.output_tokens
    # the SDK's stream helper accumulates the same events into the final response
    with client.responses.stream(model="m", input="Write a line about caches.",
                                 max_output_tokens=16, temperature=0,
                                 extra_body={"ignore_eos": True}) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text.startswith(plain.output_text[:8])


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    name: str = Field(max_length=12)


def test_parse_with_pydantic_model_is_grammar_enforced(client):
    """A random-weight model still returns a Pet: text.format json_schema is a grammar."""
    for seed_text in ("Describe a pet.", "Another pet, please."):
        r = client.responses.parse(model="m", input=seed_text, text_format=Pet,
                                   max_output_tokens=80, temperature=0)
        assert isinstance(r.output_parsed, Pet)
        jsonschema.validate(json.loads(r.output_text), Pet.model_json_schema())
    with client.responses.stream(model="m", input="A pet as JSON.", text_format=Pet,
                                 max_output_tokens=80, temperature=0) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Pet)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": WEATHER}]


@pytest.mark.parametrize("stream", [False, True])
def test_function_tools_required_and_round_trip(client, stream):
    kw = dict(model="m", input="Weather in Paris?", tools=TOOLS, tool_choice="required",
              max_output_tokens=40, temperature=0)
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        r = events[-1].response
        assert done.arguments == r.output[0].arguments and done.name == "get_weather"
    else:
        r = client.responses.create(**kw)
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # the caller runs the tool and continues from the stored response
    follow = client.responses.create(
        model="m", previous_response_id=r.id, tools=TOOLS, max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": '{"temp_c": 21}'}])
    assert follow.status in ("completed", "incomplete") and follow.output
    # and the same history sent whole, with a named tool_choice
    named = client.responses.create(
        model="m", tools=TOOLS, max_output_tokens=40,
        tool_choice={"type": "function", "name": "get_weather"},
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"},
               {"role": "user", "content": "And in Rome?"}])
    assert named.output[-1].type == "function_call"


def test_logprobs_include(client):
    r = client.responses.create(model="m", input="hi", max_output_tokens=4, temperature=0,
                                top_logprobs=2, include=["message.output_text.logprobs"])
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens
    assert "".join(lp.token for lp in lps) == r.output_text
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in lps)


@pytest.mark.parametrize("body,param", [
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
])
def test_unsupported_fields_are_clear_400s(healthy, body, param):
    with healthy.client() as c:
        r = c.post("/v1/responses", json={"model": "m", "input": "hi", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err


def test_store_is_bounded_lru():
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": str(i)}])
        if i == 1:
            store.get("r0")  # r0 used: r1 is now the least recently used
    assert len(store) == 2
    assert store.get("r0")[1] == [{"role": "user", "content": "0"}]
    with pytest.raises(ApiError) as err:
        store.get("r1")
    assert err.value.status == 404
    ResponseStore(capacity=0).put({"id": "x"}, [])  # 0: nothing kept, no error
    # the byte budget: large conversations evict the oldest entries; one over it is not kept
    store = ResponseStore(capacity=100, max_bytes=10_000)
    for i in range(5):
        store.put({"id": f"big{i}"}, [{"role": "user", "content": "x" * 3000}])
    assert len(store) == 3 and store.nbytes <= 10_000
    with pytest.raises(ApiError):
        store.get("big1")
    store.put({"id": "huge"}, [{"role": "user", "content": "x" * 20_000}])
    assert len(store) == 3 and store.get("big4")
    store.delete("big4")
    assert len(store) == 2 and store.nbytes < 10_000 * 2 / 3


def test_stream_fails_before_headers_like_plain(healthy):
    """A grammar that cannot compile is a 400 whether or not the request streams."""
    body = {"model": "m", "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "bad", "schema": {"type": "string", "pattern": "(("}}}}
    with healthy.client() as c:
        for stream in (False, True):
            r = c.post("/v1/responses", json={**body, "stream": stream})
            assert r.status_code == 400, r.text


def test_langchain_openai_use_responses_api(healthy):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model="m", base_url=healthy.url + "/v1", api_key="x",
                                      use_responses_api=True, temperature=0, max_tokens=10,
                                      max_retries=0)
    msg = llm.invoke([("system", "Be brief."), ("human", "Say something.")])
    with openai.OpenAI(base_url=healthy.url + "/v1", api_key="x") as client:
        want, _ = _chat_text(client, [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Say something."}],
                             max_tokens=10)
    assert msg.text == want
    assert msg.usage_metadata["input_tokens"] > 0
    assert msg.response_metadata["id"].startswith("resp_")
    streamed = "".join(chunk.text for chunk in llm.stream("Say something."))
    assert streamed == llm.invoke("Say something.").text
    # tools: a forced call comes back as a LangChain tool call with valid arguments
    roomy = langchain_openai.ChatOpenAI(model="m", base_url=healthy.url + "/v1", api_key="x",
                                        use_responses_api=True, temperature=0, max_tokens=80,
                                        max_retries=0)
    tooled = roomy.bind_tools([{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}}],
        tool_choice="get_weather").invoke("Weather in Paris?")
    [call] = tooled.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER)
    # structured output through text.format json_schema
    pet = roomy.with_structured_output(Pet, method="json_schema").invoke("Describe a pet.")
    assert isinstance(pet, Pet)


def test_langchain_reports_a_missing_route_as_such(healthy):
    """An unserved route names itself (a bare 404 reads to LangChain as a missing model)."""
    with httpx.Client(base_url=healthy.url) as c:
        r = c.post("/v1/audio/speech", json={"input": "x", "model": "m"})
    assert r.status_code == 404 and "/v1/audio/speech" in r.json()["error"]["message"]


@pytest.mark.default_model
@pytest.mark.slow
def test_default_model_conversation_over_previous_response_id(default_server):
    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="x", max_retries=0)
    first = client.responses.create(model="default", input="What is the capital of France?",
                                    max_output_tokens=24, temperature=0)
    assert first.output_text and first.status in ("completed", "incomplete")
    second = client.responses.create(model="default", previous_response_id=first.id,
                                     input="Which country is that city in?",
                                     max_output_tokens=24, temperature=0)
    assert second.output_text and second.previous_response_id == first.id
    # the first exchange is a cached prefix of the second
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
