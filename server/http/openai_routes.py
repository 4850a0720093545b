"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Both completion routes support n, stop, seed, temperature, top_p, max_tokens (chat also
max_completion_tokens), presence/frequency penalties, logit_bias, logprobs, streaming (SSE, with
a final usage chunk when ``stream_options.include_usage``), ``user``, and the extensions top_k,
min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens, skip_special_tokens and
no_stop_trim (completions also take SGLang's ``max_new_tokens`` when ``max_tokens`` is
absent). Usage always reports ``prompt_tokens_details.cached_tokens``. ``response_format``
(json_object, json_schema) and the ``regex`` / ``json_schema`` / ``ebnf`` extensions are
enforced by grammar-constrained decoding;
``tools`` with ``tool_choice`` none/auto/required/named are handled in :mod:`server.http.tools`.
On a reasoning model (``--reasoning-parser``), chat messages and stream deltas carry the
thinking as ``reasoning_content`` and the answer as ``content`` (constraints and tool calls
apply to the answer); ``chat_template_kwargs`` (e.g. ``enable_thinking``) reach the template.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Sequence

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from server import protocol as P
from server.http.admission import admit_chat, admit_completion
from server.http.body import body_of
from server.http.errors import ApiError
from server.http.responses import (
    SSE_DONE,
    check_finish,
    collect,
    guarded,
    manager_of,
    merge,
    openai_finish_reason,
    sse,
    start_streams,
    token_logprobs,
    usage,
)
from server.http.schemas import ChatCompletionRequest, CompletionRequest, _OpenAISampling
from server.http.tokenizer_manager import TokenizerManager
from server.http.tools import as_tool_call
from server.reasoning import ReasoningStream, split

router = APIRouter()


def _model_card(request: Request) -> dict:
    return {"id": request.app.state.model_name, "object": "model", "created": 0,
            "owned_by": "sgl-adapters", "max_model_len": manager_of(request).info.context_len}


def _cards(request: Request) -> list[dict]:
    """The base model's card, then each LoRA adapter's (``parent``: the base, ``root``: its
    path, as vLLM lists adapters)."""
    base = _model_card(request)
    return [base] + [{**base, "id": name, "parent": base["id"], "root": path}
                     for name, path in manager_of(request).loras.items()]


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    """The served model and its LoRA adapters (OpenAI ``GET /v1/models``)."""
    return {"object": "list", "data": _cards(request)}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict:
    """OpenAI's "retrieve model": the served model or an adapter, or 404 naming them."""
    cards = _cards(request)
    for card in cards:
        if model_id == card["id"]:
            return card
    raise ApiError(404, f"model {model_id!r} is not served here (this server serves "
                   f"{[c['id'] for c in cards]})", param="model", type="not_found_error")


# ---------------------------------------------------------------- /v1/completions
def _completion_logprobs(manager: TokenizerManager, outs: list[P.ReqOutput], k: int,
                         echo_ids: list[int] | None) -> dict[str, Any]:
    pairs = [(lp, t) for o in outs for lp, t in o.output_token_logprobs]
    tops = [top for o in outs for top in o.output_top_logprobs]
    if echo_ids is not None:
        ins = [(lp, t) for o in outs for lp, t in o.input_token_logprobs]
        in_tops = [top for o in outs for top in o.input_top_logprobs]
        pairs, tops = ins + pairs, in_tops + tops
    tokens = [manager.decode([t]) for _, t in pairs]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in pairs],
            "top_logprobs": [{manager.decode([t]): lp for lp, t in top} for top in tops]
            if k else None, "text_offset": offsets}


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest = Depends(body_of(CompletionRequest))):
    """OpenAI text completions (``POST /v1/completions``), streamed (SSE) or not."""
    manager = manager_of(request)
    prompts, inputs = await admit_completion(manager, body)
    want_lp = body.logprobs is not None
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = request.app.state.model_name
    streams = [manager.generate(inp) for inp in inputs]
    if body.stream:
        streams = await start_streams(request, streams)

    def prompt_of(i: int) -> list[int]:
        return prompts[i // body.n]

    if body.stream:
        sent = [""] * len(streams)

        def on_output(i: int, out: P.ReqOutput) -> list[dict[str, Any]]:
            delta, sent[i] = out.text[len(sent[i]):], out.text
            if not (delta or out.finish_reason):
                return []
            return [{"index": i, "text": delta, "logprobs": None,
                     "finish_reason": openai_finish_reason(out.finish_reason)}]

        echo = [[{"index": i, "text": manager.decode(prompt_of(i)), "logprobs": None,
                  "finish_reason": None}] for i in range(len(streams) if body.echo else 0)]
        return _stream_response(streams, _chunker(rid, "text_completion", created, model),
                                on_output, body, head=echo)

    results = await collect(request, streams)
    choices = []
    for i, outs in enumerate(results):
        final = outs[-1]
        check_finish(final)
        text = final.text
        if body.echo:
            text = manager.decode(prompt_of(i)) + text
        choices.append({"index": i, "text": text, "finish_reason":
                        openai_finish_reason(final.finish_reason),
                        "logprobs": _completion_logprobs(manager, outs, body.logprobs or 0,
                                                         prompt_of(i) if body.echo else None)
                        if want_lp else None})
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": _usage([r[-1] for r in results])}


def _chunker(rid: str, obj: str, created: int, model: str) -> Callable[..., str]:
    """SSE framing of one OpenAI stream chunk: chunk(choices, **extra) -> "data: {...}"."""
    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse({"id": rid, "object": obj, "created": created, "model": model,
                    "choices": choices, **extra})
    return chunk


def _stream_response(streams, chunk: Callable[..., str],
                     on_output: Callable[[int, P.ReqOutput], list[dict[str, Any]]],
                     body: _OpenAISampling, head: Sequence[list[dict[str, Any]]] = (),
                     tail: Callable[[dict[int, P.ReqOutput]], list[list[dict[str, Any]]]]
                     | None = None) -> StreamingResponse:
    """The one OpenAI streaming loop (completions and chat): ``head`` chunks, then a chunk of
    ``on_output(index, output)``'s choices per output of the merged streams (none if empty),
    then ``tail(last outputs)``'s chunks, the usage chunk once when
    ``stream_options.include_usage``, and ``[DONE]``. Failures after the headers become an
    SSE error event (:func:`server.http.responses.guarded`)."""
    async def events():
        for choices in head:
            yield chunk(choices)
        last: dict[int, P.ReqOutput] = {}
        async for i, out in merge(streams):
            last[i] = out
            choices = on_output(i, out)
            if choices:
                yield chunk(choices)
        for choices in (tail(last) if tail is not None else ()):
            yield chunk(choices)
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], usage=_usage(last.values()))
        yield SSE_DONE

    return StreamingResponse(guarded(events()), media_type="text/event-stream")


