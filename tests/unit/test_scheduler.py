"""The scheduler's whole request lifecycle with a fake runner and no model
(tests/unit/scheduler_harness.py): KV bookkeeping under chunks, aborts, retraction and memory
pressure, finishing rules, validation and prefix reuse. Admission order: test_scheduling_policy.py.
"""

from __future__ import annotations

import random

import pytest

from server.model.forward_batch import ForwardMode
from server.scheduler.request import LogprobOptions, ReqStatus
from server.scheduler.validation import InvalidRequestError
from tests.unit.scheduler_harness import (
    VOCAB,
    assert_all_free,
    expected_output,
    finish_one,
    finish_order,
    make,
    req,
    run,
)


def test_single_request_lifecycle():
    sched, runner = make()
    r = req("a", [5, 6, 7], 4)
    sched.add_request(r)
    assert r.status is ReqStatus.WAITING
    run(sched, runner)
    assert r.output_ids == expected_output([5, 6, 7], 4)
    assert r.finish_reason.type == "length" and r.status is ReqStatus.FINISHED
    modes = [b.mode for b in runner.batches]
    assert modes == [ForwardMode.EXTEND] + [ForwardMode.DECODE] * 3
    assert_all_free(sched)


@pytest.mark.parametrize("policy", ["lpm", "dfs_weight", "fcfs", "random", "no-cache"])
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_with_chunks_aborts_flushes_and_pressure(seed, policy):
    """Random prefix trees of requests, random chunk size, a pool ~2.5x the longest request,
    random aborts and flush attempts: invariants every step, exact outputs, all free at the end."""
    rng = random.Random(seed)
    longest = 0
    reqs = []
    trunks = [[rng.randrange(1, VOCAB) for _ in range(40)] for _ in range(3)]
    for i in range(30):
        trunk = rng.choice(trunks)
        branch = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))]
        prompt = trunk[:rng.randrange(0, 40)] + branch
        if rng.random() < 0.2:
            prompt = prompt + trunk[:10]  # a shared run in the middle too
        max_new = rng.randrange(0, 25)
        longest = max(longest, len(prompt) + max_new)
        reqs.append(req(f"r{i}", prompt, max_new))
    sched, runner = make(capacity=int(longest * 2.5), rows=6,
                         chunked_prefill_size=rng.choice([1, 3, 7, 16, 64]),
                         max_new_tokens_reserve=rng.choice([1, 4, 32]),
                         schedule_policy="fcfs" if policy == "no-cache" else policy,
                         disable_cache=policy == "no-cache")
    for r in reqs[:20]:
        sched.add_request(r)
    aborted = set()
    flushed = 0

    def chaos(step):
        nonlocal flushed
        if step == 5:
            for r in reqs[20:]:
                sched.add_request(r)
        if rng.random() < 0.08:
            live = [r for r in reqs if r.rid in sched.reqs]
            if live:
                victim = rng.choice(live)
                assert sched.abort(victim.rid) is not None
                aborted.add(victim.rid)
        if rng.random() < 0.1:
            idle = not (sched.prefilling or sched.running)
            assert sched.flush_cache() == idle
            if idle:
                flushed += 1
                assert sched.cache.tree.total_size == 0
                assert sched.cache.pool.num_free == sched.cache.pool.capacity

    done = run(sched, runner, on_step=chaos)
    for r in reqs:
        if r.rid in aborted:
            assert r.finish_reason.type == "abort" and r.rid not in done
        else:
            assert r.output_ids == expected_output(r.input_ids, r.params.max_new_tokens), r.rid
    assert_all_free(sched)
    if policy == "no-cache":
        assert sched.stats.cached_prompt_tokens == 0 and sched.cache.tree.total_size == 0
    else:
        assert sched.stats.cached_prompt_tokens > 0


