"""``SGLangEmbeddings``: LangChain embeddings from the bundled server's ``/v1/embeddings``.

Each text's vector is the final hidden state of its last token, L2-normalized
(:mod:`server.http.embedding_routes`), so cosine similarity is a dot product. Texts are sent in
requests of at most :data:`BATCH` (the server's per-request limit is 256); a batch runs as one
set of prefill passes on the server, and texts sharing a prefix (an instruction) compute it once
in its radix cache.

    from sgl_adapters.langchain import SGLangEmbeddings

    emb = SGLangEmbeddings(base_url="http://127.0.0.1:30000")
    store = InMemoryVectorStore.from_texts(passages, emb)
"""

from __future__ import annotations

from typing import Any

from langchain_core.embeddings import Embeddings
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr

from sgl_adapters.langchain.clients import OpenAIClients, api_key_from_env

BATCH = 64  # texts per request


class SGLangEmbeddings(OpenAIClients, BaseModel, Embeddings):
    """Embeddings from the bundled server (``python -m server``).

    Args (fields): base_url: the server; model: the ``model`` sent (the server has one);
    api_key: its ``--api-key`` (default ``$SGLANG_API_KEY``); query_instruction: text put
    before each query (instruction-tuned embedding models, e.g. Qwen3-Embedding's
    ``"Instruct: ...\\nQuery: "``; documents get none); timeout (seconds), max_retries.

    Raises ``openai.APIError`` subclasses for what the server refuses (e.g. 400 for an empty
    text, naming the input).
    """

    model_config = ConfigDict(populate_by_name=True)

    base_url: str = "http://127.0.0.1:30000"
    model: str = Field(default="default", alias="model_name")
    api_key: SecretStr | None = Field(default_factory=api_key_from_env)
    query_instruction: str = ""
    timeout: float | None = 600.0
    max_retries: int = 2
    _client: Any = PrivateAttr(default=None)
    _async_client: Any = PrivateAttr(default=None)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """One vector (floats, unit length) per text, in order."""
        out: list[list[float]] = []
        for k in range(0, len(texts), BATCH):
            reply = self.client.embeddings.create(model=self.model, input=texts[k:k + BATCH],
                                                  encoding_format="float")
            out.extend(d.embedding for d in sorted(reply.data, key=lambda d: d.index))
        return out

    def embed_query(self, text: str) -> list[float]:
        """The vector of ``query_instruction + text``."""
        return self.embed_documents([self.query_instruction + text])[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        """:meth:`embed_documents` with the async client."""
        out: list[list[float]] = []
        for k in range(0, len(texts), BATCH):
            reply = await self.async_client.embeddings.create(
                model=self.model, input=texts[k:k + BATCH], encoding_format="float")
            out.extend(d.embedding for d in sorted(reply.data, key=lambda d: d.index))
        return out

    async def aembed_query(self, text: str) -> list[float]:
        """:meth:`embed_query` with the async client."""
        return (await self.aembed_documents([self.query_instruction + text]))[0]
