"""Continuous batching over a token-granular KV pool.

Each ``step()`` builds one ForwardBatch: an *extend* batch when prompts are waiting or partly
prefilled (prefill first, as in SGLang), otherwise a *decode* batch of every running request.
``update(batch, out)`` samples from the runner's logits, appends tokens, checks stop conditions
and releases finished requests. New requests join between steps; finished ones leave.

Memory (one pool, slots owned by exactly one request; [2/9] adds the radix cache as an owner):
  * a request holds KV slots for positions ``[0, computed_len)`` in its table row;
  * admission reserves, for every admitted request, its remaining prompt plus
    ``min(remaining max_new_tokens, max_new_tokens_reserve)`` slots;
  * when a step still lacks slots, the newest admitted requests are *retracted*: their slots are
    freed and they return to the waiting queue to be recomputed later (outputs kept).

Token budget: an extend batch holds at most ``chunked_prefill_size`` new tokens; a longer prompt
is prefilled in chunks over several steps (chunked prefill).

Errors: :class:`InvalidRequestError` from :meth:`Scheduler.add_request` for requests that can
never run (empty, too long for the context or the pool, token ids out of range, duplicate id).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from server.cache.kv_pool import TokenKVPool
from server.cache.req_table import ReqToTokenTable
from server.config import SchedulerConfig
from server.model.forward_batch import ForwardBatch, ForwardMode, RunnerOutput
from server.model.sampling import Sampler, top_logprobs
from server.scheduler import policy
from server.scheduler.request import FinishReason, Req, ReqStatus


class InvalidRequestError(ValueError):
    """The request can never be served; ``param`` names the offending field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class TokenDelta:
    """What one step changed for one request: new token ids, the cumulative stream-safe text,
    and the finish reason once finished."""

    rid: str
    new_token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None


