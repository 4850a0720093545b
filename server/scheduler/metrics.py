"""Scheduler counters and the monitoring snapshot the server exports (/server_info, /metrics).

The snapshot is built from plain values (the counters, the cache's
:class:`server.cache.manager.CacheUsage`, queue sizes): nothing here reads the scheduler or the
cache's internals.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.cache.manager import CacheUsage


@dataclass
class SchedulerStats:
    """Counters since start (tokens unless named otherwise). Cache hit rate is
    ``cached_prompt_tokens / prompt_tokens`` (the SGLang paper's definition)."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    jump_forward_tokens: int = 0  # output tokens appended by jump-forward (no decode step)
    draft_tokens: int = 0  # tokens proposed by drafts (jump-forward and n-gram) and verified
    accepted_draft_tokens: int = 0  # of those, kept because they equalled the sample
    retractions: int = 0
    aborts: int = 0
    forward_passes: int = 0
    finished_requests: int = 0

    def count_verify(self, produced: list[int], drafts: list[int]) -> int:
        """Count a verify pass that produced ``produced`` tokens for ``drafts``; returns how
        many draft tokens were accepted (the prefix equal to what was sampled)."""
        self.generated_tokens += len(produced)
        self.jump_forward_tokens += len(produced) - 1
        self.draft_tokens += len(drafts)
        accepted = next((i for i, (a, b) in enumerate(zip(produced, drafts)) if a != b),
                        min(len(produced), len(drafts)))
        self.accepted_draft_tokens += accepted
        return accepted

    @property
    def cache_hit_rate(self) -> float:
        """Prompt tokens served from the radix cache over all prompt tokens (0 when none)."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def snapshot(st: SchedulerStats, usage: CacheUsage, *, running: int,
             waiting: int, drafts_dropped: int = 0) -> dict[str, float]:
    """Queue sizes (requests), KV memory (tokens, and ``kv_usage`` = share of the pool held by
    requests or locked cache entries), cache counters and the hit rate (cached / prompt
    tokens), and ``drafts_dropped`` (drafts the cost gate refused, DraftGate.dropped)."""
    return {
        "running_requests": running,
        "waiting_requests": waiting,
        "kv_capacity_tokens": usage.capacity,
        "kv_free_tokens": usage.free,
        "kv_cached_tokens": usage.evictable + usage.protected,
        "kv_usage": usage.held / usage.capacity,
        "prompt_tokens": st.prompt_tokens,
        "cached_prompt_tokens": st.cached_prompt_tokens,
        "cache_hit_rate": st.cache_hit_rate,
        "generated_tokens": st.generated_tokens,
        "jump_forward_tokens": st.jump_forward_tokens,
        "draft_tokens": st.draft_tokens,
        "accepted_draft_tokens": st.accepted_draft_tokens,
        "drafts_dropped": drafts_dropped,
        "evicted_tokens": usage.evicted,
        "tier_loaded_tokens": usage.loaded,
        "host_tier_pages": usage.host_pages,
        "disk_tier_pages": usage.disk_pages,
        "retractions": st.retractions,
        "aborts": st.aborts,
        "finished_requests": st.finished_requests,
        "forward_passes": st.forward_passes,
    }
