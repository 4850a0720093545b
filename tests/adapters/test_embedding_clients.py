"""Embeddings and reranking from the bundled server through the clients users point at it, on
the default model: ``SGLangEmbeddings`` (LangChain's standard embeddings suite), stock
``langchain_openai.OpenAIEmbeddings`` and ``dspy.Embedder``, unmodified, all giving the server's
vectors; ``SGLangRerank`` as a LangChain document compressor."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

pytest.importorskip("langchain_core")
langchain_tests = pytest.importorskip("langchain_tests")

from langchain_tests.integration_tests import EmbeddingsIntegrationTests  # noqa: E402

from sgl_adapters.langchain import SGLangEmbeddings  # noqa: E402

TEXTS = ["Paris is the capital of France.", "The mitochondria is the powerhouse of the cell.",
         "Paris is the capital of France."]


@pytest.mark.default_model
class TestSGLangEmbeddingsIntegration(EmbeddingsIntegrationTests):
    url = ""

    @pytest.fixture(autouse=True)
    def _server(self, default_server):
        type(self).url = default_server.url

    @property
    def embeddings_class(self):
        return SGLangEmbeddings

    @property
    def embedding_model_params(self) -> dict:
        return {"base_url": type(self).url}


@pytest.fixture
def ours(default_server):
    return SGLangEmbeddings(base_url=default_server.url, max_retries=0)


@pytest.mark.default_model
def test_vectors_are_unit_length_and_identical_texts_identical(ours):
    vecs = np.array(ours.embed_documents(TEXTS))
    assert vecs.shape == (3, 576)
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)
    assert np.allclose(vecs[0], vecs[2], atol=1e-5)
    assert vecs[0] @ vecs[1] < 0.9999
    assert np.allclose(ours.embed_query(TEXTS[1]), vecs[1], atol=1e-5)
    assert np.allclose(asyncio.run(ours.aembed_documents(TEXTS[:2])), vecs[:2], atol=1e-5)
    instructed = SGLangEmbeddings(base_url=ours.base_url, query_instruction="Query: ")
    assert np.allclose(instructed.embed_query(TEXTS[0]),
                       ours.embed_documents(["Query: " + TEXTS[0]])[0], atol=1e-5)


@pytest.mark.default_model
def test_stock_openai_embeddings_get_the_same_vectors(default_server, ours):
    langchain_openai = pytest.importorskip("langchain_openai")
    # check_embedding_ctx_length=False: otherwise it counts tokens with tiktoken's OpenAI
    # vocabularies (a download) and sends token ids of the wrong tokenizer
    stock = langchain_openai.OpenAIEmbeddings(
        model="default", base_url=default_server.url + "/v1", api_key="x",
        check_embedding_ctx_length=False, max_retries=0)
    assert np.allclose(stock.embed_documents(TEXTS), ours.embed_documents(TEXTS), atol=1e-5)


@pytest.mark.default_model
def test_dspy_embedder_gets_the_same_vectors(default_server, ours):
    dspy = pytest.importorskip("dspy")
    embedder = dspy.Embedder("openai/default", api_base=default_server.url + "/v1",
                             api_key="x", caching=False)
    vecs = embedder(TEXTS[:2])
    assert vecs.shape == (2, 576)
    assert np.allclose(vecs, ours.embed_documents(TEXTS[:2]), atol=1e-5)


@pytest.mark.default_model
def test_sglang_rerank_reorders_documents_by_the_servers_scores(default_server):
    from langchain_core.documents import Document

    from sgl_adapters.langchain import SGLangRerank

    docs = [Document(page_content=t, metadata={"k": k}, id=str(k)) for k, t in enumerate(TEXTS)]
    query = "Which city is the capital of France?"
    kept = SGLangRerank(base_url=default_server.url, top_n=2).compress_documents(docs, query)
    assert len(kept) == 2
    scores = [d.metadata["relevance_score"] for d in kept]
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
    every = SGLangRerank(base_url=default_server.url, top_n=None).rerank(
        query, [d.page_content for d in docs])
    if httpx.get(f"{default_server.url}/get_model_info").json()["batch_invariant"]:
        assert [(d.id, d.metadata["relevance_score"]) for d in kept] == \
            [(str(k), s) for k, s in every[:2]]
    else:  # an AMX machine's default: the second call's cached prefixes extend on other kernels
        again = dict(every)
        assert all(abs(again[int(d.id)] - d.metadata["relevance_score"]) < 0.05 for d in kept)
    assert every[0][1] >= every[-1][1] and sorted(k for k, _ in every) == [0, 1, 2]
    assert SGLangRerank(base_url=default_server.url).compress_documents([], query) == []
