"""Helpers shared by the benchmarks: where the shared data lives, and table printing."""

from __future__ import annotations

import os
from typing import Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shared_data_dir() -> str | None:
    """``../shared/data`` next to the repository (DESIGN.md §6), or None when absent."""
    path = os.path.join(os.path.dirname(REPO_ROOT), "shared", "data")
    return path if os.path.isdir(path) else None


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print a markdown table (pasteable into README.md)."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "| " + " | ".join(f"{{:<{w}}}" for w in widths) + " |"
    print(fmt.format(*header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(fmt.format(*row))


def run_in_flight(engine, prompts, params, in_flight: int):
    """Run ``prompts`` (token-id lists) through an in-process Engine the way concurrent clients
    would: at most ``in_flight`` requests outstanding, a new one submitted as one finishes.

    Returns (finished Req objects in prompt order, elapsed seconds).
    """
    import time
    from collections import deque

    pending = deque(enumerate(prompts))
    reqs: list = [None] * len(prompts)
    active: set[str] = set()

    def submit() -> None:
        while pending and len(active) < in_flight:
            i, prompt = pending.popleft()
            reqs[i] = engine.make_request(prompt, params)
            engine.scheduler.add_request(reqs[i])
            active.add(reqs[i].rid)

    start = time.perf_counter()
    submit()
    for deltas in engine.stream_steps():
        for d in deltas:
            if d.finish_reason is not None:
                active.discard(d.rid)
        submit()
    return reqs, time.perf_counter() - start


def optimal_hit_rate(prompts) -> float:
    """Best achievable cache hit rate for a batch (SGLang paper Theorem 3.1): with the whole
    batch in one radix tree, each edge must be computed once, so the optimum is
    1 - (sum of edge lengths) / (total prompt tokens)."""
    import torch

    from server.cache.radix_tree import RadixCache

    tree = RadixCache()
    total = 0
    for p in prompts:
        tree.insert(p, torch.zeros(len(p), dtype=torch.int64))
        total += len(p)
    return 1 - tree.sum_edge_lengths() / total
