"""RELIABILITY.md's bad-input table, the request itself: bodies that are not JSON, too large,
mistyped or full of odd characters, unknown routes and fields, each a clear 4xx with an
OpenAI-style error body; afterwards the server still answers /health_generate and its KV
invariants hold (checked by the ``healthy`` fixture after each case). The values the server
refuses in well-formed requests: test_bad_request_params.py."""

from __future__ import annotations

import json
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.http_errors import CHAT, CMPL, GEN, MSG, check_error


@pytest.mark.parametrize("content, ctype", [
    (b"{not json", "application/json"),
    (b"\xff\xfe\x00garbage", "application/json"),  # invalid UTF-8
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "text/plain"),
])
def test_body_not_json_or_wrong_type(healthy, content, ctype):
    with healthy.client() as c:
        resp = c.post(CHAT, content=content, headers={"content-type": ctype})
    assert resp.status_code in (400, 415), resp.text
    assert "error" in resp.json()


def test_body_over_the_size_limit_is_413(healthy):
    with healthy.client() as c:
        resp = c.post(CHAT, json={"messages": [{"role": "user", "content": "x" * (9 << 20)}]})
    check_error(resp, 413)


def test_chunked_body_over_the_size_limit_is_413(healthy):
    """A body without Content-Length (chunked transfer encoding) is counted as it arrives:
    413 once past the limit, not a parse error after reading it all."""
    head = b'{"max_tokens": 1, "messages": [{"role": "user", "content": "'

    def body(n_chunks):
        yield head
        for _ in range(n_chunks):
            yield b"x" * (1 << 20)
        yield b'"}]}'

    with healthy.client() as c:
        resp = c.post(CHAT, content=body(9), headers={"content-type": "application/json"})
        check_error(resp, 413, contains="body over")
        ok = c.post(CHAT, content=body(0), headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text  # a small chunked body is served as usual


@pytest.mark.parametrize("path, body, param", [
    (GEN, {"text": ["x"] * 257, "sampling_params": {"max_new_tokens": 1}}, "text"),
    (GEN, {"input_ids": [[1, 2]] * 257, "sampling_params": {"max_new_tokens": 1}}, "input_ids"),
    (CMPL, {"prompt": ["x"] * 5, "n": 64, "max_tokens": 1}, "prompt"),  # 320 sequences
])
def test_batch_over_the_limit_is_413_naming_it(healthy, path, body, param):
    """A batch larger than 256 sequences is refused whole with the limit named (a 503 would
    invite retries that can never succeed); nothing of it is queued."""
    with healthy.client() as c:
        resp = c.post(path, json=body)
        check_error(resp, 413, param, contains="at most 256")
        ok = c.post(path, json={**body, **({"text": ["x"] * 256} if "text" in body else
                                           {"input_ids": [[1, 2]] * 2} if path == GEN else
                                           {"prompt": ["x"] * 4})})
    assert ok.status_code == 200, ok.text


def test_too_many_messages(healthy):
    with healthy.client() as c:
        resp = c.post(CHAT, json={"messages": MSG * 1025})
    check_error(resp, 413, "messages")


@pytest.mark.parametrize("escaped", [r"a\ud800b", r"nul\u0000byte", r"ctrl\u0001\u001b[31m"])
def test_odd_characters_do_not_crash(healthy, escaped):
    """Lone surrogates, NUL and control characters as a client's JSON escapes them."""
    body = '{"prompt": "%s", "max_tokens": 2}' % escaped
    with healthy.client() as c:
        resp = c.post(CMPL, content=body.encode(), headers={"content-type": "application/json"})
    assert resp.status_code in (200, 400), resp.text
    if resp.status_code == 400:
        assert resp.json()["error"]["message"]


S = "\\ud800"  # a lone surrogate as a client's JSON escapes it (raw JSON text below)


@pytest.mark.parametrize("path, body, param", [
    (GEN, '{"text": "x", "sampling_params": {"max_new_tokens": 1, "stop": ["%s"]}}',
     "sampling_params.stop[0]"),
    (GEN, '{"text": "x", "sampling_params": {"max_new_tokens": 1, "regex": "a%s"}}', "sampling_params.regex"),
    (GEN, '{"text": "x", "sampling_params": {"max_new_tokens": 1, "ebnf": "root ::= \\"%s\\""}}',
     "sampling_params.ebnf"),
    (GEN, '{"text": "x", "sampling_params": {"max_new_tokens": 1, "stop_regex": "%s"}}',
     "sampling_params.stop_regex"),
    (GEN, '{"text": "x", "sampling_params": {"max_new_tokens": 1}, "rid": "r%s"}', "rid"),
    (GEN, '{"text": "x", "sampling_params": {"max_new_tokens": 1}, "cache_salt": "%s"}', "cache_salt"),
    (GEN, '{"text": "x", "sampling_params": {"max_new_tokens": 1, "choices": ["a", "%s"]}}',
     "sampling_params.choices[1]"),
    (CHAT, '{"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "stop": "%s"}', "stop"),
    (CHAT, '{"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "regex": "%s"}', "regex"),
    (CMPL, '{"max_tokens": 1, "prompt": "hi", "stop": ["%s"]}', "stop[0]"),
    (CMPL, '{"max_tokens": 1, "prompt": "hi %s"}', "prompt"),
    ("/abort_request", '{"rid": "%s"}', "rid"),
    ("/v1/responses", '{"max_output_tokens": 1, "input": "hi", "user": "%s"}', "user"),
    ("/v1/responses", '{"max_output_tokens": 1, "input": "hi", "metadata": {"k": "%s"}}', "metadata.k"),
    ("/v1/responses", '{"max_output_tokens": 1, "input": "hi", "metadata": {"%s": "v"}}', "metadata."),
])
def test_a_lone_surrogate_in_any_field_is_a_400_naming_it(healthy, path, body, param):
    """Unicode is checked once at admission for every field: a lone surrogate that reached an
    encoder later (a stop string, a grammar, a request id, Responses metadata) was a plain-text
    500 that closed the keep-alive connection. The connection serves the next request."""
    with healthy.client() as c:
        resp = c.post(path, content=(body % S).encode(),
                      headers={"content-type": "application/json"})
        check_error(resp, 400, contains=param)
        assert "not valid Unicode" in resp.json()["error"]["message"]
        ok = c.post(GEN, json={"text": "x", "sampling_params": {"max_new_tokens": 1}})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path, body, param", [
    (CMPL, {"prompt": ""}, "prompt"),
    (CMPL, {"prompt": []}, "prompt"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "content"),
    (CHAT, {"messages": "hello"}, "messages"),
    (GEN, {"text": ""}, "input_ids"),
    (GEN, {}, "text"),
    (GEN, {"text": "a", "input_ids": [1]}, "text"),
])
def test_empty_or_mistyped_fields(healthy, path, body, param):
    with healthy.client() as c:
        check_error(c.post(path, json=body), 400, param)


