"""``SGLangRerank``: a LangChain document compressor that reorders retrieved documents by the
bundled server's ``/v1/rerank`` scores (:mod:`server.http.rerank_routes`: P(yes) of a judge
prompt per document, the query's prefix computed once in the radix cache).

    from langchain_classic.retrievers import ContextualCompressionRetriever   # or langchain's
    retriever = ContextualCompressionRetriever(
        base_compressor=SGLangRerank(base_url="http://127.0.0.1:30000", top_n=3),
        base_retriever=bm25_retriever)
"""

from __future__ import annotations

from typing import Sequence

import httpx
from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, Document
from pydantic import ConfigDict, Field, SecretStr

from sgl_adapters.langchain.clients import api_key_from_env


class SGLangRerank(BaseDocumentCompressor):
    """Keeps the ``top_n`` documents most relevant to the query, best first, each with its
    score (in [0, 1]) in ``metadata["relevance_score"]``.

    Args (fields): base_url: the server; model; api_key (default ``$SGLANG_API_KEY``); top_n
    (None: all, reordered); instruct: the task relevance is judged for (None: the server's
    web-search default); timeout (seconds).

    Raises ``httpx.HTTPStatusError`` for what the server refuses (its error JSON in the
    response).
    """

    model_config = ConfigDict(populate_by_name=True)

    base_url: str = "http://127.0.0.1:30000"
    model: str = Field(default="default", alias="model_name")
    api_key: SecretStr | None = Field(default_factory=api_key_from_env)
    top_n: int | None = 3
    instruct: str | None = None
    timeout: float = 600.0

    def rerank(self, query: str, texts: Sequence[str]) -> list[tuple[int, float]]:
        """(index into ``texts``, score) of the ``top_n`` best, best first."""
        if not texts:
            return []
        headers = {"Authorization": f"Bearer {self.api_key.get_secret_value()}"} \
            if self.api_key else {}
        r = httpx.post(self.base_url.rstrip("/") + "/v1/rerank", headers=headers,
                       timeout=self.timeout, json={
                           "model": self.model, "query": query, "documents": list(texts),
                           "top_n": self.top_n, "return_documents": False,
                           "instruct": self.instruct})
        r.raise_for_status()
        return [(x["index"], x["relevance_score"]) for x in r.json()["results"]]

    def compress_documents(self, documents: Sequence[Document], query: str,
                           callbacks: Callbacks | None = None) -> Sequence[Document]:
        """The ``top_n`` documents most relevant to ``query``, best first (copies, with
        ``metadata["relevance_score"]``)."""
        out = []
        for k, s in self.rerank(query, [d.page_content for d in documents]):
            doc = documents[k]
            out.append(Document(page_content=doc.page_content, id=doc.id,
                                metadata={**doc.metadata, "relevance_score": s}))
        return out