def test_retraction_under_memory_pressure_keeps_outputs_exact():
    sched, runner = make(capacity=60, rows=8, max_new_tokens_reserve=1)
    reqs = [req(f"r{i}", [i + 1] * 10, 30) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    run(sched, runner)
    assert sched.stats.retractions > 0
    for r in reqs:
        assert r.output_ids == expected_output(r.input_ids, 30)
    assert_all_free(sched)


def test_fcfs_order_with_one_running_slot():
    sched, runner = make(max_running_requests=1)
    for i in range(4):
        sched.add_request(req(f"r{i}", [i + 1, 2], 3))
    order = finish_order(sched, runner)
    assert order == ["r0", "r1", "r2", "r3"]


def test_chunked_prefill_splits_long_prompt():
    sched, runner = make(chunked_prefill_size=8)
    r = req("a", list(range(1, 21)), 2)
    sched.add_request(r)
    run(sched, runner)
    assert [b.extend_lens for b in runner.batches[:3]] == [[8], [8], [4]]
    assert [b.logits_indices.numel() for b in runner.batches[:3]] == [0, 0, 1]
    assert r.output_ids == expected_output(r.input_ids, 2)


def test_prefill_only_request_finishes_without_output():
    sched, runner = make()
    r = req("a", [3, 4, 5], 0)
    r.logprobs = LogprobOptions(return_logprob=True, logprob_start_len=0)
    sched.add_request(r)
    run(sched, runner)
    assert r.output_ids == [] and r.finish_reason.type == "length"
    assert [t for _, t in r.input_token_logprobs] == [3, 4, 5]
    assert r.input_token_logprobs[0][0] is None
    assert_all_free(sched)
    # a prefill-only request is a cache hint: its whole prompt is now cached
    assert sched.cache.tree.prefix_len([3, 4, 5])[0] == 3


def test_eos_and_stop_token_ids_finish_with_matched_token():
    sched, runner = make()
    first = expected_output([9], 1)[0]
    r = req("a", [9], 10, stop_token_ids=(first,))
    sched.add_request(r)
    run(sched, runner)
    assert r.output_ids == [first] and r.finish_reason.matched == first


def test_min_new_tokens_bans_stop_ids_until_reached():
    sched, runner = make()
    first = expected_output([9], 1)[0]
    r = req("a", [9], 5, stop_token_ids=(first,), min_new_tokens=1)
    sched.add_request(r)
    run(sched, runner)
    assert r.output_ids[0] != first and len(r.output_ids) >= 1


def test_abort_in_every_state():
    sched, runner = make(chunked_prefill_size=4)
    waiting, prefilling, running = req("w", [1] * 3, 5), req("p", [2] * 12, 5), req("r", [3], 50)
    sched.add_request(running)
    b = sched.step()
    sched.update(b, runner.forward(b))
    sched.add_request(prefilling)
    b = sched.step()
    sched.update(b, runner.forward(b))
    sched.add_request(waiting)
    assert (running.status, prefilling.status, waiting.status) == (
        ReqStatus.RUNNING, ReqStatus.PREFILLING, ReqStatus.WAITING)
    for r in (waiting, prefilling, running):
        assert sched.abort(r.rid).finish_reason.type == "abort"
        sched.check_invariants()
        assert sched.abort(r.rid) is None  # twice: a no-op
    assert sched.abort("unknown") is None
    assert_all_free(sched)
    assert sched.stats.aborts == 3


@pytest.mark.parametrize("prompt, max_new, param", [
    ([], 1, "input_ids"), ([VOCAB], 1, "input_ids"), ([-1], 1, "input_ids"),
    ([1] * 250, 10, "max_new_tokens"), ([1] * 100, 100, "input_ids"),
])
def test_requests_that_can_never_run_are_refused_before_queueing(prompt, max_new, param):
    sched, _ = make(capacity=150, context=256)
    with pytest.raises(InvalidRequestError) as err:
        sched.add_request(req("a", prompt, max_new))
    assert err.value.param == param and not sched.has_work


def test_duplicate_request_id_refused():
    sched, _ = make()
    sched.add_request(req("a", [1], 1))
    with pytest.raises(InvalidRequestError, match="duplicate"):
        sched.add_request(req("a", [2], 1))


def test_finished_request_is_reused_exactly():
    sched, runner = make()
    a = req("a", list(range(1, 21)), 5)
    finish_one(sched, runner, a)
    # the tree holds prompt + output except the last sampled token (its KV was never computed)
    assert sched.cache.tree.total_size == 20 + 5 - 1
    b = req("b", list(range(1, 16)) + [90, 91], 3)
    finish_one(sched, runner, b)
    assert b.cached_tokens == 15
    assert runner.batches[-3].prefix_lens == [15] and runner.batches[-3].extend_lens == [2]
    assert b.output_ids == expected_output(b.input_ids, 3)
    assert sched.stats.cached_prompt_tokens == 15 and sched.stats.prompt_tokens == 37
    assert sched.stats.cache_hit_rate == pytest.approx(15 / 37)


def test_fully_repeated_prompt_still_computes_one_token():
    sched, runner = make()
    finish_one(sched, runner, req("a", [5, 6, 7, 8], 2))
    again = req("b", [5, 6, 7, 8], 2)
    finish_one(sched, runner, again)
    assert again.cached_tokens == 3
    assert runner.batches[-2].extend_lens == [1] and runner.batches[-2].prefix_lens == [3]
    assert again.output_ids == expected_output([5, 6, 7, 8], 2)


def test_prompt_logprobs_cap_the_reused_prefix():
    sched, runner = make()
    finish_one(sched, runner, req("a", list(range(1, 11)), 1))
    b = req("b", list(range(1, 11)), 1)
    b.logprobs = LogprobOptions(return_logprob=True, logprob_start_len=4)
    finish_one(sched, runner, b)
    assert b.cached_tokens == 3  # positions 3.. are recomputed for the logprobs of tokens 4..
    assert [tok for _, tok in b.input_token_logprobs] == list(range(5, 11))


def test_retraction_keeps_computed_work_in_the_cache():
    sched, runner = make(capacity=60, rows=8, max_new_tokens_reserve=1)
    reqs = [req(f"r{i}", [i + 1] * 10, 30) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    readmitted_with_cache = []
    orig_admit = sched.cache.admit

    def spy(r):
        hit = orig_admit(r)
        if r.num_admissions > 0:
            readmitted_with_cache.append(hit.cached_len)
        return hit

    sched.cache.admit = spy
    run(sched, runner)
    assert sched.stats.retractions > 0 and sched.cache.stats.evicted_tokens > 0
    assert any(n > 0 for n in readmitted_with_cache)
    for r in reqs:
        assert r.output_ids == expected_output(r.input_ids, 30)


def test_namespaces_isolate_the_cache():
    sched, runner = make()
    a = req("a", list(range(1, 21)), 2)
    a.namespace = "salt-1"
    finish_one(sched, runner, a)
    b = req("b", list(range(1, 21)), 2)
    b.namespace = "salt-2"
    finish_one(sched, runner, b)
    c = req("c", list(range(1, 21)), 2)
    c.namespace = "salt-1"
    finish_one(sched, runner, c)
    assert (b.cached_tokens, c.cached_tokens) == (0, 19)
    assert b.output_ids == c.output_ids == expected_output(list(range(1, 21)), 2)


def test_flush_refused_while_running():
    sched, runner = make()
    sched.add_request(req("a", [1, 2, 3], 5))
    b = sched.step()
    sched.update(b, runner.forward(b))
    held = sched.cache.pool.capacity - sched.cache.pool.num_free
    assert not sched.flush_cache() and held > 0
    assert sched.cache.pool.capacity - sched.cache.pool.num_free == held  # nothing was freed
    sched.check_invariants()
    run(sched, runner)
    assert sched.flush_cache() and sched.cache.tree.total_size == 0


def test_metrics_snapshot_tracks_the_lifecycle():
    sched, runner = make(capacity=200, schedule_policy="lpm")
    sched.add_request(req("a", list(range(1, 41)), 4))
    sched.add_request(req("b", list(range(1, 41)) + [77], 4))
    m = sched.metrics()
    assert (m["waiting_requests"], m["running_requests"], m["kv_usage"]) == (2, 0, 0.0)
    b = sched.step()
    sched.update(b, runner.forward(b))
    m = sched.metrics()
    assert m["running_requests"] >= 1 and m["kv_usage"] > 0
    run(sched, runner)
    m = sched.metrics()
    assert m["running_requests"] == m["waiting_requests"] == 0 and m["kv_usage"] == 0.0
    assert m["prompt_tokens"] == 81 and m["cached_prompt_tokens"] == 40
    assert m["cache_hit_rate"] == pytest.approx(40 / 81)
    assert m["generated_tokens"] == 8 and m["finished_requests"] == 2
    assert m["kv_cached_tokens"] + m["kv_free_tokens"] == m["kv_capacity_tokens"]
