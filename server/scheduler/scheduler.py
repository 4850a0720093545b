"""Cache-aware continuous batching over one shared KV pool.

Each ``step()`` builds one ForwardBatch: an *extend* batch when prompts are waiting or partly
prefilled (prefill first, as in SGLang), otherwise a *decode* batch of every running request.
``update(batch, out)`` samples from the runner's logits, appends tokens, checks stop conditions
and releases finished requests (their computed KV goes into the radix cache). New requests join
between steps; finished ones leave.

Admission: the waiting queue is ordered by the policy behind the starvation bound
(:mod:`server.scheduler.waiting`), and each request in turn gets its cached prefix locked (capped
at len-1 so at least one token is computed) and a chunk of its uncached tokens, while the token
budget (``chunked_prefill_size`` new tokens per extend batch) and memory last. Memory for admission
counts free plus evictable slots, minus a reservation for what admitted requests will still need:
their uncomputed prompt plus ``min(remaining max_new_tokens, max_new_tokens_reserve)``.

Mixed batches (``mixed_chunk``, SGLang's ``--enable-mixed-chunk``; vLLM's chunked prefill
schedules the same way): every extend batch also carries one decode token of each running
request, so decoding advances in every pass. Prefill-first alone lets a steady stream of arriving
prompts (the calls of other programs) hold running requests back for as long as it lasts.

In-batch prefix sharing (cache-aware policies): a request whose uncached part this step already
prefills waits one step to reuse that KV (:class:`server.scheduler.waiting.StepSharing`).

Memory is the cache manager's (:mod:`server.cache.manager`): the scheduler asks it to admit,
allocate, cache and release by request, and never touches rows, nodes or the tree. Under
pressure: allocation evicts LRU cache leaves first; when that is not enough, the newest
admitted requests are *retracted*: their computed KV goes into the cache and they return to the
waiting queue (outputs kept), to resume cheaply from their cached prefix later.

Errors: :class:`InvalidRequestError` (``server.scheduler.validation``) from
:meth:`Scheduler.add_request` for requests that can never run, before anything is queued.
"""

from __future__ import annotations

import random
import time
from collections import deque
from typing import Any

import torch

from server.cache.manager import CacheManager
from server.config import SchedulerConfig
from server.constrained.jump_forward import ForcedTokenizer
from server.model.forward_batch import ForwardBatch, RunnerOutput
from server.model.sampling import Sampler
from server.scheduler.batches import Plan, build_decode, build_extend
from server.scheduler.draft_cost import DraftGate
from server.scheduler.metrics import SchedulerStats, snapshot
from server.scheduler.outputs import (
    TokenDelta,
    opening_draft,
    record_prompt_rows,
    request_embedding,
    sample_and_append,
    set_draft,
    verify_draft,
)
from server.scheduler.request import FinishReason, Req, ReqStatus
from server.scheduler.validation import InvalidRequestError, validate_request
from server.scheduler.waiting import StepSharing, WaitingOrder


