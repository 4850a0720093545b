"""Radix cache on vs off on a tiny fp32 model, its weights quantized as the default model's are
(``EXACT_ENGINE``): identical greedy outputs (RELIABILITY rule 5).

The reference is an engine with ``disable_radix_cache=True``; the engine under test warms its
cache with part of the workload first, so the measured batch mixes hits and misses.
"""

from __future__ import annotations

import os
import random

import pytest

from server.engine import Engine
from tests.helpers import EXACT_ENGINE, assert_no_request_memory

SP = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
EXACT = {"dtype": "float32", **EXACT_ENGINE, "context_length": 512}


def _tokens(rng, n):
    return [rng.randrange(3, 49152) for _ in range(n)]


def workload(seed=0):
    """Prompts sharing a system prefix, sharing a run in the middle, unrelated, and repeated."""
    rng = random.Random(seed)
    system, middle = _tokens(rng, 60), _tokens(rng, 30)
    start = [system + _tokens(rng, rng.randrange(1, 20)) for _ in range(6)]
    mid = [_tokens(rng, rng.randrange(1, 10)) + middle + _tokens(rng, 5) for _ in range(4)]
    unrelated = [_tokens(rng, rng.randrange(5, 40)) for _ in range(4)]
    repeated = [start[0], start[0], unrelated[0]]
    return start + mid + unrelated + repeated


@pytest.fixture(scope="module")
def tiny_path(make_tiny_model):
    return make_tiny_model("llama")[0]


@pytest.fixture(scope="module")
def reference(tiny_path):
    eng = Engine(tiny_path, **EXACT, max_total_tokens=8192,
                 disable_radix_cache=True)
    prompts = workload()
    outs = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=SP)]
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in eng.generate(
        input_ids=prompts[:3], sampling_params=SP))
    return prompts, outs


def run_cached(path, prompts, **kwargs):
    eng = Engine(path, **EXACT,
                 **{"max_total_tokens": 8192, **kwargs})
    warm = prompts[::3]
    eng.generate(input_ids=warm, sampling_params=SP)
    outs = eng.generate(input_ids=prompts, sampling_params=SP)
    eng.scheduler.check_invariants()
    assert_no_request_memory(eng.cache)
    return eng, outs


@pytest.mark.parametrize("kwargs", [
    {}, {"chunked_prefill_size": 7}, {"chunked_prefill_size": 13},
    {"chunked_prefill_size": 1024}, {"schedule_policy": "dfs_weight"},
    {"schedule_policy": "fcfs", "max_running_requests": 4},
    {"chunked_prefill_size": 7, "mixed_chunk": False},
])
def test_cache_on_equals_off(tiny_path, reference, kwargs):
    prompts, want = reference
    eng, outs = run_cached(tiny_path, prompts, **kwargs)
    assert [o["output_ids"] for o in outs] == want
    hits = [o["meta_info"]["cached_tokens"] for o in outs]
    assert sum(hits) > 0 and min(hits) == 0  # a mix of hits and misses
    assert eng.scheduler.stats.cache_hit_rate > 0


def test_tiny_pool_evicts_and_retracts_without_changing_outputs(tiny_path, reference):
    prompts, want = reference
    eng, outs = run_cached(tiny_path, prompts, max_total_tokens=220, max_new_tokens_reserve=1)
    assert [o["output_ids"] for o in outs] == want
    assert eng.cache.stats.evicted_tokens > 0
    assert eng.scheduler.stats.retractions > 0


def test_fully_repeated_prompt_hits_all_but_one_token(tiny_path, reference):
    prompts, want = reference
    eng = Engine(tiny_path, **EXACT, max_total_tokens=8192)
    first = eng.generate(input_ids=prompts[0], sampling_params=SP)
    again = eng.generate(input_ids=prompts[0], sampling_params=SP)
    assert first["output_ids"] == again["output_ids"] == want[0]
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == len(prompts[0]) - 1


