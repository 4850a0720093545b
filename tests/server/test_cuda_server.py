"""The real server on a CUDA GPU (scheduler process with CUDA graphs and sampling on the
device) through the openai client: answers, streams, JSON schema, concurrent seeded sampling,
and the KV invariants checked afterwards. Skipped without a GPU."""

from __future__ import annotations

import concurrent.futures as cf
import json

import openai
import pytest

from tests.live_server import ServerProcess, wait_idle

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def server(make_tiny_model):
    path, _ = make_tiny_model("tied")
    s = ServerProcess("--model", path, "--device", "cuda", "--dtype", "float32",
                      "--max-total-tokens", "8192", "--cuda-graph-max-bs", "32")
    yield s
    assert s.stop() == 0, "".join(s.log[-40:])


def test_answers_streams_and_schema_on_the_gpu(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=12,
                                       temperature=0)
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=12,
                                                 temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content and r.usage.completion_tokens == 12
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = client.chat.completions.create(
        model="m", messages=messages, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert isinstance(json.loads(r.choices[0].message.content)["n"], int)


def test_concurrent_seeded_requests_reproduce_and_leave_no_kv(server):
    """40 requests at once (batches crossing several graph buckets, and above the largest
    one, 32, which decodes eagerly): each seeded request gives the same text alone."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    def one(i: int) -> str:
        return client.completions.create(model="m", prompt=f"story {i}", max_tokens=16,
                                         temperature=0.8, seed=i).choices[0].text

    with cf.ThreadPoolExecutor(40) as pool:
        texts = list(pool.map(one, range(40)))
    assert [one(i) for i in (0, 17, 39)] == [texts[0], texts[17], texts[39]]
    info = wait_idle(server, timeout=30)
    assert info["invariant_violations"] == 0 and info["metrics"]["kv_usage"] == 0.0
