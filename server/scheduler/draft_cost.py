"""Whether a draft pays: forward-pass costs measured by row count, and each draft source's
measured acceptance.

A draft of k tokens (jump-forward's forced tokens, or a prompt-lookup n-gram) turns its
request's next one-row decode into a verify pass of 1 + k rows. Where every row is computed as a
one-token step would be (the batch-invariant CPU path), the outputs are the same either way, so
the choice is cost alone. A pass of ``rows`` rows that would produce ``rows`` tokens produces
``rows + a`` with the draft (``a`` = expected accepted tokens = acceptance x k) at cost
``c(rows + k)`` instead of ``c(rows)``; the draft is kept when

    (rows + a) / c(rows + k) > rows / c(rows)

i.e. when it raises the pass's tokens per second. ``c`` is an exponential moving average of
measured pass seconds per row count (:class:`PassCosts`), interpolated linearly between the
measured counts and extrapolated from the two nearest beyond them (with many streams the row
counts of passes with drafts rarely repeat). While a cost is unknown, or the two contradict
each other (a wider pass measured no dearer than a narrower one), the gate decides so that the
pass measures the one in doubt: the draft is kept while ``c(rows + k)`` is unknown and refused
while ``c(rows)`` is unknown or not below ``c(rows + k)``. (A request alone whose first, one-row
pass was its prompt's, 184 ms, never ran a one-row pass again: every draft looked free, and each
step verified 32 forced tokens of which ~1 in 2,000 was accepted, 110 ms per token instead of
20.) One refused draft in ``EXPLORE_EVERY`` is kept anyway so a cost measured on a slow pass (a
warm-up, a noisy neighbour) is measured again.

The rule is SGLang's compressed-FSM jump-forward (Zheng et al. 2024, §4) and prompt-lookup
decoding (Saxena 2023) decided per request from measured costs; the criterion is speculative
decoding's expected walltime improvement (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding") with measured instead of modelled pass costs.
"""

from __future__ import annotations

import bisect

EXPLORE_EVERY = 16  # refused drafts between two kept anyway (re-measuring the wider pass)
PRIOR = (4.0, 2.0)  # (proposed, accepted) a draft source starts with: acceptance 0.5


class PassCosts:
    """Seconds of a forward pass (scheduling, the pass, sampling) by its number of rows
    (new tokens), as an exponential moving average with weight ``alpha`` for each new
    measurement."""

    def __init__(self, alpha: float = 0.25):
        self.alpha = alpha
        self._seconds: dict[int, float] = {}
        self._counts: list[int] = []  # the measured row counts, sorted (cost() runs every step)

    def record(self, rows: int, seconds: float) -> None:
        """One pass of ``rows`` rows took ``seconds``."""
        old = self._seconds.get(rows)
        if old is None:
            bisect.insort(self._counts, rows)
        self._seconds[rows] = seconds if old is None else old + self.alpha * (seconds - old)

    def cost(self, rows: int) -> float | None:
        """The seconds of a ``rows``-row pass: the average of its measurements, else linear
        in rows between the nearest measured counts on either side, else extrapolated from the
        two nearest on one side (never below the nearest measured cost beneath it); None while
        fewer than two row counts are measured and ``rows`` is not one of them."""
        if rows in self._seconds:
            return self._seconds[rows]
        counts = self._counts
        if len(counts) < 2:
            return None
        j = bisect.bisect(counts, rows)  # counts[j - 1] < rows < counts[j]
        i = min(max(j, 1), len(counts) - 1)  # the pair around rows, or the nearest pair
        r0, r1 = counts[i - 1], counts[i]
        c0, c1 = self._seconds[r0], self._seconds[r1]
        estimate = c0 + (c1 - c0) * (rows - r0) / (r1 - r0)
        floor = self._seconds[counts[j - 1]] if j > 0 else 0.0
        return max(estimate, floor)


class DraftGate:
    """Keeps a draft when it raises the pass's tokens per second (module docstring)."""

    def __init__(self, costs: PassCosts | None = None):
        self.costs = costs or PassCosts()
        self._counts: dict[str, list[float]] = {}
        self._refused = 0
        self.kept = 0
        self.dropped = 0

    def acceptance(self, source: str) -> float:
        """Share of the drafted tokens from ``source`` ("jump_forward", "ngram") accepted so
        far, starting from a prior of 0.5 worth 4 tokens."""
        proposed, accepted = self._counts.get(source, PRIOR)
        return accepted / proposed

    def observe(self, source: str, proposed: int, accepted: int) -> None:
        """A verify pass checked ``proposed`` tokens of ``source``; ``accepted`` were kept."""
        counts = self._counts.setdefault(source, list(PRIOR))
        counts[0] += proposed
        counts[1] += accepted

    def pays(self, source: str, rows: int, k: int) -> bool:
        """Whether a ``k``-token draft from ``source`` should join a pass that would otherwise
        run ``rows`` rows (``rows`` >= 1, counting the drafting request's own row)."""
        base, wide = self.costs.cost(rows), self.costs.cost(rows + k)
        keep = wide is None  # kept: this pass measures c(rows + k); refused: c(rows)
        if base is not None and wide is not None:
            expected = self.acceptance(source) * k
            # base >= wide contradicts itself: refused, so the pass re-measures c(rows)
            keep = base < wide and (rows + expected) * base > rows * wide
            if not keep:
                self._refused += 1
                keep = self._refused % EXPLORE_EVERY == 0
        if keep:
            self.kept += 1
        else:
            self.dropped += 1
        return keep
