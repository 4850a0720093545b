"""The draft gate's arithmetic: keep a draft when (rows + expected accepted) / c(rows + k)
beats rows / c(rows), on measured costs and measured acceptance."""

from __future__ import annotations

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


def test_an_unmeasured_width_keeps_the_draft_so_it_gets_measured():
    gate = DraftGate()
    assert gate.pays("ngram", 4, 8)
    gate.costs.record(4, 0.010)
    assert gate.pays("ngram", 4, 8)  # c(12) still unknown
    assert gate.kept == 2 and gate.dropped == 0
    gate.costs.record(5, 0.020)  # now extrapolated: c(12) = 0.09, 12 x 0.01 < 8 x 0.09
    assert not gate.pays("ngram", 4, 8)


def test_an_unmeasured_base_refuses_the_draft_so_it_gets_measured():
    """A request alone whose drafts were all kept only ever ran 33-row passes: c(1) stayed
    unknown and every draft was kept, though ~1 forced token in 2,000 was accepted."""
    gate = DraftGate()
    gate.costs.record(33, 0.110)
    gate.observe("jump_forward", 5840, 3)
    assert not gate.pays("jump_forward", 1, 32)  # this pass measures c(1)
    gate.costs.record(1, 0.020)
    assert not gate.pays("jump_forward", 1, 32)  # now weighed: 1.02 tokens for 5.5x the cost
    assert gate.kept == 0 and gate.dropped == 2


def test_a_base_measured_dearer_than_the_wide_pass_is_measured_again():
    """The one-row pass measured was the prompt's (184 ms, more than a 33-row verify pass):
    keeping drafts would never re-measure it, so the draft is refused until it is."""
    gate = DraftGate()
    gate.costs.record(1, 0.184)
    gate.costs.record(33, 0.110)
    gate.observe("jump_forward", 5840, 3)
    assert not gate.pays("jump_forward", 1, 32)
    gate.costs.alpha = 1.0
    gate.costs.record(1, 0.020)
    assert not gate.pays("jump_forward", 1, 32)
    gate.observe("jump_forward", 100_000, 100_000)  # nearly every forced token accepted
    assert gate.pays("jump_forward", 1, 32)


def test_the_criterion_weighs_cost_against_expected_acceptance():
    gate = DraftGate()
    gate.costs.record(1, 0.010)
    gate.costs.record(9, 0.030)  # 3x the cost for 1 + 8 rows
    # prior acceptance 0.5: 1 + 4 expected tokens for 3x the cost pays
    assert gate.acceptance("ngram") == 0.5 and gate.pays("ngram", 1, 8)
    gate.observe("ngram", 96, 0)  # nothing accepted since: 2/100
    assert gate.acceptance("ngram") == 0.02
    assert not gate.pays("ngram", 1, 8)  # 1.16 tokens for 3x the cost
    gate.observe("jump_forward", 100, 100)  # forced tokens: nearly all kept
    assert gate.pays("jump_forward", 1, 8)


def test_one_refusal_in_explore_every_is_kept_to_remeasure():
    gate = DraftGate()
    gate.costs.record(2, 0.01)
    gate.costs.record(6, 1.0)
    decisions = [gate.pays("ngram", 2, 4) for _ in range(3 * EXPLORE_EVERY)]
    assert sum(decisions) == 3 and decisions[EXPLORE_EVERY - 1]


def test_contradicting_costs_still_explore_the_wide_pass():
    """A wide pass measured cheaper than a narrow one on a lucky moment is measured again now
    and then, or its drafts would be refused for good."""
    gate = DraftGate()
    gate.costs.record(2, 0.020)
    gate.costs.record(3, 0.015)
    decisions = [gate.pays("jump_forward", 2, 1) for _ in range(2 * EXPLORE_EVERY)]
    assert sum(decisions) == 2 and decisions[EXPLORE_EVERY - 1]
