"""A fake runner and helpers for the scheduler tests (test_scheduler.py, test_scheduling_policy.py).

FakeRunner stores each new token id in its KV slot and answers, for every requested position, a
one-hot logit on ``next_token(context)``, where the context is read back from the slots through
``req_to_token``. A slot written to the wrong place, freed too early or shared by two requests
changes the output, so comparing against :func:`expected_output` checks the KV bookkeeping.
"""

from __future__ import annotations

import torch

from server.cache.kv_pool import TokenKVPool
from server.cache.manager import CacheManager
from server.cache.radix_tree import RadixCache
from server.cache.req_table import ReqToTokenTable
from server.config import SchedulerConfig
from server.model.forward_batch import ForwardBatch, RunnerOutput
from server.model.sampling import SamplingParams
from server.scheduler.request import Req
from server.scheduler.scheduler import Scheduler
from tests.helpers import assert_no_request_memory

VOCAB = 97
EOS = 0


def next_token(context: list[int]) -> int:
    """Deterministic, order-sensitive function of the whole context; never EOS."""
    return 1 + sum((k + 1) * t for k, t in enumerate(context)) % (VOCAB - 1)


def expected_output(prompt: list[int], max_new: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_new):
        seq.append(next_token(seq))
    return seq[len(prompt):]


class FakeRunner:
    def __init__(self, capacity: int):
        self.kv = torch.zeros(capacity + 1, dtype=torch.int64)
        self.batches: list[ForwardBatch] = []

    def forward(self, b: ForwardBatch) -> RunnerOutput:
        self.batches.append(b)
        assert b.out_cache_loc.numel() == b.input_ids.numel()
        assert len(set(b.out_cache_loc.tolist())) == b.out_cache_loc.numel()
        self.kv[b.out_cache_loc] = b.input_ids
        seq_of = []
        for i, n in enumerate(b.extend_lens):
            seq_of += [i] * n
        logits = torch.full((b.logits_indices.numel(), VOCAB), -10.0)
        for r, idx in enumerate(b.logits_indices.tolist()):
            i = seq_of[idx]
            pos = int(b.positions[idx])
            context = self.kv[b.req_to_token[b.req_rows[i], :pos + 1]].tolist()
            logits[r, next_token(context)] = 10.0
        return RunnerOutput(logits)


def make(capacity=256, rows=8, context=256, disable_cache=False, **cfg):
    cache = CacheManager(TokenKVPool(capacity), ReqToTokenTable(rows, context),
                         RadixCache(disabled=disable_cache))
    sched = Scheduler(SchedulerConfig(**{"schedule_policy": "fcfs", **cfg}), cache,
                      vocab_size=VOCAB, context_len=context)
    return sched, FakeRunner(capacity)


def req(rid, prompt, max_new, **kw):
    params = SamplingParams(max_new_tokens=max_new, temperature=0, **kw)
    return Req(rid=rid, input_ids=list(prompt), params=params,
               eos_ids=frozenset({EOS}))


def run(sched, runner, max_steps=10_000, on_step=None):
    done = {}
    for step in range(max_steps):
        if not sched.has_work:
            return done
        batch = sched.step()
        assert batch is not None, "work queued but nothing schedulable"
        for d in sched.update(batch, runner.forward(batch)):
            if d.finish_reason is not None:
                done[d.rid] = d.finish_reason
        sched.check_invariants()
        if on_step:
            on_step(step)
    raise AssertionError("did not finish")


def finish_order(sched, runner) -> list[str]:
    """Run to idle; request ids in the order they finished."""
    order = []
    while sched.has_work:
        b = sched.step()
        order += [d.rid for d in sched.update(b, runner.forward(b)) if d.finish_reason]
        sched.check_invariants()
    return order


def assert_all_free(sched):
    assert_no_request_memory(sched.cache)
    assert not (sched.waiting or sched.prefilling or sched.running or sched.reqs)


def finish_one(sched, runner, r):
    """Add r and run to idle."""
    sched.add_request(r)
    run(sched, runner)
