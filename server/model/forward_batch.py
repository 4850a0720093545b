"""ForwardBatch (scheduler -> runner) and RunnerOutput (runner -> scheduler): the two plain types
at the scheduler/runner boundary. The scheduler is testable with a fake runner that maps one to
the other."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # new tokens of several sequences (prefill, chunked prefill, forced text)
    DECODE = "decode"  # exactly one new token per sequence


@dataclass
class ForwardBatch:
    """One forward pass over B sequences and T = sum(extend_lens) new tokens.

    Attributes:
        mode: extend or decode.
        req_ids: [B] request ids, in batch order (bookkeeping for the scheduler; the runner
            ignores them).
        input_ids: [T] int64 token ids, sequences concatenated in batch order.
        positions: [T] int64 position of each token in its sequence.
        out_cache_loc: [T] int64 KV slot each new token's K/V is written to.
        req_rows: [B] rows of ``req_to_token`` (already filled for positions < seq_len).
        prefix_lens: [B] tokens whose KV is already in the pool before this pass.
        extend_lens: [B] new tokens per sequence (all 1 in decode).
        logits_indices: [N] int64 indices into the T tokens whose next-token logits are wanted
            (usually the last token of each sequence that finishes its prompt; more for prompt
            logprobs; none for a middle prefill chunk).
        req_to_token: the request table tensor [max_requests, max_context] int64.
    """

    mode: ForwardMode
    req_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    logits_indices: torch.Tensor
    req_to_token: torch.Tensor

    @property
    def batch_size(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class RunnerOutput:
    """logits: [N, vocab] float32, row i for ``batch.logits_indices[i]``."""

    logits: torch.Tensor
