"""The draft gate's arithmetic: keep the prefix j of a k-token draft that maximizes
(rows + a(j)) / c(rows + j) (j = 0: rows / c(rows)), on measured costs and a measured per-token
acceptance."""

from __future__ import annotations

import pytest

from server.scheduler.draft_cost import EXPLORE_EVERY, DraftGate, PassCosts


def test_pass_costs_average_new_measurements():
    c = PassCosts(alpha=0.5)
    assert c.cost(4) is None
    c.record(4, 2.0)
    c.record(4, 4.0)
    assert c.cost(4) == 3.0 and c.cost(5) is None


def test_unmeasured_row_counts_are_interpolated_and_extrapolated():
    c = PassCosts()
    c.record(4, 0.010)
    assert c.cost(12) is None  # one count: no slope yet
    c.record(8, 0.018)
    assert abs(c.cost(6) - 0.014) < 1e-12  # between two measured counts
    assert abs(c.cost(16) - 0.034) < 1e-12  # beyond them, on the nearest pair's slope
    assert abs(c.cost(2) - 0.006) < 1e-12
    c.record(12, 0.015)  # a noisy wider pass measured cheaper than a narrower one
    assert c.cost(10) == 0.018  # never below the measured count beneath it
    assert c.cost(20) == 0.015  # a falling slope is not extrapolated below the last point


def test_a_steep_slope_never_extrapolates_a_free_pass_below_the_measured_counts():
    # Measured in CI: a verify pass of 16 rows, then 23; the slope from those reached zero at
    # 8 rows and the gate divided by that cost.
    c = PassCosts()
    c.record(16, 0.008)
    c.record(23, 0.022)
    assert c.cost(8) == pytest.approx(0.004)  # half of 16 rows' cost, not -0.008
    assert c.cost(1) > 0
    gate = DraftGate(c)
    assert 0 <= gate.length("jump_forward", 8, 15) <= 15


def test_acceptance_is_measured_per_token_from_where_drafts_were_cut():
    gate = DraftGate()
    assert gate.continuation("ngram") == 0.5  # the prior
    gate.observe("ngram", 8, 5)  # 5 accepted, then a rejection
    gate.observe("ngram", 3, 3)  # all accepted: no cut
    assert gate.continuation("ngram") == pytest.approx(10 / 13)
    assert gate.continuation("jump_forward") == 0.9  # each source on its own, forced tokens
    # start likely to be accepted


def test_an_unmeasured_width_keeps_the_draft_so_it_gets_measured():
    gate = DraftGate()
    assert gate.length("ngram", 4, 8) == 8
    gate.costs.record(4, 0.010)
    assert gate.length("ngram", 4, 8) == 8  # c(12) still unknown
    assert gate.kept == 2 and gate.dropped == 0
    gate.costs.record(5, 0.020)  # now extrapolated: a row costs as much as the whole pass
    assert gate.length("ngram", 4, 8) == 0


def test_an_unmeasured_base_refuses_the_draft_so_it_gets_measured():
    """A request alone whose drafts were all kept only ever ran 33-row passes: c(1) stayed
    unknown and every draft was kept, though ~1 forced token in 2,000 was accepted."""
    gate = DraftGate()
    gate.costs.record(33, 0.110)
    for _ in range(200):
        gate.observe("jump_forward", 32, 0)
    assert gate.length("jump_forward", 1, 32) == 0  # this pass measures c(1)
    gate.costs.record(1, 0.020)
    assert gate.length("jump_forward", 1, 32) == 0  # now weighed: p ~ 0.01
    assert gate.kept == 0 and gate.dropped == 2


def test_a_base_measured_dearer_than_the_wide_pass_is_measured_again():
    """The one-row pass measured was the prompt's (184 ms, more than a 33-row verify pass):
    keeping drafts would never re-measure it, so the draft is refused until it is."""
    gate = DraftGate()
    gate.costs.record(1, 0.184)
    gate.costs.record(33, 0.110)
    for _ in range(200):
        gate.observe("jump_forward", 32, 0)
    assert gate.length("jump_forward", 1, 32) == 0
    gate.costs.alpha = 1.0
    gate.costs.record(1, 0.020)
    assert gate.length("jump_forward", 1, 32) == 0
    gate.observe("jump_forward", 100_000, 100_000)  # nearly every forced token accepted
    assert gate.length("jump_forward", 1, 32) == 32


def test_the_criterion_weighs_cost_against_expected_acceptance():
    gate = DraftGate()
    gate.costs.record(1, 0.010)
    gate.costs.record(9, 0.030)  # 3x the cost for 1 + 8 rows
    # prior p = 0.5: the first token (1.5 tokens for 1.25x the cost) pays best
    assert gate.length("ngram", 1, 8) == 1
    for _ in range(98):
        gate.observe("ngram", 8, 0)  # nothing accepted since: p = 2 / 102
    assert gate.length("ngram", 1, 8) == 0
    gate.observe("jump_forward", 100, 100)  # forced tokens: p = 109 / 110
    assert gate.length("jump_forward", 1, 8) == 8


def test_dear_wide_passes_verify_a_shorter_draft():
    """Pass costs measured on a 2-core Zen 4 (1, 5 and 9 rows over a 600-token prefix) and
    prompt-lookup drafts accepted at p = 0.7: of 8 drafted tokens the first 4 pay best (0.42
    tokens a ms against 0.34 for all 8); on flat costs all 8 do."""
    gate = DraftGate()
    for rows, ms in ((1, 5.35), (5, 6.59), (9, 9.46)):
        gate.costs.record(rows, ms / 1e3)
    gate.observe("ngram", 8, 5)  # p = (2 + 5) / (2 + 5 + 2 + 1)
    assert gate.continuation("ngram") == pytest.approx(0.7)
    assert gate.length("ngram", 1, 8) == 4
    flat = DraftGate()
    for rows, ms in ((1, 5.0), (9, 5.5)):
        flat.costs.record(rows, ms / 1e3)
    flat.observe("ngram", 8, 5)
    assert flat.length("ngram", 1, 8) == 8


def test_one_refusal_in_explore_every_is_kept_whole_to_remeasure():
    gate = DraftGate()
    gate.costs.record(2, 0.01)
    gate.costs.record(6, 1.0)
    decisions = [gate.length("ngram", 2, 4) for _ in range(3 * EXPLORE_EVERY)]
    assert decisions.count(4) == 3 and decisions[EXPLORE_EVERY - 1] == 4
    assert decisions.count(0) == 3 * EXPLORE_EVERY - 3


def test_contradicting_costs_still_explore_the_wide_pass():
    """A wide pass measured cheaper than a narrow one on a lucky moment is measured again now
    and then, or its drafts would be refused for good."""
    gate = DraftGate()
    gate.costs.record(2, 0.020)
    gate.costs.record(3, 0.015)
    decisions = [gate.length("jump_forward", 2, 1) for _ in range(2 * EXPLORE_EVERY)]
    assert sum(decisions) == 2 and decisions[EXPLORE_EVERY - 1] == 1
