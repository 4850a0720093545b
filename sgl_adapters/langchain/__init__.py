"""LangChain adapter: :class:`ChatSGLang`, a chat model for the bundled server whose tool calls
and structured outputs are grammar-enforced and whose batches share their prefix in the cache.

    from sgl_adapters.langchain import ChatSGLang

    llm = ChatSGLang(base_url="http://127.0.0.1:30000", temperature=0)
    person = llm.with_structured_output(Person).invoke("Ada Lovelace was 36.")

:class:`SGLangEmbeddings` embeds texts with the same server (``/v1/embeddings``);
:class:`SGLangRerank` reorders retrieved documents by its ``/v1/rerank`` scores.
"""

from sgl_adapters.langchain.chat_model import ChatSGLang
from sgl_adapters.langchain.embeddings import SGLangEmbeddings
from sgl_adapters.langchain.rerank import SGLangRerank

__all__ = ["ChatSGLang", "SGLangEmbeddings", "SGLangRerank"]