def test_unknown_route_is_openai_style_404(healthy):
    """The error names the route (a bare "Not Found" reads as a missing model to LangChain)."""
    with healthy.client() as c:
        check_error(c.get("/v1/nope"), 404)
        r = c.post("/v1/audio/speech", json={"input": "hi", "model": "x"})
        check_error(r, 404)
        assert "/v1/audio/speech" in r.json()["error"]["message"]


def test_retrieve_model(healthy):
    with healthy.client() as c:
        (card,) = c.get("/v1/models").json()["data"]
        assert c.get(f"/v1/models/{card['id']}").json() == card
        r = c.get("/v1/models/gpt-4o")
        check_error(r, 404)
        assert card["id"] in r.json()["error"]["message"]


# ------------------------------------------------------------------ round 2 [3/10]
def _deep_schema(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BAD_CHAT_BODIES = [
    ({"tools": [{"type": "function", "function": {"name": ["f"]}}]}, "tools[0].function.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": ["f"]}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 5}}}}}],
      "tool_choice": "auto"}, "tools[0].function.parameters"),
    ({"messages": MSG + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]},
        {"role": "user", "content": "and?"}]}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": MSG + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": "f"}]}, {"role": "user", "content": "?"}]},
     "messages[1].tool_calls[0].function"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": _deep_schema(150)}}}, "json_schema"),
    ({"json_schema": {"type": "object", "properties": {
        "a": {"$ref": "https://example.com/schema.json"}}}}, "json_schema"),
    ({"temperature": float("nan")}, "temperature"),
]