def test_multi_turn_reuses_previous_answer(tiny_path):
    """Turn 2 = turn 1 prompt + its answer + new tokens: the cache covers the answer too."""
    rng = random.Random(5)
    turn1 = _tokens(rng, 40)
    on = Engine(tiny_path, **EXACT, max_total_tokens=8192)
    off = Engine(tiny_path, **EXACT, max_total_tokens=8192,
                 disable_radix_cache=True)
    a1 = on.generate(input_ids=turn1, sampling_params=SP)["output_ids"]
    turn2 = turn1 + a1 + _tokens(rng, 10)
    got = on.generate(input_ids=turn2, sampling_params=SP)
    assert got["meta_info"]["cached_tokens"] == len(turn1) + len(a1) - 1
    assert got["output_ids"] == off.generate(input_ids=turn2, sampling_params=SP)["output_ids"]


def test_sliding_window_model_cache_on_equals_off(make_tiny_model):
    """Gemma 3 with 16-token window layers: prompts share a 60-token prefix (longer than the
    window), so window layers of a cache hit read only cached K/V past the window start; the
    cache may not evict the shared prefix from under a running request either (small pool)."""
    path = make_tiny_model("gemma3")[0]
    prompts = workload(seed=3)
    ref = Engine(path, **EXACT, max_total_tokens=8192,
                 disable_radix_cache=True)
    want = [o["output_ids"] for o in ref.generate(input_ids=prompts, sampling_params=SP)]
    for kwargs in ({}, {"chunked_prefill_size": 13},
                   {"max_total_tokens": 220, "max_new_tokens_reserve": 1}):
        eng, outs = run_cached(path, prompts, **kwargs)
        assert [o["output_ids"] for o in outs] == want, kwargs
        assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0


def test_host_tier_loads_evicted_prefixes_back_without_changing_outputs(tiny_path, reference):
    """A pool too small for the workload with a host tier under it: evicted pages come back
    as cache hits (tier_loaded_tokens > 0) and greedy outputs equal the cache-off reference."""
    prompts, want = reference
    long_prompts = [p * 3 for p in prompts[:6]]  # >= 2 pages each, sharing the system prefix
    ref = Engine(tiny_path, **EXACT, max_total_tokens=8192,
                 disable_radix_cache=True)
    want = [o["output_ids"] for o in ref.generate(input_ids=long_prompts, sampling_params=SP)]
    eng = Engine(tiny_path, **EXACT, max_total_tokens=600,
                 max_new_tokens_reserve=1, hicache_size=0.01)
    for _ in range(2):
        outs = [eng.generate(input_ids=p, sampling_params=SP) for p in long_prompts]
        assert [o["output_ids"] for o in outs] == want
    assert eng.metrics()["tier_loaded_tokens"] > 0
    assert eng.cache.stats.evicted_tokens > 0
    eng.scheduler.check_invariants()
    assert_no_request_memory(eng.cache)


def test_cache_dir_survives_a_restart(tiny_path, reference, tmp_path):
    """Engine A persists its cache; a new engine on the same model and dtype starts with those
    prefixes (cached tokens, identical outputs); one in another dtype ignores them."""
    prompts, want = reference
    p = prompts[0] * 3
    a = Engine(tiny_path, **EXACT, max_total_tokens=8192,
               cache_dir=str(tmp_path))
    first = a.generate(input_ids=p, sampling_params=SP)
    assert first["meta_info"]["cached_tokens"] == 0
    a.cache.persist()
    b = Engine(tiny_path, **EXACT, max_total_tokens=8192,
               cache_dir=str(tmp_path))
    again = b.generate(input_ids=p, sampling_params=SP)
    assert again["output_ids"] == first["output_ids"]
    pages = (len(p) - 1) // 64
    assert again["meta_info"]["cached_tokens"] == pages * 64 > 0
    c = Engine(tiny_path, **{**EXACT, "dtype": "bfloat16"}, max_total_tokens=8192,
               cache_dir=str(tmp_path))
    assert c.generate(input_ids=p, sampling_params=SP)["meta_info"]["cached_tokens"] == 0
    dirs = [d for d in os.listdir(tmp_path) if (tmp_path / d).is_dir()]
    assert len(dirs) == 2  # one directory per model/format (beside the shared .key)
