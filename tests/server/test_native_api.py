"""The SGLang-style native API through httpx: /generate (single, batch, streaming, logprobs,
prefill-only), /model_info, /server_info, /flush_cache, /abort_request, /metrics."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def c(healthy):
    with healthy.client() as client:
        yield client


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_generate_text_and_input_ids_agree(c):
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    a = c.post("/generate", json={"text": "native api test", "sampling_params": sp}).json()
    ids = c.post("/generate", json={"text": "native api test", "return_logprob": True,
                                    "logprob_start_len": 0,
                                    "sampling_params": {"max_new_tokens": 0}}).json()
    assert ids["output_ids"] == [] and ids["meta_info"]["finish_reason"]["type"] == "length"
    prompt = [t for _, t, _ in ids["meta_info"]["input_token_logprobs"]]
    assert len(prompt) == ids["meta_info"]["prompt_tokens"] > 2
    b = c.post("/generate", json={"input_ids": prompt, "sampling_params": sp}).json()
    assert b["output_ids"] == a["output_ids"] and b["text"] == a["text"]
    meta = a["meta_info"]
    assert meta["completion_tokens"] == 8 and meta["finish_reason"] == {"type": "length"}
    assert set(meta) >= {"id", "prompt_tokens", "completion_tokens", "cached_tokens"}


def test_prefill_only_is_a_cache_hint(c):
    prompt = list(range(1000, 1060))
    hint = c.post("/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 0}}).json()
    assert hint["meta_info"]["completion_tokens"] == 0
    r = c.post("/generate", json={"input_ids": prompt + [7, 8], "sampling_params": {
        "max_new_tokens": 2, "temperature": 0}}).json()
    assert r["meta_info"]["cached_tokens"] == 60


def test_batch_with_per_prompt_params_and_rids(c):
    r = c.post("/generate", json={
        "text": ["first prompt", "second prompt"], "rid": ["r-a", "r-b"],
        "sampling_params": [{"max_new_tokens": 2, "temperature": 0},
                            {"max_new_tokens": 4, "temperature": 0}]}).json()
    assert [x["meta_info"]["id"] for x in r] == ["r-a", "r-b"]
    assert [x["meta_info"]["completion_tokens"] <= n for x, n in zip(r, (2, 4))] == [True, True]


def test_logprobs_with_text(c):
    r = c.post("/generate", json={
        "input_ids": [11, 12, 13, 14, 15], "return_logprob": True, "logprob_start_len": 1,
        "top_logprobs_num": 2, "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
    meta = r["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == [12, 13, 14, 15]
    assert [e[1] for e in meta["output_token_logprobs"]] == r["output_ids"]
    assert all(len(e) == 3 and isinstance(e[2], str) for e in meta["output_token_logprobs"])
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])


def test_stream_is_cumulative_and_matches_non_stream(c):
    body = {"text": "stream this", "stream": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
    with c.stream("POST", "/generate", json=body) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # never taken back
    full = c.post("/generate", json={**body, "stream": False}).json()
    assert texts[-1] == full["text"] and events[-2]["output_ids"] == full["output_ids"]


STREAM_LP = {"text": "shapes of a stream", "stream": True, "return_logprob": True,
             "logprob_start_len": 0, "top_logprobs_num": 2,
             "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}


def _check_entry(e, with_text=False):
    """SGLang 0.5's logprob entry: [logprob, token_id, text or null]."""
    assert isinstance(e, list) and len(e) == 3 and isinstance(e[1], int)
    assert (isinstance(e[2], str) if with_text else e[2] is None)