class Scheduler:
    """Args:
        config: batching limits and policy.
        cache: the owner of KV memory (pool, request table, radix tree).
        vocab_size: for token-id validation; context_len: max prompt + output tokens.
        sampler: the batched sampler (seeded for reproducibility); seed: for the random policy.
        tokenizer: enables jump-forward for constrained requests (unless the config disables
            it); forced tokens are computed by an extend pass like a prompt chunk.
        whole_prompts: never split a prompt (an encoder attends both ways): it waits for budget.
    """

    def __init__(self, config: SchedulerConfig, cache: CacheManager, *, vocab_size: int,
                 context_len: int, sampler: Sampler | None = None, seed: int = 0,
                 tokenizer: Any = None, whole_prompts: bool = False):
        self.config, self.whole_prompts = config, whole_prompts
        self.cache = cache
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.sampler = sampler or Sampler(seed)
        self.jump_forward_tokenizer = (None if config.disable_jump_forward or tokenizer is None
                                       else ForcedTokenizer(tokenizer))  # learns the model's splits
        self.speculative_ngram = config.speculative_ngram
        self.order = WaitingOrder(config, cache, random.Random(seed))
        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []  # admitted, prompt not fully computed
        self.running: list[Req] = []     # decoding
        self.reqs: dict[str, Req] = {}
        self.stats = SchedulerStats()
        self._plan: Plan | None = None
        self.draft_gate = DraftGate()  # keeps a draft only where its verify pass pays
        self._pass: tuple[int, float] | None = None  # (rows, start) of the pass in flight

    # ---------------------------------------------------------------- requests in and out
    def validate(self, req: Req) -> None:
        """Raise InvalidRequestError / SamplingParamsError if ``req`` can never run."""
        if req.rid in self.reqs:
            raise InvalidRequestError("rid", f"duplicate request id {req.rid!r}")
        validate_request(req.input_ids, req.params, vocab_size=self.vocab_size,
                         context_len=self.context_len, kv_capacity=self.cache.capacity)

    def add_request(self, req: Req) -> None:
        """Validate and queue ``req``; raises (and queues nothing) if it can never run."""
        self.validate(req)
        req.status = ReqStatus.WAITING
        self.reqs[req.rid] = req
        self.waiting.append(req)
        self.cache.prefetch(req)  # pages of its prefix on disk: read ahead, off this thread
        self.stats.prompt_tokens += len(req.input_ids)
        if req.wants_input_logprobs and req.logprobs.logprob_start_len == 0:
            req.input_token_logprobs.append((None, req.input_ids[0]))
            if req.logprobs.top_logprobs_num:
                req.input_top_logprobs.append([])

    def abort(self, rid: str, message: str = "aborted", error: bool = False) -> TokenDelta | None:
        """End request ``rid`` in any state and free its memory; None if unknown or done.
        ``error`` reports finish reason "error" (a request-scoped failure) instead of "abort"."""
        return self._end(rid, FinishReason("error" if error else "abort", message=message))

    def stop(self, rid: str, matched: str) -> TokenDelta | None:
        """End request ``rid`` because a front end matched stop string ``matched`` in its text
        (finish reason "stop", not counted as an abort); None if unknown or done."""
        return self._end(rid, FinishReason("stop", matched=matched))

    def _end(self, rid: str, reason: FinishReason) -> TokenDelta | None:
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return None
        if req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        self.stats.aborts += reason.type != "stop"
        return self._finish(req, reason)

    def fail_batch(self, batch: ForwardBatch, message: str) -> list[TokenDelta]:
        """End every request of an in-flight ``batch`` whose forward or update failed, with
        finish reason "error"; the scheduler is ready for the next step."""
        self._plan = None
        return [d for rid in batch.req_ids if (d := self.abort(rid, message, error=True))]

    def reset_stats(self) -> None:
        """Zero the counters (e.g. after a warm-up; the cache's own counter, reported with ours)."""
        self.stats, self.cache.stats.evicted_tokens = SchedulerStats(), 0

    def flush_cache(self) -> bool:
        """Empty the radix cache; refused (False) while any request holds KV memory."""
        return self.cache.flush()

    @property
    def reading_ahead(self) -> bool:
        """Whether a waiting request waits for its cached pages to come from disk."""
        return any(not self.cache.ready(r) for r in self.waiting)

    @property
    def has_work(self) -> bool:
        """Requests are waiting, prefilling or running."""
        return bool(self.waiting or self.prefilling or self.running)

    # ---------------------------------------------------------------- one step
    def step(self) -> ForwardBatch | None:
        """Build the next batch, or None when there is nothing to run."""
        batch = self._schedule_extend() or self._schedule_decode()
        if batch is not None:
            self.stats.forward_passes += 1
            self._pass = (int(batch.input_ids.numel()), time.perf_counter())
        return batch

    def _reserved(self) -> int:
        clip = self.config.max_new_tokens_reserve
        alloc = self.cache.alloc_len
        return sum(r.fill_len - alloc(r.rid) + min(r.remaining_new_tokens, clip)
                   for r in (*self.prefilling, *self.running))

    def _schedule_extend(self) -> ForwardBatch | None:
        """Chunks of admitted prompts, then newly admitted ones, then (mixed) the decodes."""
        budget = self.config.chunked_prefill_size
        chunks: list[tuple[Req, int, torch.Tensor]] = []
        budget = self._continue_prefills(chunks, budget)
        admitted = self._admit_waiting(chunks, budget)
        self.order.passed_over(self.waiting, admitted)
        if chunks and (self.config.mixed_chunk or (all(r.draft for r, _, _ in chunks)
                                                   and not admitted)):
            # Mixed batch: the running requests decode in the same pass (as 1-token extends), so
            # arriving prompts never stall decoding; unmixed, only beside jump-forward verifies.
            for req in list(self.running):
                slots = self._alloc(1, keep={id(r) for r, _, _ in chunks} | {id(req)})
                if slots is None or req.status is not ReqStatus.RUNNING:
                    break
                chunks.append((req, 1, slots))
        if not chunks:
            return None
        batch, self._plan = build_extend(chunks, self.cache)
        return batch

    def _continue_prefills(self, chunks: list, budget: int) -> int:
        """Next chunks of admitted prompts and jump-forward verifications (appended to
        ``chunks``); returns the budget left."""
        for req in list(self.prefilling):
            if budget <= 0:
                break
            if req.status is not ReqStatus.PREFILLING:
                continue  # retracted to make room for an earlier chunk of this step
            if req.draft:  # a jump-forward verification: the last token plus its drafts, whole
                n = req.fill_len - self.cache.alloc_len(req.rid) + len(req.draft)
                if n > budget and chunks:
                    continue
            else:
                n = min(req.fill_len - self.cache.alloc_len(req.rid), budget)
            slots = self._alloc(n, keep={id(r) for r, _, _ in chunks} | {id(req)})
            if slots is None:
                break
            chunks.append((req, n, slots))
            budget -= n
        return budget

    def _admit_waiting(self, chunks: list, budget: int) -> list[Req]:
        """Admit waiting requests in order while rows, budget and memory last (first chunks
        appended to ``chunks``); returns the admitted requests."""
        admitted: list[Req] = []
        in_step = StepSharing(self.config, self.cache, (r for r, _, _ in chunks))
        for req in self.order.order(self.waiting):
            if budget <= 0 or self.cache.free_rows == 0:
                break
            if len(self.prefilling) + len(self.running) >= self.config.max_running_requests:
                break
            if in_step.defer(req):
                continue  # computed by another request this step: it will be a cache hit next
            if self.whole_prompts and chunks and req.fill_len > budget:
                break
            if not self.cache.ready(req):
                continue  # its cached pages are still being read from disk
            hit = self.cache.admit(req)
            req.computed_len = hit.cached_len
            need = req.fill_len - req.computed_len + min(req.remaining_new_tokens,
                                                         self.config.max_new_tokens_reserve)
            n = min(req.fill_len - req.computed_len, budget)
            if n == req.fill_len - req.computed_len:  # the whole prompt: its pass verifies
                req.draft = opening_draft(req, self.context_len, self.jump_forward_tokenizer)
                req.draft_source, n = "jump_forward", n + len(req.draft)  # the forced opening
            fits = need <= self.cache.available - self._reserved() or not (self.prefilling or self.running)
            slots = self.cache.alloc(n) if fits else None
            if slots is None:
                self.cache.release(req, cache=False)  # only the prefix lock is undone
                req.computed_len, req.draft = 0, []
                break  # no skipping ahead: the policy's order is respected
            self.waiting.remove(req)
            req.status = ReqStatus.PREFILLING
            if req.num_admissions == 0:
                req.cached_tokens = min(hit.cached_len, len(req.input_ids))
                self.stats.cached_prompt_tokens += req.cached_tokens
            req.num_admissions += 1
            self.prefilling.append(req)
            chunks.append((req, n, slots))
            admitted.append(req)
            budget -= n
            in_step.add(req)
        return admitted

    def _schedule_decode(self) -> ForwardBatch | None:
        # Each running request needs one slot; retracting one also lowers the need by one.
        while self.running and self.cache.available < len(self.running):
            self._retract(max((*self.running, *self.prefilling), key=lambda r: r.arrival_time))
        if not self.running:
            return None
        reqs = list(self.running)
        batch, self._plan = build_decode(reqs, self.cache.alloc(len(reqs)), self.cache)
        return batch

    def _alloc(self, n: int, keep: set[int]) -> torch.Tensor | None:
        """Allocate ``n`` slots, retracting the newest admitted requests (never those whose id()
        is in ``keep``) while even eviction cannot make room."""
        while self.cache.available < n:
            victims = [r for r in (*self.running, *self.prefilling) if id(r) not in keep]
            if not victims:
                return None
            self._retract(max(victims, key=lambda r: r.arrival_time))
        return self.cache.alloc(n)

    def _retract(self, req: Req) -> None:
        self._release(req)
        req.draft = []  # the grammar state was restored when the draft was made
        req.status = ReqStatus.WAITING
        self.waiting.appendleft(req)
        self.stats.retractions += 1

    # ---------------------------------------------------------------- results
    def update(self, batch: ForwardBatch, out: RunnerOutput) -> list[TokenDelta]:
        """Consume the runner's logits for ``batch`` (the last ``step()``'s batch)."""
        plan, self._plan = self._plan, None
        assert plan is not None and [r.rid for r in plan.reqs] == batch.req_ids
        to_sample: list[tuple[Req, int]] = []
        deltas: list[TokenDelta] = []
        row = 0
        for req, positions, n in zip(plan.reqs, plan.logit_positions, batch.extend_lens):
            rows = range(row, row + len(positions))
            row += len(positions)
            if req.finished or not self.cache.holds(req.rid):
                continue  # aborted or retracted while in flight
            if req.draft and req.status is ReqStatus.PREFILLING:
                if req.computed_len < req.fill_len - 1:  # its prompt's pass: cache the prompt
                    req.computed_len = req.fill_len
                    self.cache.cache_unfinished(req)
                deltas.append(self._verify_draft(req, rows, out.logits))
                continue
            req.computed_len += n
            record_prompt_rows(req, positions, rows, out)
            if req.status is ReqStatus.PREFILLING:
                # Prompt KV (a chunk, or the whole prompt) goes into the tree at once, so
                # requests arriving meanwhile share it instead of recomputing it.
                self.cache.cache_unfinished(req)
                if req.computed_len < req.fill_len:
                    continue
                self.prefilling.remove(req)
                req.status = ReqStatus.RUNNING
                self.running.append(req)
                if req.params.max_new_tokens == 0:  # prefill-only: cache it and finish
                    req.embedding = request_embedding(req, out, rows[-1]) if req.embed else None
                    deltas.append(self._finish(req, FinishReason("length")))
                    continue
            to_sample.append((req, rows[-1]))
        if to_sample:
            for req, tok, reason in sample_and_append(
                    self.sampler, to_sample, out.logits, self.context_len,
                    self.jump_forward_tokenizer, self.speculative_ngram):
                self.stats.generated_tokens += 1
                if reason is not None:
                    deltas.append(self._finish(req, reason, [tok]))
                    continue
                self.draft_gate.trim(req, self.running, self.prefilling)  # grammar restored
                if req.draft:  # forced tokens: verify them all in one extend pass
                    self.running.remove(req)
                    req.status = ReqStatus.PREFILLING
                    self.prefilling.append(req)
                deltas.append(TokenDelta(req.rid, [tok]))
        if self._pass is not None:  # forward + sampling (which waits for a GPU's results)
            rows, start = self._pass
            self.draft_gate.costs.record(rows, time.perf_counter() - start)
            self._pass = None
        return deltas

    def _verify_draft(self, req: Req, rows: range, logits: torch.Tensor) -> TokenDelta:
        """Sample each draft position as plain decoding would; keep drafts while they match
        (see :mod:`server.constrained.jump_forward`). Frees the KV of rejected drafts."""
        produced, reason = verify_draft(self.sampler, req, rows, logits, self.context_len)
        drafts, req.draft, source = req.draft, [], req.draft_source
        if reason is None:  # the next draft is made once, after the last token
            set_draft(req, produced[-1], self.context_len, self.jump_forward_tokenizer,
                      self.speculative_ngram)
        req.computed_len = req.fill_len - 1  # the last token's KV is computed next pass
        self.cache.truncate_alloc(req)
        self.draft_gate.observe(source, len(drafts), self.stats.count_verify(produced, drafts))
        if source == "jump_forward":
            self.jump_forward_tokenizer.observe(drafts, produced)
        if reason is not None:
            req.draft = []
            return self._finish(req, reason, produced)
        self.draft_gate.trim(req, self.running, self.prefilling)
        if not req.draft:
            self.prefilling.remove(req)
            req.status = ReqStatus.RUNNING
            self.running.append(req)
        return TokenDelta(req.rid, produced)

    def _finish(self, req: Req, reason: FinishReason,
                new_ids: list[int] | None = None) -> TokenDelta:
        self._release(req)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        self.reqs.pop(req.rid, None)
        self.stats.finished_requests += 1
        return TokenDelta(req.rid, new_ids or [], reason)

    def _release(self, req: Req) -> None:
        """Leave the running sets and release memory (computed KV goes into the cache)."""
        if req in self.prefilling:
            self.prefilling.remove(req)
        if req in self.running:
            self.running.remove(req)
        self.cache.release(req, cache=True)
        req.computed_len = 0

    def metrics(self) -> dict[str, float]:
        """A monitoring snapshot (see :func:`server.scheduler.metrics.snapshot`)."""
        return snapshot(self.stats, self.cache.usage(),
                        running=len(self.running) + len(self.prefilling), waiting=len(self.waiting),
                        drafts_dropped=self.draft_gate.dropped)

    # ---------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """AssertionError unless the cache manager's memory invariant holds and no waiting
        request holds memory."""
        self.cache.check_invariants((*self.prefilling, *self.running))
        assert not any(self.cache.holds(r.rid) for r in self.waiting), "a waiting request holds memory"
