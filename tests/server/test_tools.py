"""Tool calling through the real openai client: forced calls (required / named) are
grammar-enforced and their arguments validate; auto and none return text or calls."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "Current weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                           "parameters": {"type": "object", "properties": {
                                               "tz": {"type": "string", "maxLength": 20}},
                                               "required": ["tz"]}}}]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMS = {"get_weather": WEATHER, "get_time": TOOLS[1]["function"]["parameters"]}


def _check_call(choice, allowed):
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id and call.function.name in allowed
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    return call


@pytest.fixture
def client(healthy):
    return openai.OpenAI(base_url=healthy.url + "/v1", api_key="x", max_retries=0)


def test_required_always_yields_a_valid_call_on_random_weights(client):
    """Every reply is a call or a call cut by max_tokens; most complete and validate (random
    weights may fill strings up to their maxLength and run out of tokens)."""
    complete = 0
    for seed in range(6):
        r = client.chat.completions.create(model="m", messages=MSG, tools=TOOLS, max_tokens=120,
                                           tool_choice="required", temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason in ("tool_calls", "length")
        if r.choices[0].finish_reason == "tool_calls":
            _check_call(r.choices[0], {"get_weather", "get_time"})
            complete += 1
    assert complete >= 3


def test_named_choice_and_none(client):
    r = client.chat.completions.create(  # get_time's one field is at most 20 characters
        model="m", messages=MSG, tools=TOOLS, max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    _check_call(r.choices[0], {"get_time"})
    r = client.chat.completions.create(model="m", messages=MSG, tools=TOOLS, max_tokens=8,
                                       tool_choice="none", temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content is not None


def test_tool_result_round_trip_in_messages(client):
    history = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=8,
                                       temperature=0)
    choice = r.choices[0]
    if choice.finish_reason == "tool_calls":  # "auto": a call must then be a valid one
        _check_call(choice, {"get_weather", "get_time"})
    else:
        assert choice.finish_reason in ("stop", "length") and isinstance(
            choice.message.content, str) and choice.message.tool_calls is None
    assert r.usage.prompt_tokens > 40  # the earlier call and its result were in the prompt


@pytest.mark.default_model
@pytest.mark.slow
def test_default_model_tool_calls(default_server):
    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="m", messages=MSG, tools=TOOLS, max_tokens=80,
                                       tool_choice="required", temperature=0)
    call = _check_call(r.choices[0], {"get_weather", "get_time"})
    assert call.function.name == "get_weather"
    chunks = list(client.chat.completions.create(
        model="m", messages=MSG, tools=TOOLS, max_tokens=80, tool_choice="required",
        temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert len(streamed) == 1 and streamed[0].function.name == "get_weather"
    jsonschema.validate(json.loads(streamed[0].function.arguments), WEATHER)
    auto = client.chat.completions.create(model="m", messages=MSG, tools=TOOLS, max_tokens=60,
                                          temperature=0)
    choice = auto.choices[0]
    if choice.message.tool_calls:
        _check_call(choice, {"get_weather", "get_time"})
    else:
        assert choice.message.content


@pytest.mark.parametrize("tools, tool_choice, param", [
    # arguments are a JSON object: a parameters schema rooted in another type cannot be a call
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array", "items": {"type": "integer"}}}}], "required",
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "auto", "tools[0].function.parameters"),
    # a forced call with nothing to call is refused, not answered with plain text
    (None, "required", "tool_choice"),
    ([], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "absent"}}, "tool_choice"),
])
def test_forced_calls_that_cannot_be_calls_are_400(client, tools, tool_choice, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=MSG, tools=tools, max_tokens=4,
                                       tool_choice=tool_choice)
    err = info.value.body
    assert param in (err.get("param") or "") + err["message"], err


def test_any_object_parameters_schema_gives_a_call(client):
    """A parameters schema without a type (properties only) or one that is empty still yields
    a forced call whose arguments are an object."""
    for params in ({"properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"]},
                   {}):
        tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        r = client.chat.completions.create(model="m", messages=MSG, tools=tools, max_tokens=60,
                                           tool_choice="required", temperature=0)
        choice = r.choices[0]
        assert choice.finish_reason in ("tool_calls", "length")
        if choice.finish_reason == "tool_calls":
            args = json.loads(choice.message.tool_calls[0].function.arguments)
            assert isinstance(args, dict)
            jsonschema.validate(args, params)
