"""Pure ordering functions for the waiting queue: given requests and what the cache knows about
them, return the order in which the scheduler should try to admit them. Nothing here mutates the
queue or the cache; the scheduler does the mechanics (including the starvation bound).

* ``lpm``: longest cached prefix first (SGLang paper Algorithm 1: sorting by matched prefix
  length approximates a DFS of the radix tree, which Theorem 3.1 shows maximizes the hit rate
  for a batch held in the cache). Ties by arrival.
* ``dfs_weight``: an explicit DFS of the radix tree, visiting heavier subtrees (more waiting
  requests under them) first, so requests sharing a prefix run together.
* ``fcfs``: by arrival. ``random``: a seeded shuffle (a baseline for benchmarks).

Matching every waiting request against the tree costs time per step, so the cache-aware policies
fall back to FCFS when the queue is longer than ``max_cache_aware_queue`` (as SGLang does).
"""

from __future__ import annotations

import random as _random
from typing import Any, Callable, Sequence

from server.scheduler.request import Req

# req -> (cached prefix length in tokens, deepest fully-matched tree node or None)
PrefixInfo = Callable[[Req], tuple[int, Any]]


def fcfs(waiting: Sequence[Req]) -> list[Req]:
    """First come, first served: by arrival time, ties by queue order."""
    return sorted(waiting, key=lambda r: r.arrival_time)


def lpm(waiting: Sequence[Req], prefix_info: PrefixInfo) -> list[Req]:
    """Longest prefix match first; ties by arrival."""
    lens = {id(r): prefix_info(r)[0] for r in waiting}
    return sorted(waiting, key=lambda r: (-lens[id(r)], r.arrival_time))


def dfs_weight(waiting: Sequence[Req], prefix_info: PrefixInfo) -> list[Req]:
    """DFS over the radix tree, heavier subtrees first; unmatched requests last (by arrival).

    Nodes need ``parent`` and ``children`` (dict) attributes, as radix-tree nodes have.
    """
    at_node: dict[int, list[Req]] = {}
    nodes: dict[int, Any] = {}
    unmatched = []
    for r in sorted(waiting, key=lambda r: r.arrival_time):
        node = prefix_info(r)[1]
        if node is None:
            unmatched.append(r)
            continue
        at_node.setdefault(id(node), []).append(r)
        nodes[id(node)] = node
    weight: dict[int, int] = {}
    roots: dict[int, Any] = {}
    for key, reqs in at_node.items():
        node = nodes[key]
        while node is not None:
            weight[id(node)] = weight.get(id(node), 0) + len(reqs)
            if node.parent is None:
                roots[id(node)] = node
            node = node.parent
    order: list[Req] = []

    def visit(node: Any) -> None:
        order.extend(at_node.get(id(node), []))
        children = [c for c in node.children.values() if id(c) in weight]
        for child in sorted(children, key=lambda c: -weight[id(c)]):
            visit(child)

    for root in sorted(roots.values(), key=lambda n: -weight[id(n)]):
        visit(root)
    return order + unmatched


def random_order(waiting: Sequence[Req], rng: _random.Random) -> list[Req]:
    """The waiting requests shuffled by ``rng`` (a baseline for the cache-aware orders)."""
    out = list(waiting)
    rng.shuffle(out)
    return out


POLICIES = ("lpm", "dfs_weight", "fcfs", "random")


def order(policy: str, waiting: Sequence[Req], *, prefix_info: PrefixInfo,
          rng: _random.Random, max_cache_aware_queue: int = 128) -> list[Req]:
    """Apply the named policy (see module docstring). Raises KeyError for an unknown name."""
    if policy in ("lpm", "dfs_weight") and len(waiting) > max_cache_aware_queue:
        return fcfs(waiting)
    if policy == "lpm":
        return lpm(waiting, prefix_info)
    if policy == "dfs_weight":
        return dfs_weight(waiting, prefix_info)
    if policy == "fcfs":
        return fcfs(waiting)
    if policy == "random":
        return random_order(waiting, rng)
    raise KeyError(policy)
