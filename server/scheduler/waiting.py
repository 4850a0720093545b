"""Which waiting requests an extend step tries to admit, and in what order.

* :class:`WaitingOrder`: the policy's order (:mod:`server.scheduler.policy`) within each
  request priority, higher first (``SchedulerConfig.priority``: a program's later calls carry
  a higher one than new programs' first calls), behind the starvation bound: a request passed
  over by later arrivals in ``starvation_limit_steps`` steps goes first, oldest first
  (:meth:`WaitingOrder.passed_over` counts those steps).
* :class:`StepSharing`: SGLang's in-batch prefix caching check. A request whose *uncached* part
  shares at least ``IN_BATCH_SHARE_THRESHOLD`` tokens with what this step already prefills is
  deferred one step, so it reuses that KV from the cache instead of computing it a second time.
  Cache-aware policies only.

Both read the cache through :class:`server.cache.manager.CacheManager` (``match``,
``scratch_tree``) and never change it.
"""

from __future__ import annotations

import random
from typing import Iterable, Sequence

import torch

from server.cache.manager import CacheManager
from server.config import SchedulerConfig
from server.scheduler import policy
from server.scheduler.request import Req

IN_BATCH_SHARE_THRESHOLD = 32  # tokens
CACHE_AWARE = ("lpm", "dfs_weight")
_NO_SLOTS = torch.empty(0, dtype=torch.int64)


class WaitingOrder:
    """Args: config (policy, starvation bound, queue cap), cache, rng (for "random")."""

    def __init__(self, config: SchedulerConfig, cache: CacheManager, rng: random.Random):
        self.config, self.cache, self.rng = config, cache, rng

    def order(self, waiting: Iterable[Req]) -> list[Req]:
        """Starving requests (by arrival), then the rest by priority, in the policy's order
        within one."""
        limit = self.config.starvation_limit_steps
        waiting = list(waiting)
        starving = sorted((r for r in waiting if r.passed_steps >= limit),
                          key=lambda r: r.arrival_time)
        rest = policy.order(
            self.config.schedule_policy, [r for r in waiting if r.passed_steps < limit],
            rng=self.rng, prefix_info=self.cache.match,
            max_cache_aware_queue=self.config.max_cache_aware_queue)
        if self.config.priority:
            rest.sort(key=lambda r: -r.priority)  # stable: the policy's order within one
        return starving + rest

    @staticmethod
    def passed_over(waiting: Iterable[Req], admitted: Sequence[Req]) -> None:
        """Count a step against every waiting request that arrived before one admitted now."""
        if admitted:
            last = max(r.arrival_time for r in admitted)
            for r in waiting:
                if r.arrival_time < last:
                    r.passed_steps += 1


class StepSharing:
    """What one extend step prefills, as a scratch radix tree (see the module docstring).

    Args: config, cache, reqs: requests already in the step (chunks of earlier prompts)."""

    def __init__(self, config: SchedulerConfig, cache: CacheManager, reqs: Iterable[Req]):
        self.cache = cache
        self.tree = (None if cache.disabled or config.schedule_policy not in CACHE_AWARE
                     else cache.scratch_tree())
        for req in reqs:
            self.add(req)

    def add(self, req: Req) -> None:
        """Record that ``req``'s tokens are computed in this step."""
        if self.tree is not None:
            self.tree.insert(req.key_ids, _NO_SLOTS.new_zeros(req.fill_len), req.namespace)

    def defer(self, req: Req) -> bool:
        """True if ``req`` should wait a step to reuse KV this step computes."""
        if self.tree is None:
            return False
        key = req.key_ids[:CacheManager.max_prefix(req)]
        cached = self.cache.match(req)[0]
        shared = self.tree.prefix_len(key, req.namespace)[0]
        return shared - cached >= IN_BATCH_SHARE_THRESHOLD
