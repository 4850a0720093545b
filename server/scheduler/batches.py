"""ForwardBatch construction: token ids, positions, KV slots and the logit rows to sample.

The scheduler decides *what* runs (which requests, how many tokens each, which slots); these
functions record the slots in the request table and lay the step out for the model runner.
Each returns the :class:`Plan` the scheduler keeps to read the logits back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from server.cache.manager import CacheManager
from server.model.forward_batch import ForwardBatch, ForwardMode
from server.scheduler.request import Req


@dataclass
class Plan:
    """Per sequence of the in-flight batch: positions whose logits were requested."""

    reqs: list[Req]
    logit_positions: list[list[int]] = field(default_factory=list)


def logit_positions(req: Req, start: int, end: int) -> list[int]:
    """Positions in [start, end) whose next-token logits (or final hidden states) are needed:
    prompt logprobs not yet collected, every position of a mean-pooled embedding, and the last
    position when it completes the sequence (to sample, or to pool)."""
    if req.pools_every_row:
        return list(range(start, end))
    wanted = []
    if req.wants_input_logprobs:
        first = req.logprobs.logprob_start_len + len(req.input_token_logprobs) - 1
        wanted.extend(range(max(start, first), min(end, len(req.input_ids) - 1)))
    if end == req.fill_len and (req.params.max_new_tokens > 0 or req.embed) \
            and end - 1 not in wanted:
        wanted.append(end - 1)
    return wanted


def build_extend(chunks: list[tuple[Req, int, torch.Tensor]],
                 cache: CacheManager) -> tuple[ForwardBatch, Plan]:
    """One extend pass: each (req, n, slots) computes positions [computed_len,
    computed_len + n) of ``fill_ids + draft`` into ``slots`` ([n] int64). A request with a
    draft asks for the logits of every position (to verify the draft)."""
    ids, pos, plan = [], [], Plan([])
    images: list = []
    logits_indices: list[int] = []
    prefix_lens = []
    offset = 0
    for req, n, slots in chunks:
        start, end = req.computed_len, req.computed_len + n
        prefix_lens.append(start)
        cache.extend_row(req, slots)
        ids.extend((req.fill_ids + req.draft)[start:end])
        pos.extend(range(start, end))
        for im in req.images:  # image positions this chunk computes
            lo, hi = max(start, im.offset), min(end, im.offset + im.length)
            if lo < hi:
                images.append((offset + lo - start, im, lo - im.offset, hi - im.offset))
        # a draft's rows: the last token's (prompt or output) and each draft token's
        wanted = (list(range(max(start, req.fill_len - 1), end)) if req.draft
                  else logit_positions(req, start, end))
        logits_indices.extend(offset + p - start for p in wanted)
        plan.reqs.append(req)
        plan.logit_positions.append(wanted)
        offset += n
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND, req_ids=[r.rid for r, _, _ in chunks],
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(pos, dtype=torch.int64),
        out_cache_loc=torch.cat([s for _, _, s in chunks]),
        req_rows=[cache.row(r.rid) for r, _, _ in chunks], prefix_lens=prefix_lens,
        extend_lens=[n for _, n, _ in chunks],
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        req_to_token=cache.req_to_token, images=images,
        lora_slots=[r.lora_slot for r, _, _ in chunks])
    return batch, plan


def build_decode(reqs: list[Req], slots: torch.Tensor,
                 cache: CacheManager) -> tuple[ForwardBatch, Plan]:
    """One decode pass: each request's last token into one slot of ``slots`` ([len(reqs)])."""
    cache.extend_rows_by_one(reqs, slots)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE, req_ids=[r.rid for r in reqs],
        input_ids=torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64),
        positions=torch.tensor([r.computed_len for r in reqs], dtype=torch.int64),
        out_cache_loc=slots, req_rows=[cache.row(r.rid) for r in reqs],
        prefix_lens=[r.computed_len for r in reqs], extend_lens=[1] * len(reqs),
        logits_indices=torch.arange(len(reqs), dtype=torch.int64),
        req_to_token=cache.req_to_token, lora_slots=[r.lora_slot for r in reqs])
    return batch, Plan(reqs, [[r.computed_len] for r in reqs])
