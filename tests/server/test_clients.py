"""Clients people already have, unmodified, against a live server: SGLang's own frontend
(``sglang`` 0.5), LlamaIndex's ``llama-index-llms-sglang`` and Outlines' SGLang model. Each
result is checked against the same request made directly (greedy, so equal text), or against
the constraint it asked for. docs/server.md's compatibility table lists what each client lacks."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.live_server import REPO_ROOT


def _generate(server, text: str, max_new_tokens: int) -> str:
    with server.client() as c:
        return c.post("/generate", json={"text": text, "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0}}).json()["text"]


# ---------------------------------------------------------------- SGLang's frontend
def _sglang_programs(url: str, mode: str) -> dict:
    """Run tests/server/sglang_frontend_programs.py in a subprocess (importing sglang patches
    transformers for the whole process)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang (the frontend package) is not installed; `make install` adds it")
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    proc = subprocess.run([sys.executable, "-m", "tests.server.sglang_frontend_programs", url,
                           mode], capture_output=True, text=True, timeout=300, env=env,
                          cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sglang_frontend_programs(healthy):
    out = _sglang_programs(healthy.url, "tiny")
    # gen: the same text as the native API's greedy decode of the same prompt
    assert out["answer"] == _generate(healthy, "Q: what is a radix tree?\nA:", 8)
    # select: the choice with the best normalized prompt logprob
    scores = out["pick_meta"]["normalized_prompt_logprobs"]
    assert out["pick"] == ["red", "green", "blue"][scores.index(max(scores))]
    assert re.fullmatch(r"[0-9]{3}", out["number"])
    # fork / join: each branch continues the shared prefix
    assert out["ideas"] == [_generate(healthy, f"Two ideas:\nIdea {i}:", 6) for i in range(2)]
    # parallel encoding (forks joined by "concate_and_append"): the server's answer to the
    # splice request lets the program go on; the answer continues the concatenated text
    prompt = out["parallel_text"][:-len(out["parallel_answer"]) or None]
    assert prompt.endswith("Statement 1: Noah is the father of Julian.\nQuestion: Who is the "
                           "father of Julian?\nASSISTANT:")
    assert out["parallel_answer"] == _generate(healthy, prompt, 8)
    # logprobs in SGLang's shapes: [logprob, token_id, text-or-null] entries
    meta = out["scored_meta"]
    assert meta["completion_tokens"] == len(meta["output_token_logprobs"]) == 5
    assert all(len(e) == 3 and e[2] is None and e[0] <= 0 for e in meta["output_token_logprobs"])
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert meta["input_token_logprobs"][0][0] is None
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    # streaming text_iter: the pieces make up the non-streamed answer
    assert len(out["stream_pieces"]) > 1
    assert "".join(out["stream_pieces"]) == out["stream_plain"]
    assert out["batch"] == out["single"]


@pytest.mark.default_model
@pytest.mark.slow
def test_sglang_frontend_chat_template_on_the_default_model(default_server):
    """SGLang's frontend renders roles with its own templates. It has no matcher for SmolLM2,
    so it needs ``chat_template_name="chatml"``; then its prompt is the model's own template
    and the answer equals /v1/chat/completions'."""
    out = _sglang_programs(default_server.url, "chat")
    assert out["model_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="default", max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"}])
    assert out["answer"] and out["answer"] == r.choices[0].message.content


# ---------------------------------------------------------------- LlamaIndex
def test_llama_index_llms_sglang(healthy):
    sglang_llm = pytest.importorskip("llama_index.llms.sglang")
    llm = sglang_llm.SGLang(api_url=healthy.url, max_new_tokens=6, temperature=0,
                            additional_kwargs={"ignore_eos": True})
    client = openai.OpenAI(base_url=healthy.url + "/v1", api_key="x", max_retries=0)
    want = client.completions.create(model="m", prompt="Hello there", max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
    # max_new_tokens (SGLang's name) is honoured on /v1/completions
    assert llm.complete("Hello there").text == want.choices[0].text
    constrained = sglang_llm.SGLang(api_url=healthy.url, max_new_tokens=10, regex=r"[a-z]{4}")
    assert re.fullmatch(r"[a-z]{4}", constrained.complete("Word:").text)
    from llama_index.core.llms import ChatMessage

    reply = llm.chat([ChatMessage(role="user", content="Hi")])
    assert reply.message.content
    # the client's stream_complete sends "text" where /v1/completions needs "prompt" (a client
    # bug; SGLang refuses it too): a clear 400, which that client turns into an empty stream
    with healthy.client() as c:
        r = c.post("/v1/completions", json={"text": "Hi", "max_new_tokens": 4, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


# ---------------------------------------------------------------- Outlines
class Order(BaseModel):
    item: Literal["tea", "coffee"]
    cups: int = Field(ge=1, le=9)


def test_outlines_sglang_model(healthy):
    outlines = pytest.importorskip("outlines")
    from outlines.types import CFG, Regex

    model = outlines.from_sglang(openai.OpenAI(base_url=healthy.url + "/v1", api_key="x",
                                               max_retries=0), "m")
    assert model("Tea or coffee?", Literal["tea", "coffee"], max_tokens=5) in ("tea", "coffee")
    assert re.fullmatch(r"[0-9]{2}-[0-9]{2}", model("A date:", Regex(r"[0-9]{2}-[0-9]{2}"),
                                                    max_tokens=10))
    order = Order.model_validate_json(model("Order something.", Order, max_tokens=40))
    assert order.item in ("tea", "coffee")
    # an EBNF grammar (Outlines warns that SGLang expects EBNF rather than Lark)
    with pytest.warns(UserWarning, match="EBNF"):
        said = model("Yes or no?", CFG('root ::= "yes" | "no"'), max_tokens=5)
    assert said in ("yes", "no")
    pieces = list(model.stream("Tell me a story.", max_tokens=6, temperature=0))
    plain = model("Tell me a story.", max_tokens=6, temperature=0)
    assert "".join(p for p in pieces if p) == plain
