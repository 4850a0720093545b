"""LoRA adapters through the clients: ``sgl.RuntimeEndpoint(model=...)``, ``SGLangLM(model=...)``
and ``ChatSGLang(model=...)`` run on the adapter they name, on the tiny random Llama serving two
adapters (``lora_server`` in tests/conftest.py)."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

import sgl_adapters as sgl

dspy = pytest.importorskip("dspy")
pytest.importorskip("peft")

from sgl_adapters.dspy import SGLangLM  # noqa: E402
from sgl_adapters.langchain import ChatSGLang  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


def _native(url: str, text: str, lora: str | None) -> str:
    body = {"text": text, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    if lora:
        body["lora_path"] = lora
    return httpx.post(url + "/generate", json=body, timeout=60).json()["text"]


def test_runtime_endpoint_runs_the_named_adapter(lora_server):
    server, _, _ = lora_server
    base = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    assert sgl.RuntimeEndpoint(server.url, model="a0").lora == "a0"
    assert sgl.RuntimeEndpoint(server.url, model=f"{base}:a1").lora == "a1"
    assert sgl.RuntimeEndpoint(server.url, model=base).lora is None

    @sgl.function
    def complete(s, prompt):
        s += prompt + sgl.gen("out", max_tokens=6, temperature=0)

    for lora in ("a0", "a1", None):
        backend = sgl.RuntimeEndpoint(server.url, model=lora)
        for prompt in PROMPTS:
            out = complete.run(prompt=prompt, backend=backend)["out"]
            assert out == _native(server.url, prompt, lora), (lora, prompt)
    texts = {lora: [_native(server.url, p, lora) for p in PROMPTS] for lora in ("a0", "a1", None)}
    assert texts["a0"] != texts[None] and texts["a1"] != texts[None]

    @sgl.function
    def two_adapters(s, prompt):  # gen(lora=...) picks the adapter per call
        s += prompt + sgl.gen("x", max_tokens=6, temperature=0, lora="a1")
        s += sgl.gen("y", max_tokens=6, temperature=0)

    state = two_adapters.run(prompt=PROMPTS[0], backend=sgl.RuntimeEndpoint(server.url,
                                                                             model="a0"))
    assert state["x"] == texts["a1"][0]
    assert state["y"] == _native(server.url, PROMPTS[0] + state["x"], "a0")


def test_chat_sglang_on_an_adapter(lora_server):
    import openai

    server, _, _ = lora_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Name a color."}]
    for model in ("a0", "a1"):
        want = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                              temperature=0).choices[0].message.content
        llm = ChatSGLang(base_url=server.url, model=model, temperature=0, max_tokens=6)
        assert llm.invoke(messages).content == want
        assert llm.hints.backend.lora == model  # shared prefixes are prefilled for the adapter


def test_dspy_modules_on_different_adapters_in_one_batch(lora_server):
    server, _, _ = lora_server
    lms = {name: SGLangLM(model=name, base_url=server.url, cache=False, temperature=0.0,
                          max_tokens=16) for name in ("a0", "a1")}
    questions = ["What is 2 + 2?", "Who wrote Hamlet?"]

    def answer(name: str, question: str) -> str:
        predict = dspy.Predict("question -> answer")
        predict.set_lm(lms[name])
        return predict(question=question).answer

    jobs = [(name, q) for name in lms for q in questions]
    alone = [answer(*job) for job in jobs]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: answer(*job), jobs))
    assert together == alone  # mixed in one batch, each module still runs its own adapter
    assert alone[:2] != alone[2:]
