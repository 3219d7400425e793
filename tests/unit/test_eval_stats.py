"""Intervals of evaluation figures: clustered episodes (several corner pairs per layout) and paired gains."""

from __future__ import annotations

import pytest

from daedalus_trainer.evaluation import clustered_wilson_interval, paired_gain, wilson_interval


def test_one_episode_per_layout_is_the_wilson_interval():
    outcomes = [1] * 43 + [0] * 21
    assert clustered_wilson_interval(outcomes, 1) == wilson_interval(43, 64)
    assert wilson_interval(43, 64) == pytest.approx((0.5500, 0.7743), abs=1e-4)  # make run's 67.2% row


def test_correlated_corner_pairs_widen_the_interval_independent_ones_do_not():
    # 64 layouts x 4 pairs, half of the layouts solved from every corner: 4 episodes carry one layout's information
    clustered = [1, 1, 1, 1] * 32 + [0, 0, 0, 0] * 32
    lo, hi = clustered_wilson_interval(clustered, 4)
    assert (lo, hi) == pytest.approx(wilson_interval(32, 64))  # n_eff = layouts
    # the same 50% with every layout solved from exactly two corners: no between-layout variance, n_eff = 256
    mixed = [1, 0, 1, 0] * 64
    assert clustered_wilson_interval(mixed, 4) == pytest.approx(wilson_interval(128, 256))
    assert (hi - lo) > 1.9 * (wilson_interval(128, 256)[1] - wilson_interval(128, 256)[0])


def test_all_solved_stays_an_honest_interval():
    lo, hi = clustered_wilson_interval([1] * 32, 4)  # 8 layouts: the between-layout variance is unknown
    assert hi == 1.0 and lo == pytest.approx(wilson_interval(8, 8)[0]) and lo < 0.7


def test_paired_gain_counts_fixed_and_broken_episodes():
    before = [0] * 16 + [1] * 48
    after = [1] * 8 + [0] * 8 + [1] * 46 + [0] * 2  # 8 fixed, 2 broken of 64 mazes
    g = paired_gain(before, after, 1)
    assert (g["fixed"], g["broken"], g["episodes"]) == (8, 2, 64)
    assert g["gain"] == pytest.approx(6 / 64)
    assert g["ci_low"] < g["gain"] < g["ci_high"]
    assert g["ci_low"] > -0.01 and g["ci_high"] < 0.2
    same = paired_gain(before, before, 4)
    assert (same["gain"], same["ci_low"], same["ci_high"], same["fixed"], same["broken"]) == (0, 0, 0, 0, 0)


def test_intervals_reject_outcomes_that_are_not_whole_layouts():
    with pytest.raises(ValueError, match="do not split into layouts of 4"):
        clustered_wilson_interval([1, 0, 1], 4)
    with pytest.raises(ValueError, match="differ in length"):
        paired_gain([1, 0], [1], 1)
