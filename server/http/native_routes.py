"""SGLang-style native routes: /generate (text or input_ids, single or batch, streaming),
/flush_cache, /abort_request, /concate_and_append_request. Field names and shapes follow SGLang 0.5's
(``sglang/srt/managers/tokenizer_manager.py``) so its clients work unmodified.

Response of /generate: ``{"text", "output_ids", "meta_info": {"id", "prompt_tokens",
"completion_tokens", "cached_tokens", "finish_reason": {"type": stop|length|abort, ...},
"input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs"}}``
(logprob entries are ``[logprob, token_id, text]``, text null unless
``return_text_in_logprobs``; the prompt's first entry has a null logprob).
``sampling_params.max_new_tokens = 0`` is a prefill-only request (a cache hint).

Streaming (SSE, ``data: [DONE]`` last) as SGLang 0.5 streams: by default every chunk is the
whole response so far (cumulative ``text``, ``output_ids`` and output logprobs, running
``completion_tokens``); with the server flag ``--incremental-streaming-output`` (SGLang's name)
each chunk carries only what is new: the text delta, the new ``output_ids`` and the new entries
of ``output_token_logprobs`` / ``output_top_logprobs`` (prompt logprobs stay whole, as SGLang
sends them; with ``separate_reasoning``, ``reasoning_text`` is a delta too).
With ``separate_reasoning`` on a reasoning model (:mod:`server.reasoning`), "text" is the answer
and "reasoning_text" the thinking (null when there was none), and a constraint in the
sampling params applies to the answer only.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from server import protocol as P
from server.http.admission import admit_generate
from server.http.body import body_of
from server.http.errors import ApiError
from server.http.responses import (
    SSE_DONE,
    check_finish,
    collect,
    guarded,
    manager_of,
    merge,
    sse,
    start_streams,
)
from server.http.schemas import AbortRequest, ConcatenateRequest, GenerateRequest
from server.http.tokenizer_manager import TokenizerManager
from server.reasoning import split

router = APIRouter()


class _Accumulator:
    """Builds the native response of one request from its outputs. Logprob entries are
    rendered once, as they arrive: a chunk costs its new entries plus the JSON of the response
    (re-rendering the whole list per chunk made a 1,000-token top-20 stream O(n^2): 19 s of
    event-loop time, and a backlog flushed at once held /health for 18 s)."""

    def __init__(self, manager: TokenizerManager, with_text: bool,
                 reasoning_state: str | None = None):
        self.manager, self.with_text = manager, with_text
        self.reasoning_state = reasoning_state
        self.ids: list[int] = []
        self.lists: dict[str, list] = {"output_token_logprobs": [], "output_top_logprobs": [],
                                       "input_token_logprobs": [], "input_top_logprobs": []}
        self.last: P.ReqOutput | None = None
        self.sent_ids = 0  # incremental streaming: output entries already sent
        self.sent = {"text": "", "reasoning_text": ""}

    def add(self, out: P.ReqOutput) -> None:
        self.ids += out.new_token_ids
        for name, items in self.lists.items():
            new = getattr(out, name)
            if "top" in name:
                items.extend([self._entry(lp, t) for lp, t in top] for top in new)
            else:
                items.extend(self._entry(lp, t) for lp, t in new)
        self.last = out

    def _entry(self, lp, tok):
        return [lp, tok, self.manager.decode([tok]) if self.with_text else None]

    def body(self, return_logprob: bool, incremental: bool = False) -> dict[str, Any]:
        """The response so far; with ``incremental``, only what the last call did not send.
        Lists in it are this accumulator's own: serialize before the next :meth:`add`."""
        start = self.sent_ids if incremental else 0
        data = self._whole(return_logprob, start)
        if incremental:
            self.sent_ids = len(self.ids)
            for name, sent in self.sent.items():
                text = data.get(name)
                if isinstance(text, str):  # each part only ever grows
                    data[name] = text[len(sent):] if text.startswith(sent) else ""
                    self.sent[name] = text if text.startswith(sent) else sent
        return data

    def _whole(self, return_logprob: bool, start: int = 0) -> dict[str, Any]:
        """The response, with output ids and output logprobs from entry ``start`` on."""
        out = self.last
        meta: dict[str, Any] = {"id": out.rid, "prompt_tokens": out.prompt_tokens,
                                "completion_tokens": out.completion_tokens,
                                "cached_tokens": out.cached_tokens,
                                "finish_reason": out.finish_reason}
        if return_logprob:
            for name, items in self.lists.items():
                meta[name] = items[start:] if start and name.startswith("output") else items
        ids = self.ids[start:] if start else self.ids
        if self.reasoning_state is None:
            return {"text": out.text, "output_ids": ids, "meta_info": meta}
        reasoning, answer = split(out.text, self.reasoning_state, out.finish_reason is not None)
        return {"text": answer, "reasoning_text": reasoning, "output_ids": ids,
                "meta_info": meta}


@router.post("/generate")
async def generate(request: Request, body: GenerateRequest = Depends(body_of(GenerateRequest))):
    """SGLang's native generation: ``text`` or ``input_ids``, one or a batch, streamed (SSE)
    or not; answers ``{text, output_ids, meta_info}`` per prompt."""
    manager = manager_of(request)
    inputs, single = await admit_generate(manager, body)
    streams = [manager.generate(inp) for inp in inputs]
    accs = [_Accumulator(manager, body.return_text_in_logprobs, inp.reasoning_state)
            for inp in inputs]
    if body.stream:
        streams = await start_streams(request, streams)
        incremental = request.app.state.incremental_streaming_output

        async def events():
            async for i, out in merge(streams):
                accs[i].add(out)
                data = accs[i].body(body.return_logprob, incremental)
                if not single:
                    data["index"] = i
                yield sse(data)
            yield SSE_DONE

        return StreamingResponse(guarded(events()), media_type="text/event-stream")
    results = await collect(request, streams)
    for acc, outs in zip(accs, results):
        for out in outs:
            acc.add(out)
        check_finish(outs[-1])
    bodies = [acc.body(body.return_logprob) for acc in accs]
    return bodies[0] if single else bodies


@router.post("/flush_cache")
async def flush_cache(request: Request):
    """Empty the radix cache (SGLang's route); 400 while requests hold KV memory."""
    if not await manager_of(request).flush_cache():
        raise ApiError(400, "the cache cannot be flushed while requests are running; retry when "
                       "idle", param=None)
    return {"flushed": True}


@router.post("/abort_request")
async def abort_request(request: Request, body: AbortRequest = Depends(body_of(AbortRequest))):
    """End request ``rid`` (SGLang's route): it finishes with reason "abort"."""
    await manager_of(request).abort(body.rid)
    return {"aborted": body.rid}


@router.post("/concate_and_append_request")
async def concate_and_append(body: ConcatenateRequest = Depends(body_of(ConcatenateRequest))):
    """SGLang's parallel encoding (its frontend's ``forks.join("concate_and_append")``): SGLang
    splices the forks' KV, each computed after the shared prefix without seeing the others,
    onto ``dst_rid``'s. Here nothing is spliced: the client appends the forks' text to its own
    and sends it with its next request, whose prefix up to the end of the first fork is a
    radix-cache hit and whose other forks are computed after it (exact attention, where
    SGLang's splice approximates it). Answers 200 so that client goes on (any error leaves its
    worker thread dead and the program waiting forever)."""
    return {"success": True, "dst_rid": body.dst_rid, "src_rids": body.src_rids}
