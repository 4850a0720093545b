"""Retrievers on the bundled server's own models (``--retriever`` of ``python -m examples.rag``):
dense retrieval through ``/v1/embeddings``, BM25 + dense fused by reciprocal rank, and that
fusion's candidates reranked through ``/v1/rerank``. Each has ``search(query, k)`` like the BM25
:class:`examples.rag.retrieval.Retriever`.

The passage vectors are computed once per corpus and served model and kept on disk (3,741
passages take minutes on 2 cores); queries are embedded as they come.
"""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np

from examples.rag.records import Passage
from examples.rag.retrieval import Retriever
from sgl_adapters.langchain import SGLangEmbeddings, SGLangRerank

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "sgl-adapters", "dense")
RETRIEVERS = ("bm25", "dense", "hybrid", "hybrid+rerank")
RRF_K = 60  # reciprocal rank fusion's constant (Cormack et al., SIGIR 2009)
RERANK_CANDIDATES = 20  # fused candidates the reranker orders


def _doc(p: Passage) -> str:
    return f"{p.title}\n{p.text}" if p.title else p.text


class DenseRetriever:
    """Cosine similarity of the query's vector to every passage's (unit vectors: a dot product).

    Args: passages; base_url: the server; model: its model name (part of the cache key);
    cache_dir: where the passage matrix ([passages, hidden] float32, ``.npy``) is kept (None:
    :data:`CACHE_DIR`).
    ``embed_seconds`` is how long computing it took (0.0 when it was read from disk).
    """

    def __init__(self, passages: list[Passage], base_url: str, model: str,
                 cache_dir: str | None = None):
        self.passages = passages
        self.embeddings = SGLangEmbeddings(base_url=base_url, model=model, max_retries=0)
        key = hashlib.sha256("\x00".join([model, *(p.id + p.text for p in passages)]).encode())
        cache_dir = cache_dir or CACHE_DIR
        path = os.path.join(cache_dir, key.hexdigest()[:24] + ".npy")
        self.embed_seconds = 0.0
        if os.path.exists(path):
            self.matrix = np.load(path)
        else:
            start = time.perf_counter()
            self.matrix = np.asarray(self.embeddings.embed_documents(
                [_doc(p) for p in passages]), dtype=np.float32)
            self.embed_seconds = time.perf_counter() - start
            os.makedirs(cache_dir, exist_ok=True)
            np.save(path, self.matrix)

    def ranked(self, query: str, k: int) -> list[int]:
        """Indices of the ``k`` passages nearest ``query``, nearest first."""
        scores = self.matrix @ np.asarray(self.embeddings.embed_query(query), dtype=np.float32)
        k = min(k, len(self.passages))
        top = np.argpartition(-scores, k - 1)[:k]
        return [int(i) for i in top[np.argsort(-scores[top])]]

    def search(self, query: str, k: int = 3) -> list[Passage]:
        return [self.passages[i] for i in self.ranked(query, k)]


class HybridRetriever:
    """BM25 and dense rankings fused by reciprocal rank (each list's top ``depth``)."""

    def __init__(self, bm25: Retriever, dense: DenseRetriever, depth: int = 50):
        self.bm25, self.dense, self.depth = bm25, dense, depth
        self.passages = dense.passages
        self._index = {p.id: i for i, p in enumerate(self.passages)}

    def ranked(self, query: str, k: int) -> list[int]:
        """Indices of the ``k`` best fused passages, best first."""
        scores: dict[int, float] = {}
        lexical = [self._index[p.id] for p in self.bm25.search(query, self.depth)]
        for ranking in (lexical, self.dense.ranked(query, self.depth)):
            for rank, i in enumerate(ranking):
                scores[i] = scores.get(i, 0.0) + 1.0 / (RRF_K + rank + 1)
        return sorted(scores, key=lambda i: -scores[i])[:k]

    def search(self, query: str, k: int = 3) -> list[Passage]:
        return [self.passages[i] for i in self.ranked(query, k)]


class RerankRetriever:
    """The hybrid ranking's top :data:`RERANK_CANDIDATES`, ordered by the server's reranker."""

    def __init__(self, hybrid: HybridRetriever, base_url: str, model: str):
        self.hybrid, self.passages = hybrid, hybrid.passages
        self.reranker = SGLangRerank(base_url=base_url, model=model, top_n=None)
        self._memo: dict[str, list[int]] = {}  # query -> reranked indices (evaluate asks twice)

    def search(self, query: str, k: int = 3) -> list[Passage]:
        if query not in self._memo:
            candidates = self.hybrid.ranked(query, RERANK_CANDIDATES)
            order = self.reranker.rerank(query, [_doc(self.passages[i]) for i in candidates])
            self._memo[query] = [candidates[j] for j, _ in order]
        return [self.passages[i] for i in self._memo[query][:k]]


def make_retriever(name: str, passages: list[Passage], base_url: str, model: str,
                   bm25: Retriever | None = None):
    """The retriever ``name`` (one of :data:`RETRIEVERS`). Raises ValueError for another."""
    if name not in RETRIEVERS:
        raise ValueError(f"retriever {name!r}: one of {', '.join(RETRIEVERS)}")
    bm25 = bm25 or Retriever(passages)
    if name == "bm25":
        return bm25
    dense = DenseRetriever(passages, base_url, model)
    if name == "dense":
        return dense
    hybrid = HybridRetriever(bm25, dense)
    return hybrid if name == "hybrid" else RerankRetriever(hybrid, base_url, model)
