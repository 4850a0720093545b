"""Req: one sequence's state inside the scheduler.

Lengths (tokens):
  * ``fill_ids = input_ids + output_ids``; the last output token's KV is computed by the next
    decode step, so while decoding ``computed_len == len(fill_ids) - 1``.
  * ``computed_len``: leading positions whose KV is valid in the pool (0 while the request holds
    no memory). The memory itself (table row, locked cached prefix, allocated slots) is held
    for the request by :class:`server.cache.manager.CacheManager`, keyed by ``rid``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from server.model.forward_batch import ImageInput
from server.model.pooling import Pooling
from server.model.sampling import SamplingParams, SamplingState, make_generator


class ReqStatus(enum.Enum):
    """Where a request is in its life: waiting -> prefilling -> running -> finished (a
    retracted request goes back to waiting with its outputs)."""

    WAITING = "waiting"      # queued; holds no KV
    PREFILLING = "prefilling"  # admitted; prompt partly computed (chunked prefill)
    RUNNING = "running"      # decoding
    FINISHED = "finished"


@dataclass(frozen=True)
class FinishReason:
    """type: "stop" (EOS, stop token or stop string), "length", "abort" or "error";
    ``status``: for an error the request caused (not the server), the HTTP status (4xx)."""

    type: str
    matched: int | str | None = None
    message: str | None = None
    status: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The finish reason as the APIs send it: ``type`` and the fields that are set."""
        d: dict[str, Any] = {"type": self.type}
        if self.matched is not None:
            d["matched"] = self.matched
        if self.message is not None:
            d["message"] = self.message
        if self.status is not None:
            d["status"] = self.status
        return d


@dataclass(frozen=True)
class LogprobOptions:
    """return_logprob: collect output logprobs; logprob_start_len: first prompt position whose
    logprob is returned (-1: none); top_logprobs_num: top alternatives per position."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0


@dataclass
class Req:
    """One request inside the scheduler: its token ids (prompt ``input_ids``, generated
    ``output_ids``), sampling parameters and state, status, KV progress (``computed_len``
    tokens of ``fill_ids`` have KV in the pool), grammar cursor, pending draft, logprob
    results and timing (seconds, monotonic clock)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    eos_ids: frozenset[int] = frozenset()
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    namespace: Any = None  # radix-cache namespace (e.g. a cache salt)
    lora_slot: int = -1  # the LoRA adapter's slot in the runner (server.model.lora); -1: none
    priority: int = 0  # higher is admitted first (SchedulerConfig.priority)
    computed_len: int = 0
    images: tuple[ImageInput, ...] = ()  # multimodal: where each image's vectors go
    cached_tokens: int = 0  # prompt tokens reused from the cache at first admission
    num_admissions: int = 0
    grammar: Any = None  # server.constrained.grammar.Matcher for constrained requests
    draft: list[int] = field(default_factory=list)  # forced tokens to verify next pass
    draft_source: str = ""  # where ``draft`` came from: "jump_forward" or "ngram"
    passed_steps: int = 0  # scheduling steps in which later arrivals were admitted first
    finish_reason: FinishReason | None = None
    # an embedding request (prefill only); ``pooling``: how its prompt's final hidden states
    # pool (a decoder's; None where the runner pools: an encoder); ``pooled_sum``: mean
    # pooling's running sum of the rows computed so far ([hidden] float32); ``embedding``: the
    # vector (float32), set when its prefill ends
    embed: bool = False
    pooling: Pooling | None = None
    pooled_sum: Any = None
    embedding: list[float] | None = None
    arrival_time: float = field(default_factory=time.monotonic)  # seconds, monotonic clock
    finish_time: float | None = None
    # logprob results: lists of (logprob | None, token_id), and top-k lists per position
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sampling = SamplingState(self.params, self.input_ids, self.output_ids,
                                      make_generator(self.params.seed))

    @property
    def fill_ids(self) -> list[int]:
        """Prompt then output token ids: the sequence whose KV the request needs."""
        return self.input_ids + self.output_ids

    @property
    def key_ids(self) -> list[int]:
        """The radix-cache key of ``fill_ids``: each image's positions carry its content-hash
        id instead of the image token, so only identical images share KV."""
        if not self.images:
            return self.input_ids + self.output_ids
        key = list(self.input_ids)
        for im in self.images:
            key[im.offset:im.offset + im.length] = [im.key] * im.length
        return key + self.output_ids

    @property
    def fill_len(self) -> int:
        """len(fill_ids), without building the list."""
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        """True once the request has a finish reason and left the batch."""
        return self.status is ReqStatus.FINISHED

    @property
    def remaining_new_tokens(self) -> int:
        """Tokens it may still generate (max_new_tokens minus those generated)."""
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def pools_every_row(self) -> bool:
        """An embedding request pooling every prompt position's hidden state (mean pooling):
        it computes its whole prompt (a cached position's hidden state is not kept)."""
        return self.embed and self.pooling is not None and self.pooling.method == "mean"

    @property
    def wants_input_logprobs(self) -> bool:
        """Whether prompt logprobs were asked for (return_logprob with a start position)."""
        return self.logprobs.return_logprob and self.logprobs.logprob_start_len >= 0

    def banned_ids(self) -> tuple[int, ...]:
        """Tokens that may not be sampled now: EOS and stop ids before min_new_tokens (a grammar,
        when present, alone decides when EOS may come)."""
        if len(self.output_ids) >= self.params.min_new_tokens or self.grammar is not None:
            return ()
        return tuple(sorted(set(self.params.stop_token_ids)
                            | (set() if self.params.ignore_eos else set(self.eos_ids))))

