"""How an embedding model turns a sequence's final hidden states into one vector.

The pooling comes from sentence-transformers' ``modules.json`` when the model directory has
one (its Pooling module's mode, and a Normalize module or not), as ``SentenceTransformer``
itself reads it; without one, a decoder pools by its last token and a BERT-family encoder by
its CLS token, both L2-normalized (SGLang's defaults).

Served poolings: "lasttoken" and "mean" on decoders (Qwen3-Embedding, e5-mistral and gte-Qwen2
pool by the last token; mean pooling needs every prompt position's hidden state, so such a
request computes its whole prompt: no cached prefix), "cls", "mean" and "lasttoken" on encoders
(:mod:`server.model.bert`). A decoder directory declaring another pooling (max, CLS: a causal
model's first position sees nothing else) keeps it in :attr:`Pooling.method`, and its embedding
requests are refused (:func:`unserved`) rather than given last-token vectors.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from server.model.files import sentence_transformers_pooling

DECODER_POOLINGS = ("lasttoken", "mean")
ENCODER_POOLINGS = ("cls", "mean", "lasttoken")


@dataclass(frozen=True)
class Pooling:
    """method: "lasttoken", "mean" or "cls"; normalize: L2-normalize the pooled vector."""

    method: str = "lasttoken"
    normalize: bool = True


def sentence_transformers_normalize(path: str) -> bool | None:
    """Whether a sentence-transformers directory's ``modules.json`` has a Normalize module;
    None when ``path`` has no ``modules.json``."""
    try:
        with open(os.path.join(path, "modules.json")) as f:
            modules = json.load(f)
        return any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def declared_pooling(path: str | None, default: str) -> tuple[str, bool]:
    """(method, normalize) that ``path``'s ``modules.json`` declares; ``default`` (normalized)
    where it declares none. The method is any of sentence-transformers' names ("max",
    "weightedmean", ...): the caller decides what it serves."""
    if not path:
        return default, True
    method = sentence_transformers_pooling(path) or default
    normalize = sentence_transformers_normalize(path)
    return method, True if normalize is None else normalize


def decoder_pooling(path: str | None) -> Pooling:
    """A decoder's :class:`Pooling`, as declared (possibly one not served: :func:`unserved`)."""
    return Pooling(*declared_pooling(path, "lasttoken"))


def unserved(pooling: Pooling) -> str | None:
    """Why a decoder's embeddings cannot be served with ``pooling`` (a refusal's message), or
    None when they can (:data:`DECODER_POOLINGS`)."""
    if pooling.method in DECODER_POOLINGS:
        return None
    return (f"this model pools its embeddings by {pooling.method} (sentence-transformers' "
            f"modules.json); decoder models are served with {' or '.join(DECODER_POOLINGS)} "
            "pooling")