@dataclass
class SchedulerStats:
    """Counters since start (tokens unless named otherwise)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    retractions: int = 0
    aborts: int = 0
    forward_passes: int = 0
    finished_requests: int = 0


@dataclass
class _Plan:
    """Per sequence of the in-flight batch: positions whose logits were requested."""

    reqs: list[Req]
    logit_positions: list[list[int]] = field(default_factory=list)


class Scheduler:
    """Args:
        config: batching limits and policy.
        pool: the KV slot pool; req_table: request rows (its width is the context length).
        vocab_size: for token-id validation; context_len: max prompt + output tokens.
        sampler: the batched sampler (seeded for reproducibility).
    """

    def __init__(self, config: SchedulerConfig, pool: TokenKVPool, req_table: ReqToTokenTable,
                 *, vocab_size: int, context_len: int, sampler: Sampler | None = None):
        self.config = config
        self.pool = pool
        self.req_table = req_table
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.sampler = sampler or Sampler()
        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []  # admitted, prompt not fully computed
        self.running: list[Req] = []     # decoding
        self.reqs: dict[str, Req] = {}
        self.stats = SchedulerStats()
        self._plan: _Plan | None = None

    # ---------------------------------------------------------------- requests in and out
    def validate(self, req: Req) -> None:
        """Raise InvalidRequestError / SamplingParamsError if ``req`` can never run."""
        n = len(req.input_ids)
        if n == 0:
            raise InvalidRequestError("input_ids", "the prompt is empty")
        if req.rid in self.reqs:
            raise InvalidRequestError("rid", f"duplicate request id {req.rid!r}")
        bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                "input_ids", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        total = n + req.params.max_new_tokens
        if total > self.context_len:
            raise InvalidRequestError(
                "max_new_tokens", f"prompt ({n} tokens) + max_new_tokens "
                f"({req.params.max_new_tokens}) = {total} exceeds the context length "
                f"{self.context_len}")
        if total - 1 > self.pool.capacity:
            raise InvalidRequestError(
                "input_ids", f"prompt ({n} tokens) + max_new_tokens needs {total - 1} KV slots; "
                f"the pool holds {self.pool.capacity}")
        req.params.validate_for_vocab(self.vocab_size)

    def add_request(self, req: Req) -> None:
        """Validate and queue ``req``; raises (and queues nothing) if it can never run."""
        self.validate(req)
        n = len(req.input_ids)
        req.status = ReqStatus.WAITING
        self.reqs[req.rid] = req
        self.waiting.append(req)
        self.stats.prompt_tokens += n
        if req.wants_input_logprobs and req.logprobs.logprob_start_len == 0:
            req.input_token_logprobs.append((None, req.input_ids[0]))
            if req.logprobs.top_logprobs_num:
                req.input_top_logprobs.append([])

    def abort(self, rid: str, message: str = "aborted") -> TokenDelta | None:
        """End request ``rid`` in any state and free its memory; None if unknown or done."""
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return None
        if req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        self.stats.aborts += 1
        return self._finish(req, FinishReason("abort", message=message))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # ---------------------------------------------------------------- one step
    def step(self) -> ForwardBatch | None:
        """Build the next batch, or None when there is nothing to run."""
        batch = self._schedule_extend() or self._schedule_decode()
        if batch is not None:
            self.stats.forward_passes += 1
        return batch

    def _reserved(self) -> int:
        """Slots admitted requests are still expected to need (see module docstring)."""
        clip = self.config.max_new_tokens_reserve
        return sum(r.uncomputed_len + min(r.remaining_new_tokens, clip)
                   for r in (*self.prefilling, *self.running))

    def _schedule_extend(self) -> ForwardBatch | None:
        budget = self.config.chunked_prefill_size
        chunks: list[tuple[Req, int, torch.Tensor]] = []
        for req in list(self.prefilling):
            if budget <= 0:
                break
            if req.status is not ReqStatus.PREFILLING:
                continue  # retracted by _make_room for an earlier chunk of this step
            n = min(req.uncomputed_len, budget)
            if not self._make_room(n, keep={id(r) for r, _, _ in chunks} | {id(req)}):
                break
            chunks.append((req, n, self.pool.alloc(n)))
            budget -= n
        free_for_new = self.pool.num_free - self._reserved()
        for req in policy.order(self.config.schedule_policy, self.waiting):
            if budget <= 0 or self.req_table.num_free_rows == 0:
                break
            if len(self.prefilling) + len(self.running) >= self.config.max_running_requests:
                break
            need = req.fill_len + min(req.remaining_new_tokens, self.config.max_new_tokens_reserve)
            if need > free_for_new and (self.prefilling or self.running):
                break  # would not fit next to what runs; FCFS does not skip ahead
            n = min(req.fill_len, budget)
            if n > self.pool.num_free:
                break
            self.waiting.remove(req)
            req.row = self.req_table.alloc_row()
            req.status = ReqStatus.PREFILLING
            self.prefilling.append(req)
            chunks.append((req, n, self.pool.alloc(n)))
            budget -= n
            free_for_new -= need
        if not chunks:
            return None
        return self._build_extend(chunks)

    def _build_extend(self, chunks: list[tuple[Req, int, torch.Tensor]]) -> ForwardBatch:
        ids, pos, plan = [], [], _Plan([])
        logits_indices: list[int] = []
        offset = 0
        for req, n, slots in chunks:
            start, end = req.computed_len, req.computed_len + n
            self.req_table.write(req.row, start, slots)
            ids.extend(req.fill_ids[start:end])
            pos.extend(range(start, end))
            wanted = self._logit_positions(req, start, end)
            logits_indices.extend(offset + p - start for p in wanted)
            plan.reqs.append(req)
            plan.logit_positions.append(wanted)
            offset += n
        self._plan = plan
        return ForwardBatch(
            mode=ForwardMode.EXTEND, req_ids=[r.rid for r, _, _ in chunks],
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            out_cache_loc=torch.cat([s for _, _, s in chunks]),
            req_rows=[r.row for r, _, _ in chunks],
            prefix_lens=[r.computed_len for r, _, _ in chunks],
            extend_lens=[n for _, n, _ in chunks],
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
            req_to_token=self.req_table.table)

    @staticmethod
    def _logit_positions(req: Req, start: int, end: int) -> list[int]:
        """Positions in [start, end) whose next-token logits are needed: prompt logprobs not yet
        collected, and the last position when it completes the sequence (to sample)."""
        wanted = []
        if req.wants_input_logprobs:
            first = req.logprobs.logprob_start_len + len(req.input_token_logprobs) - 1
            lo = max(start, first)
            wanted.extend(range(lo, min(end, len(req.input_ids) - 1)))
        if end == req.fill_len and req.params.max_new_tokens > 0 and end - 1 not in wanted:
            wanted.append(end - 1)
        return wanted

    def _schedule_decode(self) -> ForwardBatch | None:
        # Each running request needs one slot; retracting one also lowers the need by one.
        while self.running and self.pool.num_free < len(self.running):
            victims = (*self.running, *self.prefilling)
            self._retract(max(victims, key=lambda r: r.arrival_time))
        if not self.running:
            return None
        reqs = list(self.running)
        slots = self.pool.alloc(len(reqs))
        for req, slot in zip(reqs, slots):
            self.req_table.write(req.row, req.computed_len, slot.view(1))
        self._plan = _Plan(reqs, [[r.computed_len] for r in reqs])
        return ForwardBatch(
            mode=ForwardMode.DECODE, req_ids=[r.rid for r in reqs],
            input_ids=torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64),
            positions=torch.tensor([r.computed_len for r in reqs], dtype=torch.int64),
            out_cache_loc=slots, req_rows=[r.row for r in reqs],
            prefix_lens=[r.computed_len for r in reqs], extend_lens=[1] * len(reqs),
            logits_indices=torch.arange(len(reqs), dtype=torch.int64),
            req_to_token=self.req_table.table)

    def _make_room(self, n: int, keep: set[int] = frozenset()) -> bool:
        """Retract the newest admitted requests (never those whose id() is in ``keep``) until
        ``n`` slots are free. Returns False if that is impossible."""
        while self.pool.num_free < n:
            victims = [r for r in (*self.running, *self.prefilling) if id(r) not in keep]
            if not victims:
                return False
            self._retract(max(victims, key=lambda r: r.arrival_time))
        return True

    def _retract(self, req: Req) -> None:
        self._release(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.waiting.appendleft(req)
        self.stats.retractions += 1

    # ---------------------------------------------------------------- results
    def update(self, batch: ForwardBatch, out: RunnerOutput) -> list[TokenDelta]:
        """Consume the runner's logits for ``batch`` (the last ``step()``'s batch)."""
        plan, self._plan = self._plan, None
        assert plan is not None and [r.rid for r in plan.reqs] == batch.req_ids
        to_sample: list[tuple[Req, int]] = []
        row = 0
        for req, positions, n in zip(plan.reqs, plan.logit_positions, batch.extend_lens):
            rows = list(range(row, row + len(positions)))
            row += len(positions)
            if req.finished:
                continue  # aborted while in flight
            req.computed_len += n
            if req.wants_input_logprobs:
                self._record_input_logprobs(req, positions, rows, out.logits)
            if req.status is ReqStatus.PREFILLING and req.computed_len == req.fill_len:
                self.prefilling.remove(req)
                req.status = ReqStatus.RUNNING
                self.running.append(req)
            if req.status is ReqStatus.RUNNING and positions and positions[-1] == req.fill_len - 1:
                to_sample.append((req, rows[-1]))
        deltas = []
        for req in plan.reqs:
            if (req.status is ReqStatus.RUNNING and req.params.max_new_tokens == 0
                    and req.computed_len == req.fill_len):
                deltas.append(self._finish(req, FinishReason("length")))
        if to_sample:
            deltas.extend(self._sample_and_append(to_sample, out.logits))
        return deltas

    def _record_input_logprobs(self, req: Req, positions: list[int], rows: list[int],
                               logits: torch.Tensor) -> None:
        pairs = [(p, r) for p, r in zip(positions, rows) if p + 1 < len(req.input_ids)]
        if not pairs:
            return
        lp = torch.log_softmax(logits[[r for _, r in pairs]], dim=-1)
        targets = torch.tensor([req.input_ids[p + 1] for p, _ in pairs])
        chosen = lp.gather(1, targets[:, None]).squeeze(1).tolist()
        req.input_token_logprobs.extend(zip(chosen, targets.tolist()))
        if req.logprobs.top_logprobs_num:
            req.input_top_logprobs.extend(top_logprobs(lp, req.logprobs.top_logprobs_num))

    def _sample_and_append(self, items: list[tuple[Req, int]],
                           logits: torch.Tensor) -> list[TokenDelta]:
        reqs = [r for r, _ in items]
        states = []
        for r in reqs:
            r.sampling.banned_ids = r.banned_ids()
            states.append(r.sampling)
        want = any(r.logprobs.return_logprob for r in reqs)
        k = max(r.logprobs.top_logprobs_num for r in reqs)
        sampled = self.sampler.sample(logits[[i for _, i in items]], states,
                                      want_logprobs=want, num_top_logprobs=k)
        deltas = []
        for i, (req, tok) in enumerate(zip(reqs, sampled.next_ids)):
            req.output_ids.append(tok)
            self.stats.generated_tokens += 1
            if req.logprobs.return_logprob:
                req.output_token_logprobs.append((sampled.logprobs[i], tok))
                if req.logprobs.top_logprobs_num:
                    req.output_top_logprobs.append(
                        sampled.top_logprobs[i][:req.logprobs.top_logprobs_num])
            reason = self._check_finished(req, tok)
            if reason is not None:
                deltas.append(self._finish(req, reason, new_ids=[tok]))
            else:
                deltas.append(TokenDelta(req.rid, [tok], self._stream_text(req)))
        return deltas

    def _check_finished(self, req: Req, tok: int) -> FinishReason | None:
        p = req.params
        if tok in p.stop_token_ids or (tok in req.eos_ids and not p.ignore_eos):
            return FinishReason("stop", matched=tok)
        if req.detokenizer is not None:
            req.detokenizer.append(tok)
            if req.detokenizer.matched_stop is not None:
                return FinishReason("stop", matched=req.detokenizer.matched_stop)
        if len(req.output_ids) >= p.max_new_tokens or req.fill_len >= self.context_len:
            return FinishReason("length")
        return None

    @staticmethod
    def _stream_text(req: Req) -> str:
        return req.detokenizer.stream_safe_text if req.detokenizer is not None else ""

    def _finish(self, req: Req, reason: FinishReason,
                new_ids: list[int] | None = None) -> TokenDelta:
        self._release(req)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        self.reqs.pop(req.rid, None)
        self.stats.finished_requests += 1
        return TokenDelta(req.rid, new_ids or [], req.text, reason)

    def _release(self, req: Req) -> None:
        """The one release path (finish, abort, retract): free slots and row. Idempotent."""
        if req in self.prefilling:
            self.prefilling.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req.row is not None:
            self.pool.free(self.req_table.read(req.row, 0, req.computed_len).clone())
            self.req_table.free_row(req.row)
            req.row = None
        req.computed_len = 0

    # ---------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Raise AssertionError unless every slot is free or owned by exactly one request."""
        owned = [self.req_table.read(r.row, 0, r.computed_len)
                 for r in (*self.prefilling, *self.running)]
        held = torch.cat(owned) if owned else torch.empty(0, dtype=torch.int64)
        assert self.pool.num_free + held.numel() == self.pool.capacity, (
            f"free {self.pool.num_free} + held {held.numel()} != capacity {self.pool.capacity}")
        everything = torch.cat((held, self.pool._free))
        assert everything.unique().numel() == everything.numel(), "a KV slot is owned twice"
        assert all(r.row is None for r in self.waiting), "a waiting request holds a row"
