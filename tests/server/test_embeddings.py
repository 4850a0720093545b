"""/v1/embeddings and /encode on a live server: vectors equal transformers' last hidden state of
the last token (normalized) on the same weights, whatever the batch, the cache or the encoding;
bad inputs are 4xx naming the field and leave nothing behind; the real openai client decodes
them."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import openai
import pytest
import torch

IDS = [[5, 17, 301, 42, 7, 99], [5, 17, 301, 42, 8], [1000, 2000, 3000]]


def _reference(hf_model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        h = hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(h, dim=0).numpy()


@pytest.fixture
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)


def test_vectors_are_the_last_tokens_hidden_state_normalized(tiny_server, make_tiny_model,
                                                             client):
    _, hf = make_tiny_model("llama")
    batch = client.embeddings.create(model="m", input=IDS, encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2]
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(map(len, IDS))
    for d, ids in zip(batch.data, IDS):
        assert np.allclose(d.embedding, _reference(hf, ids), atol=1e-4)
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-5
    # alone (a cache hit on the shared prefix now) and base64 (the client's default): the same
    alone = client.embeddings.create(model="m", input=IDS[1])
    assert np.allclose(alone.data[0].embedding, batch.data[1].embedding, atol=1e-5)
    native = tiny_server.client().post("/encode", json={"input_ids": IDS[0], "rid": "e1"}).json()
    assert native["meta_info"]["id"] == "e1" and native["meta_info"]["prompt_tokens"] == 6
    assert native["meta_info"]["cached_tokens"] > 0
    assert np.allclose(native["embedding"], batch.data[0].embedding, atol=1e-5)


def test_text_input_and_native_batch(tiny_server, make_tiny_model):
    _, hf = make_tiny_model("llama")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_tiny_model("llama")[0])
    texts = ["The cat sat on the mat.", "A dog"]
    with tiny_server.client() as c:
        out = c.post("/encode", json={"text": texts}).json()
        openai_shape = c.post("/v1/embeddings", json={"input": texts[0]}).json()
    assert isinstance(out, list) and len(out) == 2
    for res, text in zip(out, texts):
        assert np.allclose(res["embedding"], _reference(hf, tok(text)["input_ids"]), atol=1e-4)
    assert openai_shape["object"] == "list" and openai_shape["data"][0]["object"] == "embedding"
    assert np.allclose(openai_shape["data"][0]["embedding"], out[0]["embedding"], atol=1e-5)


@pytest.mark.parametrize("body, param, status", [
    ({"input": ""}, "input", 400),
    ({"input": []}, "input", 400),
    ({"input": ["fine", ""]}, "input", 400),
    ({"input": [[1, 2, 10**9]]}, "input", 400),
    ({"input": list(range(1, 600))}, "input", 400),  # over the 512-token context
    ({"input": "x", "dimensions": 8}, "dimensions", 400),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", 400),
    ({"input": ["x"] * 1000}, "input", 413),
])
def test_bad_inputs_are_4xx_naming_the_field(tiny_server, body, param, status):
    with tiny_server.client() as c:
        r = c.post("/v1/embeddings", json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param
        assert c.post("/encode", json={"text": "a", "input_ids": [1]}).status_code == 400
        assert c.post("/v1/embeddings", json={"input": "still fine"}).is_success
    metrics = tiny_server.server_info()["metrics"]
    assert metrics["kv_usage"] == 0 and metrics["running_requests"] == 0


def test_embeddings_run_beside_a_generation(tiny_server, client):
    """Embedding requests join the running batch: a stream and 16 embeddings both finish."""
    done = {}

    def stream():
        with tiny_server.client() as c:
            r = c.post("/generate", json={"input_ids": [3, 4, 5], "sampling_params": {
                "max_new_tokens": 64, "ignore_eos": True, "temperature": 0}})
            done["gen"] = r.json()["meta_info"]["completion_tokens"]

    t = threading.Thread(target=stream)
    t.start()
    vectors = client.embeddings.create(model="m", input=[[7, i + 1] for i in range(16)])
    t.join(60)
    assert done["gen"] == 64 and len(vectors.data) == 16
    assert len({tuple(np.round(d.embedding, 5)) for d in vectors.data}) == 16


@pytest.mark.parametrize("kind", ["qwen3", "gemma2"])
def test_other_families_embed_and_rerank_as_transformers(make_tiny_model, kind):
    """Qwen3 (the Qwen3-Embedding / Qwen3-Reranker base: per-head q/k norms) and Gemma 2 (a
    scaled embedding, soft-capped logits): vectors and yes/no scores equal transformers'."""
    from sgl_adapters.backends.runtime import Runtime
    from tests.server.test_rerank import _reference as rerank_reference

    path, hf = make_tiny_model(kind)
    with Runtime(path, dtype="float32", max_total_tokens=4096, context_length=512,
                 log_level="warning") as rt:
        client = openai.OpenAI(base_url=rt.base_url + "/v1", api_key="x", max_retries=0)
        vectors = client.embeddings.create(model="m", input=IDS[:2], encoding_format="float")
        for d, ids in zip(vectors.data, IDS):
            assert np.allclose(d.embedding, _reference(hf, ids), atol=1e-4)
        r = httpx.post(rt.base_url + "/score", json={"text_1": "a question", "text_2": "a text"})
        assert abs(r.json()["data"][0]["score"]
                   - rerank_reference(path, hf, "a question", "a text")) < 1e-4


