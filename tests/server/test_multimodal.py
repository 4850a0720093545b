"""Images through the live server on the tiny LLaVA: OpenAI image_url parts, native
image_data, the language's sgl.image, cached image KV, and bad images (400, nothing changed)."""

from __future__ import annotations

import base64

import pytest

import sgl_adapters as sgl
from tests.helpers import huge_png, png
from tests.live_server import ServerProcess


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def llava_server(tiny_llava):
    server = ServerProcess("--model", tiny_llava[0], "--dtype", "float32",
                           "--max-total-tokens", "2048", "--context-length", "256")
    yield server
    assert server.stop() == 0, "".join(server.log[-40:])


def chat(client, image: str, text: str = "What is in the image?", **kw):
    return client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image}},
            {"type": "text", "text": text}]}],
        "max_tokens": 3, "temperature": 0, **kw})


def test_chat_image_parts_and_cached_image_tokens(llava_server):
    with llava_server.client() as c:
        info = c.get("/get_model_info").json()
        assert info["is_multimodal"] and info["image_token"] == "<image>"
        assert info["tokens_per_image"] == 4
        first = chat(c, data_url(png(10)))
        assert first.status_code == 200, first.text
        again = chat(c, data_url(png(10)))
        other = chat(c, data_url(png(11)))
    u1, u2, u3 = (r.json()["usage"] for r in (first, again, other))
    assert u1["prompt_tokens"] == u2["prompt_tokens"] == u3["prompt_tokens"]
    assert u2["prompt_tokens_details"]["cached_tokens"] == u2["prompt_tokens"] - 1
    # a different image shares only the text before it (the template's opening)
    assert u3["prompt_tokens_details"]["cached_tokens"] < u2["prompt_tokens"] - 4 - 5
    assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]


def test_native_image_data_and_the_language_image_primitive(llava_server):
    with llava_server.client() as c:
        r = c.post("/generate", json={"text": "<image> Describe it:", "image_data":
                                      data_url(png(12)), "sampling_params": {
                                          "max_new_tokens": 2, "temperature": 0}})
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["prompt_tokens"] >= 4

    @sgl.function
    def describe(s, image):
        s += "Look: " + sgl.image(image) + " It is" + sgl.gen("what", max_tokens=2)

    backend = sgl.RuntimeEndpoint(llava_server.url)
    try:
        s = describe.run(image=png(12), backend=backend, temperature=0)
        assert s.error() is None, s.error()
        assert s.text().count("<image>") == 1
        assert s.get_meta_info("what")["prompt_tokens"] >= 4 + 3
    finally:
        backend.shutdown()


@pytest.mark.parametrize("image, match", [
    ("https://example.com/cat.png", "no network"),
    ("data:image/png;base64,!!!", "base64"),
    (data_url(b"GIF89a not really"), "decod"),
    (data_url(png(13)[:70]), "decod"),
    (data_url(huge_png()), "pixels"),
])
def test_bad_images_get_400_and_change_nothing(llava_server, image, match):
    with llava_server.client() as c:
        before = c.get("/server_info").json()["metrics"]
        r = chat(c, image)
        assert r.status_code == 400 and match in r.json()["error"]["message"], r.text
        r = c.post("/generate", json={"text": "<image> hi", "image_data": image})
        assert r.status_code == 400 and match in r.json()["error"]["message"], r.text
        after = c.get("/server_info").json()["metrics"]
        assert after["prompt_tokens"] == before["prompt_tokens"]
        assert after["kv_free_tokens"] == before["kv_free_tokens"]
        assert chat(c, data_url(png(10))).status_code == 200  # still serving


def test_image_count_must_match_the_placeholders(llava_server):
    with llava_server.client() as c:
        r = c.post("/generate", json={"text": "<image> and <image>",
                                      "image_data": [data_url(png(1))]})
        assert r.status_code == 400 and "2 image placeholders" in r.text


def test_responses_api_input_image_equals_chat(llava_server):
    """/v1/responses ``input_image`` parts go through the chat path: same reply and usage."""
    image = data_url(png(12))
    with llava_server.client() as c:
        want = chat(c, image).json()
        r = c.post("/v1/responses", json={
            "input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": image},
                {"type": "input_text", "text": "What is in the image?"}]}],
            "max_output_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["output"][-1]["content"][0]["text"] == \
            want["choices"][0]["message"]["content"]
        assert got["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]
        assert got["usage"]["input_tokens_details"]["cached_tokens"] == \
            want["usage"]["prompt_tokens"] - 1
        bad = c.post("/v1/responses", json={"input": [{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-1"}]}]})
        assert bad.status_code == 400 and "file ids" in bad.json()["error"]["message"]