def _usage(finals) -> dict[str, Any]:
    finals = list(finals)
    return usage(sum(o.prompt_tokens for o in finals), sum(o.completion_tokens for o in finals),
                 sum(o.cached_tokens for o in finals))


# ---------------------------------------------------------------- /v1/chat/completions
def _chat_logprobs(manager: TokenizerManager, outs: list[P.ReqOutput]) -> dict[str, Any]:
    return {"content": token_logprobs(manager, outs)}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request,
                           body: ChatCompletionRequest = Depends(body_of(ChatCompletionRequest))):
    """OpenAI chat completions (``POST /v1/chat/completions``): chat template, tools and
    ``response_format`` enforced by grammar, streamed (SSE) or not."""
    # admission, tools, reasoning and both response shapes (stream and whole) of one OpenAI
    # route: kept together so the route reads top to bottom
    manager = manager_of(request)
    inputs, tools, use_tools = await admit_chat(manager, body)
    state = inputs[0].reasoning_state

    def message(text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        reasoning, text = split(text, state) if state is not None else (None, text)
        extra = {"reasoning_content": reasoning} if state is not None else {}
        call = as_tool_call(text, tools) if use_tools else None
        if call is None:
            return {"role": "assistant", "content": text, **extra}, finish
        return ({"role": "assistant", "content": None, **extra, "tool_calls": [call]},
                "tool_calls")
    streams = [manager.generate(inp) for inp in inputs]
    if body.stream:
        streams = await start_streams(request, streams)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = request.app.state.model_name

    chunk = _chunker(rid, "chat.completion.chunk", created, model)
    if body.stream and use_tools:  # a tool call is sent whole, once it is known to be one
        def tool_tail(last: dict[int, P.ReqOutput]) -> list[list[dict[str, Any]]]:
            out_chunks = []
            for i, out in sorted(last.items()):
                msg, finish = message(out.text, openai_finish_reason(out.finish_reason))
                delta = {"role": "assistant", "content": msg["content"]}
                if msg.get("reasoning_content"):
                    delta["reasoning_content"] = msg["reasoning_content"]
                if "tool_calls" in msg:
                    delta["tool_calls"] = [{"index": 0, **msg["tool_calls"][0]}]
                out_chunks.append([{"index": i, "delta": delta, "logprobs": None,
                                    "finish_reason": finish}])
            return out_chunks

        return _stream_response(streams, chunk, lambda i, out: [], body, tail=tool_tail)

    if body.stream:
        parts = [ReasoningStream(state or "off") for _ in streams]

        def on_output(i: int, out: P.ReqOutput) -> list[dict[str, Any]]:
            thought, said = parts[i].feed(out.text, final=out.finish_reason is not None)
            lp = _chat_logprobs(manager, [out]) if body.logprobs else None
            if not (thought or said or out.finish_reason or lp):
                return []
            delta = {"reasoning_content": thought} if thought else {}
            if said:
                delta["content"] = said
            return [{"index": i, "delta": delta, "logprobs": lp,
                     "finish_reason": openai_finish_reason(out.finish_reason)}]

        roles = [[{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                   "finish_reason": None}] for i in range(len(streams))]
        return _stream_response(streams, chunk, on_output, body, head=roles)

    results = await collect(request, streams)
    choices = []
    for i, outs in enumerate(results):
        check_finish(outs[-1])
        msg, finish = message(outs[-1].text, openai_finish_reason(outs[-1].finish_reason))
        choices.append({"index": i, "message": msg,
                        "logprobs": _chat_logprobs(manager, outs) if body.logprobs else None,
                        "finish_reason": finish})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": _usage([r[-1] for r in results])}
