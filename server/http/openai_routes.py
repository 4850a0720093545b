"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Both completion routes support n, stop, seed, temperature, top_p, max_tokens (chat also
max_completion_tokens), presence/frequency penalties, logit_bias, logprobs, streaming (SSE, with
a final usage chunk when ``stream_options.include_usage``), ``user``, and the extensions top_k,
min_p, repetition_penalty, stop_token_ids, ignore_eos and min_tokens. Usage always reports
``prompt_tokens_details.cached_tokens``. ``response_format`` (json_object, json_schema)
and the ``regex`` / ``json_schema`` extensions are enforced by grammar-constrained decoding;
``tools`` with ``tool_choice`` none/auto/required/named are handled in :mod:`server.http.tools`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from server import protocol as P
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
    usage,
)
from server.http.schemas import ChatCompletionRequest, CompletionRequest, _OpenAISampling
from server.http.tokenizer_manager import ApiError, GenerateInput, TokenizerManager
from server.http.tools import as_tool_call, call_schema, forced_names, parse_tools, tools_system_prompt
from server.sampling_params import SamplingParams, SamplingParamsError

router = APIRouter()


def _constraint(body: _OpenAISampling) -> dict[str, Any]:
    """response_format (json_object, json_schema) or the regex / json_schema extensions, as
    SamplingParams fields. Raises ApiError for a malformed response_format."""
    rf = body.response_format
    given = [n for n in ("regex", "json_schema") if getattr(body, n) is not None]
    if rf is not None and rf.get("type") not in (None, "text"):
        if given:
            raise ApiError(400, f"give response_format or {given[0]}, not both", param=given[0])
        if rf.get("type") == "json_object":
            return {"json_schema": {"type": "object"}}
        if rf.get("type") == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ApiError(400, "response_format.json_schema must be an object with a "
                               "'schema'", param="response_format")
            return {"json_schema": spec.get("schema") or {"type": "object"}}
        raise ApiError(400, f"response_format type {rf.get('type')!r} is not supported",
                       param="response_format")
    return {"regex": body.regex, "json_schema": body.json_schema}


def _params(body: _OpenAISampling, max_tokens: int, seed_offset: int = 0,
            constraint: dict[str, Any] | None = None) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    fields = {
        "max_new_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "top_k": body.top_k, "min_p": body.min_p, "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty, "stop": stop,
        "stop_token_ids": body.stop_token_ids, "ignore_eos": body.ignore_eos,
        "min_new_tokens": body.min_tokens,
        "seed": None if body.seed is None else body.seed + seed_offset,
        "logit_bias": body.logit_bias,
        **(constraint if constraint is not None else _constraint(body)),
    }
    try:
        return SamplingParams.from_dict(fields)
    except SamplingParamsError as exc:
        param = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}.get(
            exc.param, exc.param)
        raise ApiError(400, str(exc).replace(exc.param, param, 1), param=param) from exc


def _default_max_tokens(manager: TokenizerManager, prompt_len: int) -> int:
    """Without max_tokens: as many as fit both the context and the KV pool (a pool smaller
    than the context length must not refuse every such request)."""
    room = min(manager.info.context_len, manager.info.max_total_tokens)
    return max(room - prompt_len, 0)


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    name = request.app.state.model_name
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                        "owned_by": "sgl-adapters",
                                        "max_model_len": manager_of(request).info.context_len}]}


