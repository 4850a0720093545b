"""Pure ordering functions for the waiting queue: given requests, return them in the order the
scheduler should try to admit them. They never mutate the queue or the cache.

[1/9] has FCFS; [2/9] adds lpm (longest prefix match, SGLang paper Algorithm 1), dfs_weight and
random, which need the radix cache.
"""

from __future__ import annotations

from typing import Sequence

from server.scheduler.request import Req


def fcfs(waiting: Sequence[Req]) -> list[Req]:
    """First come, first served: by arrival time, ties by queue order."""
    return sorted(waiting, key=lambda r: r.arrival_time)


POLICIES = {"fcfs": fcfs}


def order(policy: str, waiting: Sequence[Req]) -> list[Req]:
    """Apply the named policy. Raises KeyError for an unknown name (validated in config)."""
    return POLICIES[policy](waiting)