def test_stream_chunks_follow_sglang_cumulative_format(c):
    """SGLang 0.5's default stream: every chunk holds the whole response so far."""
    with c.stream("POST", "/generate", json=STREAM_LP) as resp:
        events = sse_events(resp)[:-1]
    full = c.post("/generate", json={**STREAM_LP, "stream": False}).json()
    assert len(events) > 1
    for e in events:
        assert set(e) == {"text", "output_ids", "meta_info"}
        meta = e["meta_info"]
        assert {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason",
                "input_token_logprobs", "output_token_logprobs", "input_top_logprobs",
                "output_top_logprobs"} <= set(meta)
        n = len(e["output_ids"])
        assert meta["completion_tokens"] == n == len(meta["output_token_logprobs"]) \
            == len(meta["output_top_logprobs"])
        assert [x[1] for x in meta["output_token_logprobs"]] == e["output_ids"]
        for x in meta["output_token_logprobs"] + meta["input_token_logprobs"]:
            _check_entry(x)
        assert all(len(top) == 2 for top in meta["output_top_logprobs"])
        assert meta["input_token_logprobs"][0][0] is None
    assert all(a["finish_reason"] is None for a in (e["meta_info"] for e in events[:-1]))
    last = events[-1]
    assert last["text"] == full["text"] and last["output_ids"] == full["output_ids"]
    assert last["meta_info"]["output_token_logprobs"] == full["meta_info"]["output_token_logprobs"]


@pytest.fixture(scope="module")
def incremental_server(make_tiny_model):
    from tests.live_server import ServerProcess

    path, _ = make_tiny_model("llama")
    server = ServerProcess("--model", path, "--dtype", "float32", "--context-length", "512",
                           "--max-total-tokens", "2048", "--incremental-streaming-output")
    yield server
    assert server.stop() == 0


def test_incremental_streaming_output_sends_only_what_is_new(incremental_server):
    """``--incremental-streaming-output``: chunks carry the deltas; joined, they are the
    non-streamed response, and completion_tokens is the running count."""
    with incremental_server.client() as c:
        with c.stream("POST", "/generate", json=STREAM_LP) as resp:
            events = sse_events(resp)[:-1]
        full = c.post("/generate", json={**STREAM_LP, "stream": False}).json()
    assert len(events) > 1
    assert "".join(e["text"] for e in events) == full["text"]
    assert [t for e in events for t in e["output_ids"]] == full["output_ids"]
    for name in ("output_token_logprobs", "output_top_logprobs"):
        assert [x for e in events for x in e["meta_info"][name]] == full["meta_info"][name]
    running = 0
    for e in events:
        running += len(e["output_ids"])
        assert e["meta_info"]["completion_tokens"] == running
        assert len(e["meta_info"]["output_token_logprobs"]) == len(e["output_ids"])
        assert e["meta_info"]["input_token_logprobs"] == full["meta_info"]["input_token_logprobs"]