@pytest.mark.parametrize("extra, param", BAD_CHAT_BODIES,
                         ids=[p for _, p in BAD_CHAT_BODIES])
def test_malformed_fields_are_400s_naming_them_and_the_connection_survives(healthy, extra,
                                                                          param):
    """Each was a 500 (and broke the client's keep-alive connection) before round 2 [3/10]."""
    body = {"messages": MSG, "max_tokens": 4, **extra}
    with healthy.client() as c:
        resp = c.post(CHAT, content=json.dumps(body, allow_nan=True).encode(),
                      headers={"content-type": "application/json"})
        check_error(resp, 400, param)
        if param == "temperature":
            assert "finite" in resp.json()["error"]["message"]
        # the same connection serves the next request
        ok = c.post(CHAT, json={"messages": MSG, "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_health_answers_while_a_huge_prompt_is_tokenized(healthy):
    """A 5 MB prompt is tokenized on the tokenizer threads, not on the event loop: /health
    keeps answering meanwhile (it took 3.5 s before round 2 [3/10]); the prompt is then
    refused as longer than the context."""
    result = {}

    def send():
        with healthy.client() as c:
            result["resp"] = c.post(CMPL, json={"prompt": "lorem ipsum dolor " * 290_000,
                                                "max_tokens": 1})

    t = threading.Thread(target=send)
    t.start()
    latencies = []
    with healthy.client() as c:
        while t.is_alive():
            start = time.perf_counter()
            assert c.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)
    t.join()
    check_error(result["resp"], 400, "prompt")
    assert len(latencies) > 5 and max(latencies) < 1.0, max(latencies)


def test_request_bodies_are_in_the_openapi_schema(healthy):
    """Bodies are parsed off the event loop (not by FastAPI), and still documented."""
    with healthy.client() as c:
        schema = c.get("/openapi.json").json()
    for path, model in [(CHAT, "ChatCompletionRequest"), (CMPL, "CompletionRequest"),
                        (GEN, "GenerateRequest"), ("/v1/responses", "ResponsesRequest")]:
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{model}"
        assert "properties" in schema["components"]["schemas"][model]


TEXT = st.text(st.characters(codec=None, categories=None, exclude_characters=""),
               max_size=12) | st.sampled_from(["\ud800", "a\udc00b", "\x00", "\x1b[31m", ""])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["text", "rid", "cache_salt", "stop", "stop_regex", "regex",
                              "ebnf", "choices"]), value=TEXT)
def test_any_string_in_any_field_is_a_200_or_a_4xx(healthy, field, value):
    """Every string field, with lone surrogates and control characters among the values:
    never a 5xx, and the connection stays usable (the next request on it is served)."""
    sp = {"max_new_tokens": 2}
    body: dict = {"text": "x", "sampling_params": sp}
    if field in ("text", "rid", "cache_salt"):
        body[field] = value
    else:
        sp[field] = [value] if field in ("stop", "choices") else value
    raw = json.dumps(body).encode()  # escapes lone surrogates as a client's JSON would
    with healthy.client() as c:
        resp = c.post(GEN, content=raw, headers={"content-type": "application/json"})
        assert resp.status_code in (200, 400), resp.text
        if resp.status_code == 400:
            assert resp.json()["error"]["message"]
        assert c.post(GEN, json={"text": "ok", "sampling_params": {"max_new_tokens": 1}}
                      ).status_code == 200
