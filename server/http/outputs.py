"""What the tokenizer manager does to a request's outputs on their way to the handler:
merge a backlog of steps into one chunk (:func:`coalesce`), fill in the text and cut it at a
stop string (:func:`with_text`)."""

from __future__ import annotations

import collections
from typing import Any

import msgspec

from server import protocol as P
from server.detokenizer import OutputText

_MERGED_LISTS = ("new_token_ids", "output_token_logprobs", "output_top_logprobs",
                 "input_token_logprobs", "input_top_logprobs")


def coalesce(pending: collections.deque) -> Any:
    """Take the next message from ``pending``, merging a run of outputs into one: when the
    handler falls behind the scheduler (a slow client, a busy event loop), several steps go out
    as one chunk. Counters are cumulative (the last wins), token and logprob lists are
    concatenated (text is filled in afterwards, from the merged ids); an error is never merged
    (it is taken by the next call)."""
    item = pending.popleft()
    if not isinstance(item, P.ReqOutput) or item.finish_reason is not None:
        return item
    merged = None
    while pending and isinstance(pending[0], P.ReqOutput):
        nxt = pending.popleft()
        if merged is None:
            merged = {k: list(getattr(item, k)) for k in _MERGED_LISTS}
        for k in _MERGED_LISTS:
            merged[k].extend(getattr(nxt, k))
        item = msgspec.structs.replace(nxt, **merged)
        if item.finish_reason is not None:
            break
    return item


def with_text(item: P.ReqOutput, text: OutputText) -> tuple[P.ReqOutput, str | None]:
    """``item`` with its text filled in by ``text`` and, when a stop string matched in it, cut
    at the token that completed the match (ids, logprobs, counts, finish reason). Returns the
    matched stop string when the scheduler does not know yet that the request is over."""
    kept = text.feed(item.new_token_ids, item.finish_reason)
    done = text.finish_reason
    stop = done["matched"] if done is not None and item.finish_reason is None else None
    return msgspec.structs.replace(
        item, new_token_ids=item.new_token_ids[:kept],
        text=text.text if done is not None else text.stream_text, finish_reason=done,
        completion_tokens=text.num_tokens,
        output_token_logprobs=item.output_token_logprobs[:kept],
        output_top_logprobs=item.output_top_logprobs[:kept]), stop

