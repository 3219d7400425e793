"""Held-out evaluation layouts and the training sampler that excludes them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from daedalus_trainer.envs import Maze, corner_pairs, count_layouts
from daedalus_trainer.layouts import (
    LayoutError,
    TrainingSampler,
    check_layouts,
    estimate_layouts,
    eval_layout_hashes,
    eval_mazes,
    possible_layouts,
    training_eval_mazes,
    with_corner_pairs,
)


def env(size=7, n=64, seed=1234):
    return SimpleNamespace(size=size, eval_mazes=n, eval_seed=seed)


def test_eval_set_has_distinct_layouts_and_is_deterministic():
    a, b = eval_mazes(env()), eval_mazes(env())
    assert len(a) == 64 and a == b
    assert len({m.layout_hash() for m in a}) == 64
    assert eval_mazes(env(), n=10) == a[:10]
    assert eval_mazes(env(seed=1)) != a
    assert eval_layout_hashes(env()) == frozenset(m.layout_hash() for m in a)


def test_training_sampler_never_yields_eval_layouts_and_covers_the_rest():
    sampler = TrainingSampler.for_env(env(), seed=0)
    held_out = eval_layout_hashes(env())
    seen = {sampler.maze(step, i).layout_hash() for step in range(60) for i in range(32)}
    assert not seen & held_out
    # 1920 uniform draws over the 128 remaining layouts see all of them (miss probability ~1e-4)
    assert len(seen) == count_layouts(7) - 64 == 128
    # deterministic per (seed, step, index), independent of call order
    assert sampler.maze(5, 3) == TrainingSampler.for_env(env(), seed=0).mazes(5, 4)[3]
    assert sampler.mazes(5, 4) != TrainingSampler.for_env(env(), seed=1).mazes(5, 4)


def test_training_eval_set_is_on_training_layouts_distinct_and_deterministic():
    a = training_eval_mazes(env())
    hashes = [m.layout_hash() for m in a]
    assert len(a) == 64 and a == training_eval_mazes(env()) and len(set(hashes)) == 64
    assert not set(hashes) & eval_layout_hashes(env())  # none of them is held out
    assert training_eval_mazes(env(), n=5) == a[:5]
    other = training_eval_mazes(env(seed=1))
    assert other != a and not {m.layout_hash() for m in other} & eval_layout_hashes(env(seed=1))
    # when the evaluation set leaves exactly as many training layouts (96 of 192), the set is all of them
    every = {m.layout_hash() for m in training_eval_mazes(env(n=96))}
    assert len(every) == 96 and every.isdisjoint(eval_layout_hashes(env(n=96)))


def test_report_counts_possible_and_excluded_layouts():
    r = check_layouts(env())
    assert (r.possible, r.excluded, r.training) == (192, 64, 128)
    assert r.summary() == "size 7: 192 possible layouts, 64 held out for evaluation, 128 for training"
    assert r.to_dict()["possible"] == 192
    big = check_layouts(env(size=31))
    assert big.possible > 1e100 and big.to_dict()["training"] > 1e100


@pytest.mark.parametrize(
    ("size", "n", "message"),
    [
        (5, 1, "use a larger environment.size"),  # 4 layouts in all
        (7, 100, "lower environment.evalMazes to at most 96"),  # 92 left < 100 held out
        (7, 200, "exceeds the 192 distinct layouts"),
    ],
)
def test_configs_leaving_too_few_training_layouts_are_rejected(size, n, message):
    with pytest.raises(LayoutError, match=message):
        check_layouts(env(size=size, n=n))
    with pytest.raises(LayoutError):
        TrainingSampler.for_env(env(size=size, n=n), seed=0)


def test_layout_count_estimate_matches_exact_count():
    assert possible_layouts(9) == 100352
    for size in (7, 9, 11, 13):
        assert estimate_layouts(size) == pytest.approx(count_layouts(size), rel=1e-9)


def test_eval_corners_play_each_held_out_layout_from_several_corner_pairs():
    drawn = eval_mazes(env())
    four = eval_mazes(SimpleNamespace(size=7, eval_mazes=64, eval_seed=1234, eval_corners=4))
    assert len(four) == 256 and four[::4] == drawn  # the drawn maze first, then the other pairs of its walls
    for i in range(64):
        group = four[4 * i: 4 * i + 4]
        assert len({m.layout_hash() for m in group}) == 1
        assert len({(m.start, m.goal) for m in group}) == 4
        assert {(m.start, m.goal) for m in group} == set(corner_pairs(7))
    assert eval_layout_hashes(SimpleNamespace(size=7, eval_mazes=64, eval_seed=1234, eval_corners=4)) == {
        m.layout_hash() for m in drawn}  # what training excludes does not change
    two = eval_mazes(SimpleNamespace(size=7, eval_mazes=64, eval_seed=1234, eval_corners=2), n=3)
    assert len(two) == 6 and two[::2] == drawn[:3]  # n counts layouts


def test_with_corner_pairs_rejects_a_maze_that_does_not_start_in_a_corner():
    maze = eval_mazes(env())[0]
    inner = Maze(walls=maze.walls, start=(3, 3) if not maze.walls[3, 3] else (1, 3), goal=maze.goal)
    assert with_corner_pairs([inner], 1) == [inner]
    with pytest.raises(ValueError, match="not an opposite-corner pair"):
        with_corner_pairs([inner], 2)
    with pytest.raises(ValueError, match="corners must be 1-4"):
        with_corner_pairs([maze], 5)


def test_the_api_layout_table_is_the_exact_count():
    """config's torch-free table (the CRD's CEL rule and `daedalus validate` use it) against the matrix-tree count;
    from size 11 on no allowed evalMazes can leave too few training layouts."""
    from daedalus_trainer.config import SMALL_SIZE_LAYOUTS, max_eval_mazes

    assert {size: count_layouts(size) for size in SMALL_SIZE_LAYOUTS} == SMALL_SIZE_LAYOUTS
    assert max_eval_mazes(count_layouts(11)) >= 100_000
    assert max_eval_mazes(192) == 96 and max_eval_mazes(4) == 0