def _sentence_transformers_dir(src: str, dst, mode: str, normalize: bool) -> str:
    """A copy of the model directory ``src`` as sentence-transformers saves one: modules.json
    (Transformer, Pooling by ``mode``, Normalize when ``normalize``) + 1_Pooling/config.json."""
    import json
    import shutil

    shutil.copytree(src, dst)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (dst / "2_Normalize").mkdir()
    (dst / "1_Pooling").mkdir()
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_max_tokens": mode == "max",
        "pooling_mode_lasttoken": mode == "lasttoken"}))
    return str(dst)


@pytest.mark.parametrize("normalize", [True, False])
def test_a_decoder_declaring_mean_pooling_serves_the_mean(make_tiny_model, tmp_path, normalize):
    """A sentence-transformers decoder directory pooling by the mean (with or without its
    Normalize module): every vector equals SentenceTransformer.encode's, whatever shares the
    pass, across chunked prefill, and after the same prompt was cached (a mean needs every
    position's hidden state: such a request reuses no cached prefix)."""
    from sentence_transformers import SentenceTransformer

    from sgl_adapters.backends.runtime import Runtime

    src, hf = make_tiny_model("llama")
    path = _sentence_transformers_dir(src, tmp_path / "st", "mean", normalize)
    texts = ["the quick brown fox jumps over the lazy dog " * 4, "a short one", "hello world"]
    expected = SentenceTransformer(path, device="cpu").encode(texts, convert_to_numpy=True)
    assert np.allclose(np.linalg.norm(expected, axis=1), 1, atol=1e-5) == normalize
    with torch.no_grad():  # token ids: the mean of transformers' last hidden state
        h = hf.model(torch.tensor([IDS[0]])).last_hidden_state[0].mean(0)
    by_ids = (torch.nn.functional.normalize(h, dim=0) if normalize else h).numpy()
    with Runtime(path, dtype="float32", max_total_tokens=2048, context_length=256,
                 chunked_prefill_size=16, log_level="warning") as rt:
        client = openai.OpenAI(base_url=rt.base_url + "/v1", api_key="x", max_retries=0)
        for _ in range(2):  # the second time every prompt is in the radix tree
            got = client.embeddings.create(model="m", input=texts, encoding_format="float")
            for d, want in zip(got.data, expected):
                assert np.allclose(d.embedding, want, atol=1e-4)
        native = httpx.post(rt.base_url + "/encode", json={"input_ids": IDS[0]}).json()
        assert native["meta_info"]["cached_tokens"] == 0
        assert np.allclose(native["embedding"], by_ids, atol=1e-4)
        gen = httpx.post(rt.base_url + "/v1/completions", json={
            "prompt": texts[0], "max_tokens": 2})  # a generation beside them is unaffected
        assert gen.status_code == 200


def test_a_decoder_declaring_another_pooling_is_refused_not_misserved(make_tiny_model,
                                                                       tmp_path):
    """Max pooling on a decoder is not served: /v1/embeddings is a 400 naming the pooling
    (last-token vectors would be wrong ones), and so is Engine.embed (the engine core refuses
    it); a declared last-token pooling is served."""
    from server.engine import Engine
    from server.scheduler.validation import InvalidRequestError
    from sgl_adapters.backends.runtime import Runtime

    src, _ = make_tiny_model("llama")
    for mode in ("max", "lasttoken"):
        path = _sentence_transformers_dir(src, tmp_path / mode, mode, True)
        if mode == "max":
            engine = Engine(path, dtype="float32", max_total_tokens=512, context_length=256)
            with pytest.raises(InvalidRequestError, match="by max"):
                engine.embed("hi")
            engine.close()
        with Runtime(path, dtype="float32", max_total_tokens=2048, context_length=256,
                     log_level="warning") as rt:
            r = httpx.post(rt.base_url + "/v1/embeddings", json={"input": "hi"})
            if mode == "max":
                assert r.status_code == 400 and "by max" in r.json()["error"]["message"]
            else:
                assert r.status_code == 200 and r.json()["data"][0]["embedding"]


def test_a_base_model_checkpoint_serves_embeddings_only(make_tiny_model, default_tokenizer,
                                                        tmp_path):
    """A checkpoint saved by the base model class (LlamaModel: no "model." prefix, no LM head,
    as e5-mistral's MistralModel ships) loads; its embeddings equal transformers'; generation
    and reranking (they need the LM head) are a 400 naming the model."""
    from sgl_adapters.backends.runtime import Runtime

    _, hf = make_tiny_model("llama")
    hf.model.save_pretrained(tmp_path)
    default_tokenizer.save_pretrained(tmp_path)
    assert "LlamaModel" in (tmp_path / "config.json").read_text()
    with Runtime(str(tmp_path), dtype="float32", max_total_tokens=2048, context_length=256,
                 log_level="warning") as rt:
        client = openai.OpenAI(base_url=rt.base_url + "/v1", api_key="x", max_retries=0)
        vectors = client.embeddings.create(model="m", input=IDS, encoding_format="float")
        for d, ids in zip(vectors.data, IDS):
            assert np.allclose(d.embedding, _reference(hf, ids), atol=1e-4)
        for route, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                            ("/v1/rerank", {"query": "q", "documents": ["d"]})):
            r = httpx.post(rt.base_url + route, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
            assert "embedding model" in r.json()["error"]["message"]
        assert httpx.get(rt.base_url + "/health_generate").status_code == 200  # an embedding