# ---------------------------------------------------------------- /v1/completions
async def _prompts(manager: TokenizerManager, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await manager.encode_async(prompt)]
    if not prompt:
        raise ApiError(400, "prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [await manager.encode_async(p) for p in prompt]
    return [list(p) for p in prompt]


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
async def completions(request: Request, body: CompletionRequest):
    manager = manager_of(request)
    if body.tools:
        raise ApiError(400, "'tools' is for /v1/chat/completions", param="tools")
    if body.suffix:
        raise ApiError(400, "'suffix' is not supported", param="suffix")
    prompts = await _prompts(manager, body.prompt)
    want_lp = body.logprobs is not None
    inputs = []
    for ids in prompts:
        max_tokens = body.max_tokens if body.max_tokens is not None else \
            _default_max_tokens(manager, len(ids))
        for j in range(body.n):
            inputs.append(GenerateInput(
                ids, _params(body, max_tokens, j), return_logprob=want_lp,
                logprob_start_len=0 if (want_lp and body.echo) else -1,
                top_logprobs_num=body.logprobs or 0))
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = request.app.state.model_name
    for inp in inputs:  # every choice is checked before any is sent
        manager.validate(inp, {"max_new_tokens": "max_tokens", "input_ids": "prompt"})
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
def _messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(body.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"messages[{i}]: content part type {part.type!r} is not "
                                   "supported by this text-only model",
                                   param=f"messages[{i}].content")
                texts.append(part.text)
            content = "".join(texts)
        role = "system" if m.role == "developer" else m.role
        if m.tool_calls and not content:  # an earlier call, shown to the model as it wrote it
            content = "\n".join(json.dumps(_earlier_call(c, f"messages[{i}].tool_calls[{j}]"))
                                for j, c in enumerate(m.tool_calls))
        out.append({"role": role, "content": content or ""})
    return out


def _earlier_call(call: Any, where: str) -> dict[str, Any]:
    """{"name", "arguments"} of an assistant message's earlier tool call. Raises ApiError 400
    naming the field when it is not {"function": {"name": str, "arguments": JSON text}}."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, f"{where}.function must be an object with a string 'name'",
                       param=f"{where}.function")
    args = fn.get("arguments") or "{}"
    try:
        arguments = json.loads(args) if isinstance(args, str) else None
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{where}.function.arguments must be a JSON object encoded as a "
                       "string", param=f"{where}.function.arguments")
    return {"name": fn["name"], "arguments": arguments}


def _chat_logprobs(manager: TokenizerManager, outs: list[P.ReqOutput]) -> dict[str, Any]:
    content = []
    tops = [top for o in outs for top in o.output_top_logprobs]
    for k, (lp, t) in enumerate(p for o in outs for p in o.output_token_logprobs):
        tok = manager.decode([t])
        content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                        "top_logprobs": [{"token": manager.decode([tt]), "logprob": tlp,
                                          "bytes": list(manager.decode([tt]).encode())}
                                         for tlp, tt in (tops[k] if k < len(tops) else [])]})
    return {"content": content}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest):
    manager = manager_of(request)
    tools = parse_tools(body.tools)
    names = forced_names(tools, body.tool_choice)
    messages = _messages(body)
    constraint = None
    if tools and names != []:
        if not manager.template_renders_tools:
            messages = [{"role": "system", "content": tools_system_prompt(tools)}] + messages
        if names:
            if body.response_format or body.regex or body.json_schema:
                raise ApiError(400, "a forced tool call cannot be combined with another "
                               "constraint", param="tool_choice")
            constraint = {"json_schema": call_schema(tools, names)}
    ids = await manager.apply_chat_template_async(
        messages, tools=[{"type": "function", "function": t} for t in tools.values()]
        if tools and names != [] and manager.template_renders_tools else None)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    if max_tokens is None:
        max_tokens = _default_max_tokens(manager, len(ids))
    inputs = [GenerateInput(ids, _params(body, max_tokens, j, constraint),
                            return_logprob=body.logprobs, top_logprobs_num=body.top_logprobs or 0)
              for j in range(body.n)]
    use_tools = bool(tools) and names != []

    def message(text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        call = as_tool_call(text, tools) if use_tools else None
        if call is None:
            return {"role": "assistant", "content": text}, finish
        return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
    for inp in inputs:
        manager.validate(inp, {"max_new_tokens": "max_tokens", "input_ids": "messages"})
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
                if "tool_calls" in msg:
                    delta["tool_calls"] = [{"index": 0, **msg["tool_calls"][0]}]
                out_chunks.append([{"index": i, "delta": delta, "logprobs": None,
                                    "finish_reason": finish}])
            return out_chunks

        return _stream_response(streams, chunk, lambda i, out: [], body, tail=tool_tail)

    if body.stream:
        sent = [""] * len(streams)

        def on_output(i: int, out: P.ReqOutput) -> list[dict[str, Any]]:
            delta, sent[i] = out.text[len(sent[i]):], out.text
            lp = _chat_logprobs(manager, [out]) if body.logprobs else None
            if not (delta or out.finish_reason or lp):
                return []
            return [{"index": i, "delta": {"content": delta} if delta else {}, "logprobs": lp,
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
