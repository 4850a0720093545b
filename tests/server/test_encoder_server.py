"""BERT-family models behind the server: a sentence-transformers embedding model answers
/v1/embeddings and /encode with sentence-transformers' own vectors, to the real openai client
and LangChain's OpenAIEmbeddings; a cross-encoder answers /v1/rerank and /score with
CrossEncoder's scores; each refuses what it cannot serve with a 400 naming the model."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from sgl_adapters.backends.runtime import Runtime
from tests.helpers import make_encoder

TEXTS = ["what is the capital of france?", "the cat sat on the mat", "paris is the capital"]
QUERY = "what is the capital of france?"


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("bge_like"))
    make_encoder(path, "BertModel", pooling="mean", normalize=True)
    with Runtime(path, dtype="float32", log_level="warning") as rt:
        yield path, rt.base_url


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("reranker"))
    make_encoder(path, "BertForSequenceClassification", seed=1)
    with Runtime(path, dtype="float32", log_level="warning") as rt:
        yield path, rt.base_url


def test_embeddings_equal_sentence_transformers(embedder):
    from langchain_openai import OpenAIEmbeddings
    from sentence_transformers import SentenceTransformer

    path, url = embedder
    expected = SentenceTransformer(path, device="cpu").encode(TEXTS)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    got = client.embeddings.create(model="m", input=TEXTS)  # base64, the client's default
    assert [d.index for d in got.data] == [0, 1, 2]
    assert np.allclose([d.embedding for d in got.data], expected, atol=1e-4)
    lc = OpenAIEmbeddings(model="m", base_url=url + "/v1", api_key="x",
                          check_embedding_ctx_length=False)
    assert np.allclose(lc.embed_documents(TEXTS), expected, atol=1e-4)
    assert np.allclose(lc.embed_query(TEXTS[1]), expected[1], atol=1e-4)
    native = httpx.post(url + "/encode", json={"text": TEXTS[:2]}).json()
    assert np.allclose([n["embedding"] for n in native], expected[:2], atol=1e-4)
    assert native[0]["meta_info"]["cached_tokens"] == 0  # no radix cache for an encoder


def test_an_embedding_encoder_refuses_generation_and_reranking(embedder):
    _, url = embedder
    for route, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                        ("/v1/rerank", {"query": "q", "documents": ["d"]})):
        r = httpx.post(url + route, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", (route, r.text)
        assert "embedding model" in r.json()["error"]["message"]
    chat = httpx.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 400  # no chat template: the messages cannot be rendered
    too_long = httpx.post(url + "/v1/embeddings", json={"input": " ".join(["paris"] * 200)})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input"
    assert httpx.post(url + "/v1/embeddings", json={"input": "still fine"}).is_success


def test_rerank_and_score_equal_cross_encoder(reranker):
    from sentence_transformers import CrossEncoder

    path, url = reranker
    expected = CrossEncoder(path, device="cpu").predict([(QUERY, t) for t in TEXTS])
    r = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": TEXTS, "top_n": 2})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == list(np.argsort(-expected)[:2])
    for x in results:
        assert abs(x["relevance_score"] - expected[x["index"]]) < 1e-4
        assert x["document"]["text"] == TEXTS[x["index"]]
    scored = httpx.post(url + "/score", json={"text_1": QUERY, "text_2": TEXTS}).json()
    assert np.allclose([d["score"] for d in scored["data"]], expected, atol=1e-4)
    r = httpx.post(url + "/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400 and "cross-encoder" in r.json()["error"]["message"]
    long = httpx.post(url + "/v1/rerank", json={"query": QUERY,
                                                "documents": [" ".join(["paris"] * 200)]})
    assert long.status_code == 400 and long.json()["error"]["param"] == "documents"
