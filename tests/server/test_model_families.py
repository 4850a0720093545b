"""Every supported family serves through the whole server: a tiny random-weight model of each
(HF safetensors directory, the default tokenizer and its chat template) answers
/v1/chat/completions with a JSON schema, and the answer is valid against it (the grammar holds
whatever the random model prefers)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import OpenAI

from sgl_adapters.backends.runtime import Runtime

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("kind", ["qwen3", "phi3", "mixtral", "qwen3_moe", "mistral_swa",
                                  "gemma", "gemma2", "gemma3"])
def test_family_serves_schema_constrained_chat(make_tiny_model, kind):
    path, _ = make_tiny_model(kind)
    with Runtime(path, dtype="float32", max_total_tokens=4096, context_length=512,
                 log_level="warning") as rt:
        client = OpenAI(base_url=rt.base_url + "/v1", api_key="none")
        out = client.chat.completions.create(
            model="default", temperature=0, max_tokens=60,
            # longer than the 16-token windows of the window layers
            messages=[{"role": "user", "content": "Describe a person as JSON. " * 4}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": SCHEMA}})
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
