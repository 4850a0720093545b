"""Embedding routes: OpenAI's ``POST /v1/embeddings`` and SGLang's native ``POST /encode``.

An embedding request is a prefill-only request (``max_new_tokens`` 0). On a decoder its answer
is the final hidden state of its last token, L2-normalized (last-token pooling, as decoder
embedding models such as Qwen3-Embedding, e5-mistral and gte-Qwen2 pool; the default model
serves it too), or the mean of every position's where sentence-transformers' ``modules.json``
declares mean pooling (normalized when it lists a Normalize module:
:mod:`server.model.pooling`). It goes through the scheduler like any prompt: batched with
generation, and its KV cached in the radix tree, so last-token texts sharing a prefix (an
instruction, a document) compute it once (a mean-pooled text computes every position: a cached
one's hidden state is not kept). On a BERT-family encoder (bge, e5, gte, MiniLM) it is the
model's own pooling (CLS or mean, as ``modules.json`` declares), normalized when the model does
(no radix cache: the encoder attends both ways).

``/v1/embeddings``: ``input`` a text, a list of texts, token ids or a list of them;
``encoding_format`` "float" (a list of numbers) or "base64" (the float32 values, little-endian,
base64-encoded, as OpenAI's client decodes them); ``dimensions`` only equal to the model's
hidden size (these models are not trained to be truncated: any other value is a 400). Response:
``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
"usage": {"prompt_tokens", "total_tokens"}}``.

``/encode`` (SGLang's shape): ``text`` or ``input_ids``, single or batch; each result is
``{"embedding": [...], "meta_info": {"id", "prompt_tokens", "cached_tokens"}}``, a list of
them for a batch. A sentence-transformers decoder directory whose ``modules.json`` pools
otherwise (max, CLS) is refused with a 400 rather than given last-token vectors, and so is a
cross-encoder reranker.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

from fastapi import APIRouter, Depends, Request

from server.http.admission import admit_embedding, lora_of_model
from server.http.body import body_of
from server.http.errors import ApiError
from server.http.responses import collect, manager_of
from server.http.schemas import EmbeddingRequest, EncodeRequest
from server.http.tokenizer_manager import GenerateInput

router = APIRouter()


def _check_pooling(request: Request) -> None:
    """400 for a cross-encoder reranker (it serves /v1/rerank instead). A decoder whose
    ``modules.json`` declares a pooling not served is refused by the engine core, for every
    request (:func:`server.model.pooling.unserved`)."""
    if manager_of(request).info.num_labels:
        raise ApiError(400, "this model is a cross-encoder reranker: it serves /v1/rerank and "
                       "/score, not embeddings", param="model")


async def embed_inputs(request: Request, inputs: list[GenerateInput]) -> list[Any]:
    """Run the embedding requests together (also a cross-encoder's pairs: ``rerank_routes``);
    the final output of each (its ``embedding`` set).
    Raises ApiError (a refused request) or CancelledError (the client went away: all are
    aborted)."""
    manager = manager_of(request)
    results = await collect(request, [manager.generate(inp) for inp in inputs])
    finals = [outs[-1] for outs in results]
    for out in finals:
        if out.embedding is None:  # aborted in the scheduler (e.g. the server is draining)
            raise ApiError(503, (out.finish_reason or {}).get("message", "no embedding"),
                           type="server_error")
    return finals


@router.post("/v1/embeddings")
async def embeddings(request: Request, body: EmbeddingRequest = Depends(body_of(
        EmbeddingRequest))) -> dict:
    """Embed ``input`` (OpenAI ``POST /v1/embeddings``)."""
    manager = manager_of(request)
    _check_pooling(request)
    size = manager.info.hidden_size
    if body.dimensions is not None and body.dimensions != size:
        raise ApiError(400, f"this model's embeddings have {size} dimensions and cannot be "
                       f"shortened to {body.dimensions}", param="dimensions")
    finals = await embed_inputs(request, await admit_embedding(
        manager, body.input, "input", lora_of_model(manager, body.model)))

    def encode(vector: list[float]) -> list[float] | str:
        if body.encoding_format == "float":
            return vector
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()

    tokens = sum(out.prompt_tokens for out in finals)
    return {"object": "list",
            "data": [{"object": "embedding", "index": k, "embedding": encode(out.embedding)}
                     for k, out in enumerate(finals)],
            "model": request.app.state.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.post("/encode")
async def encode(request: Request, body: EncodeRequest = Depends(body_of(EncodeRequest))
                 ) -> Any:
    """Embed ``text`` or ``input_ids`` (SGLang's native ``POST /encode``)."""
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "give exactly one of text and input_ids", param="text")
    _check_pooling(request)
    param = "text" if body.text is not None else "input_ids"
    given = body.text if body.text is not None else body.input_ids
    inputs = await admit_embedding(manager_of(request), given, param)
    rids = [body.rid] if isinstance(body.rid, str) else body.rid
    if rids is not None:
        if len(rids) != len(inputs):
            raise ApiError(400, f"rid: {len(rids)} ids for {len(inputs)} inputs", param="rid")
        for inp, rid in zip(inputs, rids):
            inp.rid = rid
    finals = await embed_inputs(request, inputs)
    results = [{"embedding": out.embedding,
                "meta_info": {"id": out.rid, "prompt_tokens": out.prompt_tokens,
                              "cached_tokens": out.cached_tokens}} for out in finals]
    single = isinstance(given, str) or all(isinstance(t, int) for t in given)
    return results[0] if single else results
