"""Prompt-lookup (n-gram) speculative decoding: draft the next tokens by finding the last few
tokens of the sequence earlier in it (an answer copied from a passage, a JSON key echoed from
a schema, a repeated phrase) and proposing what followed there.

The draft is verified exactly like a jump-forward draft (:mod:`server.constrained.jump_forward`):
its tokens are computed in one extend pass, each position is sampled as plain decoding would
sample it, and drafts are kept while they equal the sample. Outputs are therefore identical to
decoding without drafts; a wrong draft costs one wider pass. Reference: Saxena, "Prompt Lookup
Decoding" (2023), as in vLLM's ``ngram`` speculative proposer.
"""

from __future__ import annotations

from typing import Sequence


def ngram_draft(ids: Sequence[int], max_tokens: int, max_ngram: int = 3,
                min_ngram: int = 2, window: int = 4096) -> list[int]:
    """Up to ``max_tokens`` tokens that followed the most recent earlier occurrence of the
    sequence's last n tokens (n from ``max_ngram`` down to ``min_ngram``), looking back at most
    ``window`` tokens; [] when there is none."""
    if max_tokens <= 0 or len(ids) <= min_ngram:
        return []
    lo = max(0, len(ids) - window)
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        tail = list(ids[-n:])
        first = tail[0]
        # scan right to left so the most recent occurrence wins; skip the tail itself
        for start in range(len(ids) - n - 1, lo - 1, -1):
            if ids[start] == first and list(ids[start:start + n]) == tail:
                draft = list(ids[start + n:start + n + max_tokens])
                if draft:
                    return draft
    return []

