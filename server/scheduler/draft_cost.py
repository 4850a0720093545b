"""How much of a draft pays: forward-pass costs measured by row count, and each draft source's
measured acceptance.

A draft of k tokens (jump-forward's forced tokens, or a prompt-lookup n-gram) turns its
request's next one-row decode into a verify pass of 1 + k rows. Where every row is computed as a
one-token step would be (the batch-invariant CPU path), the outputs are the same either way, and
so are they for any prefix of the draft: the choice is cost alone. A pass of ``rows`` rows that
would produce ``rows`` tokens produces ``rows + a(j)`` with the first j draft tokens at cost
``c(rows + j)`` instead of ``c(rows)``; the gate keeps the j (0 .. k) that maximizes the pass's
tokens per second,

    (rows + a(j)) / c(rows + j),   j = 0: rows / c(rows).

``a(j)`` is the expected number of accepted tokens of a j-token draft when each token is
accepted with probability ``p`` given the ones before it were (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding": acceptances i.i.d. at rate alpha, a run
of gamma drafts yields (1 - alpha^(gamma + 1)) / (1 - alpha) tokens, the sampled one included):
``a(j) = p (1 - p^j) / (1 - p)``; ``p`` is measured per source as accepted tokens over accepted
tokens plus the drafts a rejection cut short. Where wide passes are dear (a 2-core Zen 4: 1 + 8
rows cost 1.8x one row, 1 + 4 rows 1.2x) the gate verifies the first few tokens of a prompt-lookup
draft, whose later tokens are rarely accepted; forced tokens (p near 1) are verified whole.

``c`` is an exponential moving average of measured pass seconds per row count (:class:`PassCosts`),
interpolated linearly between the measured counts and extrapolated from the two nearest beyond
them (with many streams the row counts of passes with drafts rarely repeat). While a cost is
unknown, or the two contradict each other (a wider pass measured no dearer than a narrower one),
the gate decides so that the pass measures the one in doubt: the whole draft is kept while
``c(rows + k)`` is unknown and refused while ``c(rows)`` is unknown or not below ``c(rows + k)``.
(A request alone whose first, one-row pass was its prompt's, 184 ms, never ran a one-row pass
again: every draft looked free, and each step verified 32 forced tokens of which ~1 in 2,000 was
accepted, 110 ms per token instead of 20.) One refused or shortened draft in ``EXPLORE_EVERY`` is
kept whole anyway, so a cost measured on a slow pass (a warm-up, a noisy neighbour) is measured
again.

The rule is SGLang's compressed-FSM jump-forward (Zheng et al. 2024, §4) and prompt-lookup
decoding (Saxena 2023) decided per request from measured costs; the criterion is speculative
decoding's expected walltime improvement (Leviathan et al. 2023) with measured instead of
modelled pass costs.
"""

from __future__ import annotations

import bisect

EXPLORE_EVERY = 16  # refused or shortened drafts between two kept whole (re-measuring it)
# (accepted tokens, drafts cut short) a draft source starts with. Forced tokens are refused
# only where the model prefers another tokenization of the forced text: p = 0.9, worth 10
# tokens; prompt-lookup n-grams: p = 0.5, worth 4.
PRIORS = {"jump_forward": (9.0, 1.0)}
PRIOR = (2.0, 2.0)


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
        two nearest on one side (never below the nearest measured cost beneath it, and below the
        smallest measured count never below its cost's share by rows, so always > 0); None while
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
        if j > 0:  # never below the measured cost beneath it
            return max(estimate, self._seconds[counts[j - 1]])
        # Below every measured count a steep slope extrapolates to zero or less (measured 8
        # and 16 rows, asked 1); a pass costs at least its share by rows of the smallest
        # measured one (true of any cost a + b * rows with a >= 0).
        return max(estimate, c0 * rows / r0)


class DraftGate:
    """Keeps the prefix of a draft that raises the pass's tokens per second the most (module
    docstring)."""

    def __init__(self, costs: PassCosts | None = None):
        self.costs = costs or PassCosts()
        self._counts: dict[str, list[float]] = {}
        self._short = 0
        self.kept = 0
        self.dropped = 0

    def continuation(self, source: str) -> float:
        """p: the measured chance that a draft token from ``source`` ("jump_forward",
        "ngram") is accepted given that the ones before it were, from the source's prior."""
        accepted, cut = self._counts.get(source, PRIORS.get(source, PRIOR))
        return accepted / (accepted + cut)

    def observe(self, source: str, proposed: int, accepted: int) -> None:
        """A verify pass checked ``proposed`` tokens of ``source``; the first ``accepted``
        were kept."""
        counts = self._counts.setdefault(source, list(PRIORS.get(source, PRIOR)))
        counts[0] += accepted
        counts[1] += accepted < proposed

    def trim(self, req, running: list, prefilling: list) -> None:
        """Cut ``req``'s fresh draft (a :class:`server.scheduler.request.Req`'s ``draft``) to
        the tokens worth verifying next pass (none: it decodes one token); the pass would
        otherwise run the ``running`` requests' one-token rows and the verify rows of the
        drafts already kept by ``prefilling`` ones."""
        if not req.draft:
            return
        rows = (len(running) + (req not in running)
                + sum(1 + len(r.draft) for r in prefilling if r.draft and r is not req))
        req.draft = req.draft[:self.length(req.draft_source, max(rows, 1), len(req.draft))]

    def length(self, source: str, rows: int, k: int) -> int:
        """How many of a ``k``-token draft from ``source`` should join a pass that would
        otherwise run ``rows`` rows (``rows`` >= 1, counting the drafting request's own row):
        0 (refused) .. k."""
        base, wide = self.costs.cost(rows), self.costs.cost(rows + k)
        if wide is None:  # this pass measures c(rows + k)
            best = k
        else:
            best = 0  # refused while c(rows) is unknown or contradicts c(rows + k): measured
            if base is not None and base < wide:
                p, rate = self.continuation(source), rows / base
                term, expected = 1.0, 0.0  # p^j and a(j) = p + ... + p^j
                for j in range(1, k + 1):
                    term *= p
                    expected += term
                    r = (rows + expected) / self.costs.cost(rows + j)
                    if r > rate:
                        best, rate = j, r
            if best < k:
                self._short += 1
                if self._short % EXPLORE_EVERY == 0:
                    best = k
        if best:
            self.kept += 1
        else:
            self.dropped += 1
        return best
