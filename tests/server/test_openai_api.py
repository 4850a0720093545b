"""The OpenAI-compatible API through the real ``openai`` client (sync, async, streaming)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from server.engine import Engine


@pytest.fixture
def client(healthy):
    return openai.OpenAI(base_url=healthy.url + "/v1", api_key="unused", max_retries=0)


def test_models(client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id


def test_completion_greedy_equals_engine(client, make_tiny_model):
    path, _ = make_tiny_model("llama")
    engine = Engine(path, dtype="float32", context_length=512, max_total_tokens=2048)
    prompt = "The quick brown fox jumps over"
    want = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    got = client.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == want["text"]
    assert got.usage.completion_tokens == 16
    assert got.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]


def test_completion_batch_n_seed_and_cached_tokens(client):
    prompts = ["alpha beta gamma delta epsilon zeta eta theta", "one two three four five six"]
    r = client.completions.create(model="m", prompt=prompts, max_tokens=6, temperature=1.0,
                                  n=2, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    again = client.completions.create(model="m", prompt=prompts, max_tokens=6, temperature=1.0,
                                      n=2, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prompts were cached


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model="m", prompt="hello world again", max_tokens=3,
                                  temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("hello world again")
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.prompt_tokens + 3
    assert all(len(t) <= 2 for t in lp.top_logprobs)


def test_completion_stream_with_usage(client):
    chunks = list(client.completions.create(
        model="m", prompt="stream me", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    full = client.completions.create(model="m", prompt="stream me", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_basic_stop_and_max_completion_tokens(client):
    r = client.chat.completions.create(
        model="m", messages=[{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        max_completion_tokens=5, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens <= 5
    text = r.choices[0].message.content
    r8 = client.chat.completions.create(
        model="m", messages=[{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"}],
        max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    text = r8.choices[0].message.content
    assert len(text) > 3, text
    stop = text[1:3]
    s = client.chat.completions.create(
        model="m", messages=[{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"}],
        max_tokens=8, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert s.choices[0].message.content == text[:text.index(stop)]
    assert s.choices[0].finish_reason == "stop"


def test_chat_logprobs_and_extensions(client):
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Tell me"}], max_tokens=4,
        temperature=0.8, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5, seed=3,
        logprobs=True, top_logprobs=3, logit_bias={"42": 1.0}, user="u1",
        extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True,
                    "unknown_field": 1})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)


def test_chat_stream(client):
    chunks = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Count"}], max_tokens=6,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Count"}], max_tokens=6,
        temperature=0, extra_body={"ignore_eos": True})
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_async_client_concurrent(healthy):
    async def main():
        client = openai.AsyncOpenAI(base_url=healthy.url + "/v1", api_key="x", max_retries=0)
        rs = await asyncio.gather(*[client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=4,
            temperature=0) for i in range(8)])
        await client.close()
        return rs

    rs = asyncio.run(main())
    assert len(rs) == 8 and all(r.choices[0].finish_reason in ("stop", "length") for r in rs)


@pytest.mark.default_model
@pytest.mark.slow
def test_default_model_chat(default_server):
    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    # whatever the model writes: an answer, ended by EOS or by max_tokens, accounted for
    choice = r.choices[0]
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert (choice.finish_reason == "length") == (r.usage.completion_tokens == 24)


@pytest.mark.default_model
@pytest.mark.slow
def test_default_model_structured_output(default_server):
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "population": {"type": "integer", "minimum": 0,
                                                              "maximum": 100000000}},
              "required": ["city", "population"], "additionalProperties": False}
    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model="default", max_tokens=80, temperature=0,
        messages=[{"role": "user", "content": "Describe Paris as JSON with city and population."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "strict": True, "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    obj = client.chat.completions.create(
        model="default", max_tokens=80, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give me a JSON object about a cat."}])
    # an object of any shape may run past max_tokens; whatever the model writes, the reply
    # is an object when it ends and an object's beginning when cut
    text, choice = obj.choices[0].message.content, obj.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert choice.finish_reason == "length" and obj.usage.completion_tokens == 80
        assert text.lstrip().startswith("{")
