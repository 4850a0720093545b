"""RELIABILITY.md's bad-input table, the values: input ids, prompt lengths, max_tokens, sampling
values, constraints, request ids and logprob options the server refuses with a clear 400 (before a
stream's headers), and the defaults it picks where a request leaves them out; the ``healthy``
fixture checks afterwards that the server still answers and its KV invariants hold."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from tests.server.http_errors import CHAT, CMPL, GEN, MSG, check_error


@pytest.mark.parametrize("ids", [[-1, 5], [10**9], [1.5, 2], ["a"]])
def test_bad_input_ids(healthy, ids):
    with healthy.client() as c:
        check_error(c.post(GEN, json={"input_ids": ids}), 400)
        if ids != ["a"]:  # for /v1/completions ["a"] is a valid batch of one text prompt
            check_error(c.post(CMPL, json={"prompt": ids}), 400)


def test_prompt_over_the_context_reports_both_numbers(healthy):
    with healthy.client() as c:
        resp = c.post(GEN, json={"input_ids": [5] * 500, "sampling_params": {
            "max_new_tokens": 20}})
        check_error(resp, 400, "max_new_tokens", "512")
        assert "500" in resp.json()["error"]["message"]
        check_error(c.post(CMPL, json={"prompt": [5] * 600}), 400)


def test_prompt_larger_than_the_kv_pool(make_tiny_model):
    from tests.live_server import ServerProcess

    path, _ = make_tiny_model("llama")
    server = ServerProcess("--model", path, "--dtype", "float32", "--max-total-tokens", "64",
                           "--context-length", "512")
    try:
        with server.client() as c:
            resp = c.post(GEN, json={"input_ids": [5] * 100, "sampling_params": {
                "max_new_tokens": 4}})
            check_error(resp, 400, None, "pool")
            assert c.get("/health_generate").status_code == 200
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("value", [-1, 10**9, 1.5, "ten"])
def test_bad_max_tokens(healthy, value):
    with healthy.client() as c:
        check_error(c.post(CHAT, json={"messages": MSG, "max_tokens": value}), 400, "max_tokens")


def test_max_tokens_zero_is_a_defined_empty_response(healthy):
    with healthy.client() as c:
        r = c.post(CMPL, json={"prompt": "x y z", "max_tokens": 0}).json()
    assert r["choices"][0]["text"] == "" and r["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("temperature", "NaN"), ("top_p", 0), ("top_p", 1.5),
    ("top_k", -2), ("min_p", 1.5), ("seed", 2**64), ("n", 0), ("n", 1000),
    ("presence_penalty", 5), ("logit_bias", {"x": 1}), ("top_logprobs", 50),
    ("stop", ["s"] * 17), ("stop", ["x" * 300]),
])
def test_bad_sampling_values(healthy, field, value):
    body = {"messages": MSG, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    with healthy.client() as c:
        if value == "NaN":
            resp = c.post(CHAT, content=f'{{"messages": {MSG!r}, "temperature": NaN}}'
                          .replace("'", '"'), headers={"content-type": "application/json"})
        else:
            resp = c.post(CHAT, json=body)
    check_error(resp, 400)


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"},
     "tool_choice"),
    ({"regex": "(unclosed"}, "regex"), ({"regex": ""}, "regex"),
    ({"json_schema": {"type": 5}}, "json_schema"),
    ({"json_schema": {"$ref": "#"}}, "json_schema"),
    ({"json_schema": {"type": "object", "description": "x" * 40000}}, "json_schema"),
    ({"regex": "a+", "json_schema": {"type": "object"}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": "nope"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
    ({"regex": r"[^\s\S]"}, "regex"),  # matches no string: refused, not a 500 mid-request
    ({"ebnf": r"root ::= [^\s\S]"}, "ebnf"),
])
def test_bad_constraints(healthy, extra, param):
    with healthy.client() as c:
        start = time.monotonic()
        check_error(c.post(CHAT, json={"messages": MSG, **extra}), 400, param)
        assert time.monotonic() - start < 10  # within the compile budget


def test_a_constraint_that_dead_ends_mid_output_is_a_400(healthy):
    """A grammar with a rule that derives no string (``x ::= x "c"``) lets "a" start and then
    allows no token: a 400 naming the dead end (it was a 500 "the grammar rejected token"),
    as a response before the stream starts or an error event after; the server goes on."""
    body = {"text": "x", "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                             "ebnf": 'root ::= "a" x\nx ::= x "c"'}}
    with healthy.client() as c:
        check_error(c.post(GEN, json=body), 400, contains="allows no next token")
        resp = c.post(GEN, json={**body, "stream": True})
    if resp.status_code != 200:  # the dead end came with the first output, before the headers
        return check_error(resp, 400, contains="allows no next token")
    events = [ln for ln in resp.text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][6:])["error"]
    assert err["code"] == "invalid_request" and "allows no next token" in err["message"]


def test_an_oversized_schema_is_refused_for_its_size_before_it_is_validated(healthy):
    """Validating a schema takes time that grows with its size, on the HTTP event loop (a 7 MB
    one blocked /health for 24 s): the size is checked first, so a ~400 KB schema that is also
    invalid is refused for its size, in response_format, a native json_schema (as text too)
    and a tool's parameters alike."""
    big = {"type": "object", "properties": {f"p{i}": {"type": 5} for i in range(20000)}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": big}}
    tool = {"type": "function", "function": {"name": "f", "parameters": big}}
    with healthy.client() as c:
        for resp, param in [
                (c.post(CHAT, json={"messages": MSG, "max_tokens": 1, "response_format": fmt}),
                 "json_schema"),
                (c.post(CHAT, json={"messages": MSG, "max_tokens": 1, "tools": [tool]}),
                 "parameters"),
                (c.post(GEN, json={"text": "x", "sampling_params": {"max_new_tokens": 1,
                                                                   "json_schema": big}}),
                 "json_schema"),
                (c.post(GEN, json={"text": "x", "sampling_params": {
                    "max_new_tokens": 1, "json_schema": json.dumps(big, indent=2)}}),
                 "json_schema")]:
            check_error(resp, 400, param, contains="characters")
        assert c.get("/health").status_code == 200


def test_bad_native_choices(healthy):
    with healthy.client() as c:
        for choices in ([], ["a", "a"], [""]):
            check_error(c.post(GEN, json={"text": "x", "sampling_params": {"choices": choices}}),
                        400, "choices")


def test_constraints_hold_on_the_tiny_model(healthy):
    with healthy.client() as c:
        r = c.post(GEN, json={"text": "n:", "sampling_params": {
            "regex": "[0-9]{3}", "max_new_tokens": 8, "temperature": 1.0}}).json()
        assert re.fullmatch("[0-9]{3}", r["text"]), r
        r = c.post(CHAT, json={"messages": MSG, "max_tokens": 100, "response_format": {
            "type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {
                "type": "object", "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"], "additionalProperties": False}}}}).json()
        if r["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(r["choices"][0]["message"]["content"])["ok"], bool)


def test_bad_native_sampling_params(healthy):
    with healthy.client() as c:
        check_error(c.post(GEN, json={"text": "x", "sampling_params": {"temperature": -1}}),
                    400, "temperature")
        check_error(c.post(GEN, json={"text": "x", "sampling_params": {"bogus": 1}}), 400)
        check_error(c.post(GEN, json={"text": "x", "image_data": "abc"}), 400, "image_data")


def test_duplicate_request_id_rejected(healthy):
    with healthy.client() as c:
        slow = {"text": "hold", "rid": "dup-1", "sampling_params": {
            "max_new_tokens": 200, "ignore_eos": True}}
        t = threading.Thread(target=lambda: healthy.client().post(GEN, json=slow))
        t.start()
        deadline = time.monotonic() + 30  # until the first one runs (not a fixed sleep)
        while c.get("/server_info").json()["metrics"]["running_requests"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        resp = c.post(GEN, json={"text": "again", "rid": "dup-1"})
        t.join()
    check_error(resp, 400, "rid")


def test_negative_logprob_start_len_is_refused(healthy):
    with healthy.client() as c:
        resp = c.post(GEN, json={"text": "hi", "logprob_start_len": -5, "return_logprob": True})
    check_error(resp, 400, "logprob_start_len")


@pytest.mark.parametrize("path, body", [
    (CHAT, {"messages": MSG, "max_tokens": 4, "regex": "(", "stream": True}),
    (GEN, {"text": "hi", "stream": True, "sampling_params": {"regex": "[z-a]"}}),
    (CMPL, {"prompt": "hi", "max_tokens": 4, "json_schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "("}}}, "stream": True}),
])
def test_a_stream_the_scheduler_refuses_fails_before_its_headers(healthy, path, body):
    """The grammar fails to compile in the scheduler: the streaming request gets the same 400
    JSON error as the non-streaming one, not a 200 stream that is cut."""
    with healthy.client() as c:
        streamed = c.post(path, json=body)
        plain = c.post(path, json={**body, "stream": False})
    check_error(streamed, 400)
    check_error(plain, 400)
    assert streamed.json()["error"]["message"] == plain.json()["error"]["message"]


@pytest.fixture(scope="module")
def small_pool_server(make_tiny_model):
    from tests.live_server import ServerProcess

    path, _ = make_tiny_model("llama")
    server = ServerProcess("--model", path, "--dtype", "float32", "--max-total-tokens", "300",
                           "--context-length", "512")
    yield server
    assert server.stop() == 0, "".join(server.log[-40:])


@pytest.mark.unbounded_ok  # that default is what it checks, on a 300-token pool
def test_default_max_tokens_fits_a_pool_smaller_than_the_context(small_pool_server):
    """Without max_tokens a request gets what the KV pool can hold for its prompt (it was
    refused: "needs 512 KV slots; the pool holds 300"); only a prompt that cannot fit is."""
    with small_pool_server.client() as c:
        ok = c.post(CMPL, json={"prompt": [5, 6, 7, 8], "ignore_eos": True})
        # /v1/completions defaults to 16 tokens (OpenAI); chat defaults to "as many as fit"
        chat = c.post(CHAT, json={"messages": MSG, "ignore_eos": True})
        too_long = c.post(CHAT, json={"messages": [{"role": "user", "content": "x " * 400}]})
    assert ok.status_code == 200, ok.text
    assert chat.status_code == 200, chat.text
    usage = chat.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 300
    check_error(too_long, 400)
