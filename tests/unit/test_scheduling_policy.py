"""Which waiting request the scheduler admits first, with the fake runner of
tests/unit/scheduler_harness.py: longest prefix match, FCFS, DFS weight, program priority, the
starvation bound, in-batch prefix sharing and mixed chunks. Outputs stay exact under each.
"""

from __future__ import annotations

import pytest

from server.model.forward_batch import ForwardMode
from tests.unit.scheduler_harness import (
    assert_all_free,
    expected_output,
    finish_one,
    finish_order,
    make,
    req,
    run,
)


def test_lpm_admits_longest_cached_prefix_first():
    sched, runner = make(schedule_policy="lpm", max_running_requests=1)
    finish_one(sched, runner, req("warm", list(range(1, 31)), 1))
    short = req("short", list(range(1, 6)) + [80, 81], 1)
    none = req("none", [70, 71, 72], 1)
    long = req("long", list(range(1, 26)) + [82], 1)
    for r in (none, short, long):  # arrival order: none, short, long
        sched.add_request(r)
    order = finish_order(sched, runner)
    assert order == ["long", "short", "none"]



def test_fcfs_ignores_the_cache():
    sched, runner = make(schedule_policy="fcfs", max_running_requests=1)
    finish_one(sched, runner, req("warm", list(range(1, 31)), 1))
    reqs = [req("none", [70, 71], 1), req("long", list(range(1, 26)), 1)]
    for r in reqs:
        sched.add_request(r)
    order = finish_order(sched, runner)
    assert order == ["none", "long"]



def test_starvation_bound():
    """A request with no cache hit is passed by later cache-hitting arrivals at most
    starvation_limit_steps times, then admitted first."""
    sched, runner = make(schedule_policy="lpm", max_running_requests=1,
                         starvation_limit_steps=3)
    finish_one(sched, runner, req("warm", list(range(1, 31)), 1))
    loner = req("loner", [90, 91, 92], 1)
    sched.add_request(loner)
    order = []
    for i in range(8):  # keep feeding cache-hitting requests that arrive after the loner
        sched.add_request(req(f"hit{i}", list(range(1, 20)) + [60 + i], 1))
        b = sched.step()
        order += [d.rid for d in sched.update(b, runner.forward(b)) if d.finish_reason]
    run(sched, runner)
    assert loner.finish_reason is not None
    assert order.index("loner") == 3  # passed exactly 3 times



@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_higher_priority_first_within_the_starvation_bound(policy):
    """A program's later calls (higher priority) are admitted before new programs' first calls
    that arrived earlier; the policy orders each priority; a low-priority request is passed
    at most starvation_limit_steps times; with priority off, arrival (the policy) decides."""
    sched, runner = make(schedule_policy=policy, max_running_requests=1)
    first = [req(f"new{i}", [10 + i, 11, 12], 1) for i in range(3)]
    later = [req(f"next{i}", [40 + i, 41, 42], 1) for i in range(2)]
    for r in later:
        r.priority = 1
    for r in first + later:
        sched.add_request(r)
    assert finish_order(sched, runner) == ["next0", "next1", "new0", "new1", "new2"]

    sched, runner = make(schedule_policy=policy, max_running_requests=1, priority=False)
    for r in [req("a", [1, 2], 1), req("b", [3, 4], 1)]:
        r.priority = 5 if r.rid == "b" else 0
        sched.add_request(r)
    assert finish_order(sched, runner) == ["a", "b"]

    sched, runner = make(schedule_policy=policy, max_running_requests=1,
                         starvation_limit_steps=3)
    low = req("low", [90, 91], 1)
    sched.add_request(low)
    order = []
    for i in range(6):  # a steady stream of higher-priority calls arriving after it
        r = req(f"hi{i}", [60 + i, 61], 1)
        r.priority = 1
        sched.add_request(r)
        b = sched.step()
        order += [d.rid for d in sched.update(b, runner.forward(b)) if d.finish_reason]
    order += finish_order(sched, runner)
    assert order.index("low") == 3  # passed exactly 3 times, then admitted



def test_dfs_weight_groups_requests_by_subtree():
    sched, runner = make(schedule_policy="dfs_weight", max_running_requests=1)
    finish_one(sched, runner, req("warm-a", [1, 2, 3, 4, 5], 1))
    finish_one(sched, runner, req("warm-b", [9, 8, 7, 6, 5], 1))
    arrivals = [req("a1", [1, 2, 3, 4, 5, 10], 1), req("b1", [9, 8, 7, 6, 5, 11], 1),
                req("a2", [1, 2, 3, 4, 5, 12], 1), req("a3", [1, 2, 3, 4, 5, 13], 1)]
    for r in arrivals:
        sched.add_request(r)
    order = finish_order(sched, runner)
    assert order == ["a1", "a2", "a3", "b1"]  # the heavier subtree first



@pytest.mark.parametrize("policy, second_hit", [("lpm", 40), ("fcfs", 0)])
def test_in_batch_prefix_sharing_defers_the_duplicate(policy, second_hit):
    """Two requests sharing a 40-token uncached prefix arrive together: with a cache-aware
    policy the second waits one step and reuses the first's KV instead of recomputing it."""
    sched, runner = make(schedule_policy=policy, chunked_prefill_size=256)
    shared = list(range(1, 41))
    a, b = req("a", shared + [50, 51], 2), req("b", shared + [60, 61], 2)
    sched.add_request(a)
    sched.add_request(b)
    run(sched, runner)
    assert (a.cached_tokens, b.cached_tokens) == (0, second_hit)
    assert a.output_ids == expected_output(a.input_ids, 2)
    assert b.output_ids == expected_output(b.input_ids, 2)



@pytest.mark.parametrize("mixed", [True, False])
def test_arriving_prompts_do_not_stall_decoding_with_mixed_chunks(mixed):
    """A new prompt every step: with mixed chunks the running request decodes in every
    extend batch (a 1-token row) and finishes in max_new steps; prefill-first holds it back
    until the arrivals stop. Outputs are exact either way."""
    sched, runner = make(capacity=1024, rows=16, mixed_chunk=mixed, chunked_prefill_size=16)
    r = req("r", [5, 6, 7], 6)
    sched.add_request(r)
    finished_at = None
    for step in range(40):
        if step < 12:
            sched.add_request(req(f"new{step}", [20 + step] * 10, 1))
        b = sched.step()
        if b is None:
            break
        if mixed and step > 0 and not r.finished and b.mode is ForwardMode.EXTEND:
            i = b.req_ids.index("r")
            assert b.extend_lens[i] == 1
        if any(d.rid == "r" and d.finish_reason for d in sched.update(b, runner.forward(b))):
            finished_at = step
        sched.check_invariants()
    run(sched, runner)
    assert r.output_ids == expected_output([5, 6, 7], 6)
    if mixed:
        assert finished_at == 5  # the prefill samples the 1st token, each next step one more
    else:
        assert finished_at >= 12  # decoded only once the stream of prompts ended
    assert_all_free(sched)
