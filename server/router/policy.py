"""How the router picks a worker: cache-aware (the paper's Appendix A.4), round-robin and
least-load baselines.

Cache-aware: while the load is balanced, a request goes to the worker whose tree matches the
longest prefix of it (when that match covers at least ``cache_threshold`` of the text;
otherwise to the worker with the most free room in its tree, so new prefixes spread out);
once the most loaded worker has more than ``balance_abs`` requests in flight beyond the least
loaded and more than ``balance_rel`` times as many, requests go to the least loaded instead.
The defaults follow SGLang's router (sgl-router ``cache_aware`` policy).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol, Sequence

from server.router.tree import PrefixTree

POLICIES = ("cache_aware", "round_robin", "least_load")


@dataclass
class WorkerState:
    """What a policy reads of one worker: requests in flight through this router and its
    prefix tree."""

    url: str
    tree: PrefixTree
    in_flight: int = 0


class Policy(Protocol):
    """How the router chooses among the available workers for one request."""

    def pick(self, workers: Sequence[WorkerState], text: str) -> WorkerState:
        """One of ``workers`` (non-empty) for a request whose routing text is ``text``."""
        ...


class RoundRobin:
    """Each worker in turn, whatever the request."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, workers: Sequence[WorkerState], text: str) -> WorkerState:
        """The next worker of the rotation."""
        return workers[next(self._counter) % len(workers)]


class LeastLoad:
    """The worker with the fewest requests in flight through this router."""

    def pick(self, workers: Sequence[WorkerState], text: str) -> WorkerState:
        """The least-loaded worker (the first of equals)."""
        return min(workers, key=lambda w: w.in_flight)


@dataclass
class CacheAware:
    """SGLang's cache-aware routing: the worker whose approximate prefix tree matches most of
    the request's text when the match is at least ``cache_threshold`` of it, else the worker
    whose tree is emptiest; while loads are out of balance (differ by more than
    ``balance_abs`` requests and by a factor of ``balance_rel``), the least-loaded worker."""

    cache_threshold: float = 0.5
    balance_abs: int = 32
    balance_rel: float = 1.1

    def pick(self, workers: Sequence[WorkerState], text: str) -> WorkerState:
        """The worker by the rule in the class docstring."""
        loads = [w.in_flight for w in workers]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(loads):
            return min(workers, key=lambda w: w.in_flight)
        best = max(workers, key=lambda w: (w.tree.match(text), -w.in_flight))
        if text and best.tree.match(text) >= self.cache_threshold * len(text):
            return best
        return min(workers, key=lambda w: (w.tree.size / w.tree.capacity, w.in_flight))


def make_policy(name: str) -> Policy:
    """Raises ValueError for an unknown name."""
    if name == "cache_aware":
        return CacheAware()
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
