"""Reranking routes: ``POST /v1/rerank`` (the Jina / Cohere shape SGLang and vLLM accept; also
``/rerank``) and vLLM's ``POST /score``, on a decoder model judged by its yes/no answer.

How a (query, document) pair is scored (the Qwen3-Reranker layout, its model card's reference
code): the chat template renders a system message asking for "yes" or "no", then the user
message ``<Instruct>: {instruct}\\n<Query>: {query}\\n<Document>: {document}`` with the
assistant's turn opened (``enable_thinking`` false: Qwen3's templates then close an empty think
block); the score is P(yes) over {yes, no} for the first answer token,
``sigmoid(logprob(yes) - logprob(no))``, in [0, 1]. Both log-probabilities come from prompt
logprobs of two prefill-only requests (the prompt with "yes" appended, and with "no"): the
second computes one token, the rest is a radix-cache hit, and the query's prefix is computed
once for all documents because the query comes first. On a model not trained for this (the
default model) the scores are valid probabilities but weak judgements.

``/v1/rerank``: ``query``, ``documents`` (texts or ``{"text"}`` objects), ``top_n``,
``return_documents`` (default true), ``instruct``. Response ``{"id", "model", "usage":
{"total_tokens"}, "results": [{"index", "relevance_score", "document": {"text"}}]}``, best
first. ``/score``: ``text_1`` (a query, or one per ``text_2`` entry) and ``text_2``; response
``{"id", "object": "list", "model", "data": [{"index", "object": "score", "score"}],
"usage"}`` in input order.

On a cross-encoder (``*ForSequenceClassification``: bge-reranker, ms-marco MiniLM; served by
:mod:`server.model.bert`) a pair is one sequence, ``[CLS] query [SEP] document [SEP]``, and its
score the sigmoid of the model's relevance logit, as sentence-transformers' ``CrossEncoder``
computes it (``instruct`` is not used).
"""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request

from server.http.admission import check_batch
from server.http.body import body_of
from server.http.embedding_routes import embed_inputs
from server.http.errors import ApiError
from server.http.responses import collect, manager_of
from server.http.schemas import RerankRequest, ScoreRequest
from server.http.tokenizer_manager import GenerateInput, TokenizerManager
from server.sampling_params import SamplingParams

router = APIRouter()

DEFAULT_INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"
JUDGE = ('Judge whether the Document meets the requirements based on the Query and the Instruct '
         'provided. Note that the answer can only be "yes" or "no".')


def rerank_messages(query: str, document: str, instruct: str | None = None) -> list[dict]:
    """The chat messages whose answer scores (``query``, ``document``)."""
    return [{"role": "system", "content": JUDGE},
            {"role": "user", "content": f"<Instruct>: {instruct or DEFAULT_INSTRUCT}\n"
                                        f"<Query>: {query}\n<Document>: {document}"}]


def _answer_id(manager: TokenizerManager, word: str) -> int:
    """The token that starts the answer ``word`` (its first token when it has several)."""
    return manager.tokenizer(word, add_special_tokens=False)["input_ids"][0]


async def _cross_encoder_scores(manager: TokenizerManager, request: Request,
                                pairs: list[tuple[str, str]]) -> tuple[list[float], int]:
    """(sigmoid of a cross-encoder's relevance logit for each (query, document) pair, prompt
    tokens in all): each pair tokenized as the model's tokenizer pairs two texts
    (``[CLS] query [SEP] document [SEP]``), as sentence-transformers' CrossEncoder scores it.
    Raises ApiError."""
    check_batch(manager, len(pairs), "documents")
    tokenized = await asyncio.to_thread(
        lambda: [manager.tokenizer(q, d)["input_ids"] for q, d in pairs])
    inputs = []
    for ids in tokenized:
        if len(ids) > manager.info.context_len:
            raise ApiError(400, f"a query and document take {len(ids)} tokens; the context "
                           f"length is {manager.info.context_len}", param="documents")
        inp = GenerateInput(ids, SamplingParams(max_new_tokens=0), embed=True)
        manager.validate(inp)
        inputs.append(inp)
    logits = [out.embedding for out in await embed_inputs(request, inputs)]
    # the sigmoid as 0.5 (1 + tanh(x / 2)): no overflow for a logit far below zero
    return [0.5 * (1.0 + math.tanh(lg[0] / 2)) for lg in logits], sum(map(len, tokenized))


async def _scores(request: Request, pairs: list[tuple[str, str]], instruct: str | None
                  ) -> tuple[list[float], int]:
    """(P(yes) of each (query, document) pair, or a cross-encoder's sigmoid score; prompt
    tokens in all). Raises ApiError."""
    manager = manager_of(request)
    if manager.info.num_labels:
        return await _cross_encoder_scores(manager, request, pairs)
    if manager.info.embedding_only:  # no LM head to judge with
        raise ApiError(400, f"{manager.info.model_name} is an embedding model (no LM head): it "
                       "serves /v1/embeddings and /encode", param="model")
    check_batch(manager, 2 * len(pairs), "documents")
    yes, no = _answer_id(manager, "yes"), _answer_id(manager, "no")
    prompts = await asyncio.gather(*(manager.apply_chat_template_async(
        rerank_messages(q, d, instruct), template_kwargs={"enable_thinking": False})
        for q, d in pairs))
    inputs = []
    for ids in prompts:
        if len(ids) + 1 > manager.info.context_len:
            raise ApiError(400, f"a query and document take {len(ids)} tokens; the context "
                           f"length is {manager.info.context_len}", param="documents")
        for answer in (yes, no):
            inp = GenerateInput(ids + [answer], SamplingParams(max_new_tokens=0),
                                return_logprob=True, logprob_start_len=len(ids))
            manager.validate(inp)
            inputs.append(inp)
    results = await collect(request, [manager.generate(inp) for inp in inputs])
    logprobs = [[lp for o in outs for lp, _ in o.input_token_logprobs][-1] for outs in results]
    scores = [1.0 / (1.0 + math.exp(logprobs[2 * k + 1] - logprobs[2 * k]))
              for k in range(len(pairs))]
    return scores, sum(len(ids) + 1 for ids in prompts)


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(request: Request, body: RerankRequest = Depends(body_of(RerankRequest))
                 ) -> dict:
    """Order ``documents`` by relevance to ``query`` (Jina / Cohere ``POST /v1/rerank``)."""
    if not body.documents:
        raise ApiError(400, "documents is empty", param="documents")
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    scores, tokens = await _scores(request, [(body.query, t) for t in texts], body.instruct)
    order = sorted(range(len(texts)), key=lambda k: -scores[k])[:body.top_n]
    results: list[dict[str, Any]] = []
    for k in order:
        result: dict[str, Any] = {"index": k, "relevance_score": scores[k]}
        if body.return_documents:
            result["document"] = {"text": texts[k]}
        results.append(result)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": request.app.state.model_name,
            "usage": {"total_tokens": tokens}, "results": results}


@router.post("/score")
async def score(request: Request, body: ScoreRequest = Depends(body_of(ScoreRequest))) -> dict:
    """Score ``text_1`` against each of ``text_2`` (vLLM's ``POST /score``)."""
    second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    first = [body.text_1] * len(second) if isinstance(body.text_1, str) else body.text_1
    if not second or len(first) != len(second):
        raise ApiError(400, f"text_1 must be one text or one per text_2 entry ({len(first)} "
                       f"for {len(second)})", param="text_1")
    scores, tokens = await _scores(request, list(zip(first, second)), body.instruct)
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list",
            "model": request.app.state.model_name,
            "data": [{"index": k, "object": "score", "score": s} for k, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