def test_info_routes(c, healthy):
    info = c.get("/model_info").json()
    assert info["context_len"] == 512 and info["is_generation"]
    assert info["kv_cache_dtype"] == info["dtype"]  # auto: the compute dtype
    # dense fp32 weights run torch's matmuls: not batch-invariant, so no n-gram drafts
    assert info["batch_invariant"] is False and info["speculative_ngram"] == 0
    assert c.get("/get_model_info").json() == info
    s = c.get("/server_info").json()
    assert s["invariants_ok"] and s["max_total_tokens"] == 4096
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[info["kv_cache_dtype"]]
    assert s["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * itemsize  # K+V x layers x heads x dim
    assert c.get("/get_server_info").status_code == 200


def test_flush_cache_and_abort_unknown(c):
    assert c.post("/flush_cache").json() == {"flushed": True}
    m = c.get("/server_info").json()["metrics"]
    assert m["kv_cached_tokens"] == 0
    assert c.post("/abort_request", json={"rid": "no-such-request"}).status_code == 200


def test_metrics_prometheus(c):
    c.post("/generate", json={"text": "count me", "sampling_params": {"max_new_tokens": 2}})
    text = c.get("/metrics").text
    for name in ("sgl_running_requests", "sgl_kv_usage", "sgl_cache_hit_rate",
                 "sgl_prompt_tokens_total", "sgl_time_to_first_token_seconds_bucket",
                 "sgl_e2e_request_latency_seconds_count",
                 "sgl_invariant_violations_total 0.0", "sgl_drafts_dropped_total"):
        assert name in text, name


def test_stop_string_is_matched_by_the_front_end_and_ends_the_request(c):
    """The scheduler sends ids only; the tokenizer manager finds the stop string, cuts ids,
    logprobs and counts at the token that completed it, and stops the request (no abort is
    counted, no KV is held afterwards)."""
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = c.post("/generate", json={"text": "stop test", "sampling_params": sp}).json()
    stop = full["text"][4:7]
    assert len(stop) == 3 and stop not in full["text"][:4]
    aborts = c.get("/server_info").json()["metrics"]["aborts"]
    r = c.post("/generate", json={"text": "stop test", "return_logprob": True,
                                  "sampling_params": {**sp, "stop": [stop]}}).json()
    meta = r["meta_info"]
    assert r["text"] == full["text"][:full["text"].index(stop)]
    assert meta["finish_reason"] == {"type": "stop", "matched": stop}
    n = meta["completion_tokens"]
    assert len(r["output_ids"]) == len(meta["output_token_logprobs"]) == n < 12
    assert r["output_ids"] == full["output_ids"][:n]
    import time

    for _ in range(100):  # the stop reaches the scheduler just after the reply
        info = c.get("/server_info").json()
        if info["metrics"]["running_requests"] == 0:
            break
        time.sleep(0.05)
    assert info["metrics"]["aborts"] == aborts and info["metrics"]["kv_usage"] == 0.0


def test_a_stop_regex_that_backtracks_forever_is_a_400_and_freezes_nothing(c, healthy):
    """A grammar forcing 60 a's under stop_regex (a|aa)+c (exponential in a backtracking
    engine): the request ends with a 400 naming the pattern once its search runs out of time,
    and the server (whose event loop runs the search) goes on serving."""
    r = c.post("/generate", json={"text": "Say a:", "sampling_params": {
        "max_new_tokens": 64, "temperature": 0, "regex": "a{60}", "stop_regex": "(a|aa)+c"}})
    assert r.status_code == 400 and "stop_regex" in r.text and "(a|aa)+c" in r.text
    assert c.get("/health").status_code == 200
    ok = c.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4,
                                                                   "ignore_eos": True}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 4


def test_sglang_frontend_sampling_fields_are_accepted(tiny_server):
    """The fields SGLang 0.5's frontend and clients send: meaningful ones work (stop_regex,
    no_stop_trim, min_new_tokens, sampling_seed), cosmetic ones are accepted, structural_tag
    and bad patterns are a 400."""
    sp = {"max_new_tokens": 8, "min_new_tokens": 8, "temperature": 0.7, "top_p": 1.0,
          "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
          "repetition_penalty": 1.0, "ignore_eos": False, "skip_special_tokens": True,
          "spaces_between_special_tokens": True, "stop": [], "stop_token_ids": [],
          "stop_regex": None, "no_stop_trim": False, "regex": None, "json_schema": None,
          "ebnf": None, "n": 1, "custom_params": None, "stream_interval": 1,
          "sampling_seed": 5, "logit_bias": None}
    with tiny_server.client() as c:
        a = c.post("/generate", json={"text": "Hello", "sampling_params": sp})
        b = c.post("/generate", json={"text": "Hello", "sampling_params": sp})
        assert a.status_code == 200, a.text
        assert a.json()["output_ids"] == b.json()["output_ids"]  # sampling_seed is the seed
        assert a.json()["meta_info"]["completion_tokens"] == 8
        r = c.post("/generate", json={"text": "Hello", "sampling_params": {
            **sp, "structural_tag": {"type": "structural_tag"}}})
        assert r.status_code == 400 and "structural_tag" in r.text
        r = c.post("/generate", json={"text": "Hello", "sampling_params": {
            **sp, "stop_regex": "(unclosed"}})
        assert r.status_code == 400 and "stop_regex" in r.text


def test_priority_is_taken_on_both_apis(c):
    """SGLang's /generate ``priority`` (higher first) and vLLM's OpenAI ``priority`` (lower
    first) are accepted (the order itself: tests/unit/test_scheduler.py); not an int: 400."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    plain = c.post("/generate", json=body).json()["output_ids"]
    assert c.post("/generate", json={**body, "priority": 7}).json()["output_ids"] == plain
    r = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2,
                                        "temperature": 0, "priority": -3})
    assert r.status_code == 200
    r = c.post("/generate", json={**body, "priority": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
