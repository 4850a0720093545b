"""Checks that decide, before admission, whether a request can ever run (RELIABILITY rule 2):
a rejected request always gets a clear error naming the field; nothing is queued for it."""

from __future__ import annotations

from typing import Sequence

from server.sampling_params import SamplingParams


class InvalidRequestError(ValueError):
    """The request can never be served; ``param`` names the offending field, ``status`` is
    the HTTP status to answer (400; 404 for something named that does not exist)."""

    def __init__(self, param: str, message: str, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def validate_request(input_ids: Sequence[int], params: SamplingParams, *, vocab_size: int,
                     context_len: int, kv_capacity: int) -> None:
    """Raise InvalidRequestError (or SamplingParamsError) if a request can never run: an empty
    prompt, token ids outside [0, vocab_size), prompt + max_new_tokens over the context length
    (tokens) or needing more KV slots than the whole pool holds."""
    n = len(input_ids)
    if n == 0:
        raise InvalidRequestError("input_ids", "the prompt is empty")
    bad = [t for t in input_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            "input_ids", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    total = n + params.max_new_tokens
    if total > context_len:
        raise InvalidRequestError(
            "max_new_tokens", f"prompt ({n} tokens) + max_new_tokens "
            f"({params.max_new_tokens}) = {total} exceeds the context length {context_len}")
    if total - 1 > kv_capacity:
        raise InvalidRequestError(
            "input_ids", f"prompt ({n} tokens) + max_new_tokens needs {total - 1} KV slots; "
            f"the pool holds {kv_capacity}")
    params.validate_for_vocab(vocab_size)
