"""Held-out evaluation mazes, by layout, and the training sampler that never shows them.

Small mazes have few distinct layouts: a perfect maze of side ``size`` is a spanning tree of the
``n x n`` room grid (``n = (size - 1) / 2``), so size 5 has 4 layouts, size 7 has 192 and size 9 has 100352
(:func:`daedalus_trainer.envs.count_layouts`, Kirchhoff's matrix-tree theorem). Different seeds therefore repeat
layouts, and holding evaluation mazes out by seed would test on training layouts. Here the evaluation set is
``evalMazes`` mazes with **distinct** layouts drawn from ``evalSeed``, and every training sampler (SFT and GRPO)
rejects mazes whose canonical layout hash (:meth:`daedalus_trainer.envs.Maze.layout_hash`, walls only) is in that set.

A configuration is rejected (:class:`LayoutError`) when the evaluation set cannot be drawn (more mazes than layouts)
or leaves too few training layouts: fewer than :data:`MIN_TRAINING_LAYOUTS`, or fewer than the evaluation set itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from daedalus_trainer.envs import Maze, corner_pairs, count_layouts, generate_maze
from daedalus_trainer.config import MIN_TRAINING_LAYOUTS, max_eval_mazes

#: Above this side the exact layout count (a big-integer determinant) is replaced by a float estimate.
EXACT_COUNT_MAX_SIZE = 15
#: Attempts per requested maze before a sampler gives up (rejection sampling).
MAX_ATTEMPTS_PER_MAZE = 10_000


class LayoutError(ValueError):
    """The evaluation set cannot be held out as configured (message says how to fix it)."""


def possible_layouts(size: int) -> float:
    """Number of distinct layouts of side ``size``: exact (:func:`daedalus_trainer.envs.count_layouts`, as a float)
    up to :data:`EXACT_COUNT_MAX_SIZE`, :func:`estimate_layouts` above (the exact big-integer determinant gets slow)."""
    return float(count_layouts(size)) if size <= EXACT_COUNT_MAX_SIZE else estimate_layouts(size)


def estimate_layouts(size: int) -> float:
    """Spanning trees of the room grid in float64: ``exp(log det)`` of the grid Laplacian with one row and column
    removed (Kirchhoff's matrix-tree theorem); ``inf`` beyond float range. Relative error ~1e-12."""
    n = (int(size) - 1) // 2
    lap = np.zeros((n * n, n * n))
    for k in range(n * n):
        r, c = divmod(k, n)
        for rr, cc in ((r, c + 1), (r + 1, c), (r, c - 1), (r - 1, c)):
            if 0 <= rr < n and 0 <= cc < n:
                lap[k, k] += 1
                lap[k, rr * n + cc] = -1
    _, logdet = np.linalg.slogdet(lap[:-1, :-1])
    return math.exp(logdet) if logdet < 700 else math.inf


@dataclass(frozen=True)
class LayoutReport:
    """How the evaluation set splits the layout space.

    Attributes:
        size: maze side.
        possible: distinct layouts of that size (exact for small sizes).
        eval_mazes: mazes in the evaluation set (each a distinct layout).
        excluded: layouts excluded from training (= ``eval_mazes``).
        training: layouts left for training (``possible - excluded``).
        min_training: the smallest acceptable ``training``.
    """

    size: int
    possible: float
    eval_mazes: int
    excluded: int
    training: float
    min_training: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (counts above 2**53 as floats, beyond float range as None)."""
        d = asdict(self)
        for k in ("possible", "training"):
            d[k] = int(d[k]) if d[k] < 2**53 else (d[k] if math.isfinite(d[k]) else None)
        return d

    def summary(self) -> str:
        """One line for logs: ``size 7: 192 possible layouts, 64 held out for evaluation, 128 for training``."""
        fmt = lambda x: f"{int(x)}" if x < 1e9 else (f"{x:.3g}" if math.isfinite(x) else "more than 1e308")  # noqa: E731
        return (f"size {self.size}: {fmt(self.possible)} possible layouts, {self.excluded} held out for evaluation, "
                f"{fmt(self.training)} for training")


def check_layouts(env_spec: Any, min_training: int | None = None) -> LayoutReport:
    """The :class:`LayoutReport` of a configuration, or :class:`LayoutError` when it leaves too few training layouts.

    Args:
        env_spec: ``EnvironmentSpec``-like (``size``, ``eval_mazes``).
        min_training: required training layouts (default ``max(MIN_TRAINING_LAYOUTS, eval_mazes)``).

    Raises:
        LayoutError: with the numbers and how to fix the configuration.
    """
    size, n_eval = int(env_spec.size), int(env_spec.eval_mazes)
    possible = possible_layouts(size)
    need = max(MIN_TRAINING_LAYOUTS, n_eval) if min_training is None else int(min_training)
    report = LayoutReport(size, possible, n_eval, n_eval, possible - n_eval, need)
    if n_eval > possible:
        raise LayoutError(
            f"environment.evalMazes={n_eval} exceeds the {int(possible)} distinct layouts of size-{size} mazes; "
            f"lower evalMazes or use a larger size"
        )
    if report.training < need:
        max_eval = max_eval_mazes(possible)
        fix = (f"lower environment.evalMazes to at most {max_eval} or use a larger environment.size" if max_eval
               else "use a larger environment.size (7 or more)")
        raise LayoutError(
            f"{report.summary()}: at least {need} training layouts are required (no fewer than "
            f"{MIN_TRAINING_LAYOUTS} and no fewer than the evaluation set); {fix}"
        )
    return report


def _distinct_mazes(size: int, count: int, rng: np.random.Generator, excluded: frozenset[str] = frozenset()
                    ) -> list[Maze]:
    """``count`` mazes with distinct layouts not in ``excluded``, drawn in order from ``rng`` (repeats skipped)."""
    seen: set[str] = set()
    mazes: list[Maze] = []
    for _ in range(MAX_ATTEMPTS_PER_MAZE * count):
        maze = generate_maze(size, rng)
        h = maze.layout_hash()
        if h not in seen and h not in excluded:
            seen.add(h)
            mazes.append(maze)
            if len(mazes) == count:
                return mazes
    # needs count close to the number of layouts and astronomically bad luck
    raise LayoutError(f"could not draw {count} distinct layouts of size {size}")  # pragma: no cover


def eval_mazes(env_spec: Any, n: int | None = None) -> list[Maze]:
    """The held-out evaluation set: ``env_spec.eval_mazes`` mazes with distinct layouts, drawn in order from
    ``np.random.default_rng(env_spec.eval_seed)`` (a repeated layout is skipped), each played from
    ``env_spec.eval_corners`` start/goal corner pairs (:func:`with_corner_pairs`; 1 when the spec has no such
    field). Deterministic.

    Args:
        env_spec: ``EnvironmentSpec``-like (``size``, ``eval_mazes``, ``eval_seed``, optional ``eval_corners``).
        n: only the first ``n`` layouts (the full set still defines what training excludes).

    Returns:
        ``eval_mazes`` (or ``n``) ``* eval_corners`` mazes, the corner pairs of one layout next to each other.

    Raises:
        LayoutError: see :func:`check_layouts`.
    """
    check_layouts(env_spec)
    rng = np.random.default_rng(int(env_spec.eval_seed))
    drawn = _distinct_mazes(int(env_spec.size), int(env_spec.eval_mazes), rng)
    return with_corner_pairs(drawn if n is None else drawn[: int(n)], eval_corners(env_spec))


def eval_corners(env_spec: Any) -> int:
    """Corner pairs per held-out layout (``environment.evalCorners``; 1 for specs without the field)."""
    return int(getattr(env_spec, "eval_corners", 1))


def with_corner_pairs(mazes: Sequence[Maze], corners: int) -> list[Maze]:
    """Each maze followed by its own walls from the next ``corners - 1`` opposite-corner start/goal pairs
    (:func:`daedalus_trainer.envs.corner_pairs` order, cyclically after the maze's own pair).

    Raises:
        ValueError: ``corners`` outside 1-4, or above 1 for a maze whose start and goal are not opposite corners.
    """
    if not 1 <= int(corners) <= 4:
        raise ValueError(f"corners must be 1-4, got {corners}")
    out: list[Maze] = []
    for maze in mazes:
        pairs = corner_pairs(maze.size)
        own = pairs.index((maze.start, maze.goal)) if (maze.start, maze.goal) in pairs else None
        out.append(maze)
        if corners > 1 and own is None:
            raise ValueError(f"maze start {maze.start} / goal {maze.goal} is not an opposite-corner pair")
        for k in range(1, int(corners)):
            start, goal = pairs[(own + k) % len(pairs)]
            out.append(Maze(walls=maze.walls, start=start, goal=goal))
    return out


#: Second key of the random stream of :func:`training_eval_mazes` (the held-out set uses ``eval_seed`` alone).
TRAINING_EVAL_STREAM = 1


def training_eval_mazes(env_spec: Any, n: int | None = None) -> list[Maze]:
    """A set the size of the evaluation set, on *training* layouts: what training learned where it trained.

    ``env_spec.eval_mazes`` mazes with distinct layouts outside the held-out set (so every one is a layout the
    training samplers can draw), in order from ``np.random.default_rng([eval_seed, TRAINING_EVAL_STREAM])``.
    Deterministic. Compared with :func:`eval_mazes`, it separates learning the mazes one trains on from learning
    what carries to unseen layouts (at size 7 there are only 128 training layouts, so GRPO and SFT see each many
    times).

    Args:
        env_spec: ``EnvironmentSpec``-like (``size``, ``eval_mazes``, ``eval_seed``).
        n: return only the first ``n``.

    Raises:
        LayoutError: see :func:`check_layouts` (which guarantees at least ``eval_mazes`` training layouts).
    """
    check_layouts(env_spec)
    rng = np.random.default_rng([int(env_spec.eval_seed), TRAINING_EVAL_STREAM])
    mazes = _distinct_mazes(int(env_spec.size), int(env_spec.eval_mazes), rng, eval_layout_hashes(env_spec))
    return mazes if n is None else mazes[: int(n)]


def eval_layout_hashes(env_spec: Any) -> frozenset[str]:
    """Layout hashes of the whole evaluation set (what every training sampler excludes)."""
    return frozenset(m.layout_hash() for m in eval_mazes(env_spec))


class TrainingSampler:
    """Deterministic training mazes that never use an evaluation layout.

    ``maze(step, index)`` draws from ``np.random.default_rng([seed, step, index])`` and rejects mazes whose layout is
    excluded, so the result depends only on ``(seed, step, index)``: a resumed run sees the same mazes, and the
    accepted mazes are uniform over the remaining layouts (Wilson's algorithm is uniform over spanning trees).

    Args:
        size: maze side.
        seed: stream seed (``algorithm.seed`` for GRPO, ``sft.seed`` for SFT).
        excluded: layout hashes never returned.
    """

    def __init__(self, size: int, seed: int, excluded: frozenset[str] | set[str]):
        self.size = int(size)
        self.seed = int(seed)
        self.excluded = frozenset(excluded)

    @classmethod
    def for_env(cls, env_spec: Any, seed: int) -> TrainingSampler:
        """A sampler excluding ``env_spec``'s evaluation layouts.

        Raises:
            LayoutError: see :func:`check_layouts`.
        """
        return cls(int(env_spec.size), seed, eval_layout_hashes(env_spec))

    def maze(self, step: int, index: int) -> Maze:
        """Maze ``index`` of ``step``.

        Raises:
            LayoutError: no acceptable maze in :data:`MAX_ATTEMPTS_PER_MAZE` draws.
        """
        rng = np.random.default_rng([self.seed, int(step), int(index)])
        for _ in range(MAX_ATTEMPTS_PER_MAZE):
            maze = generate_maze(self.size, rng)
            if maze.layout_hash() not in self.excluded:
                return maze
        raise LayoutError(f"no training layout found in {MAX_ATTEMPTS_PER_MAZE} draws (size {self.size})")

    def mazes(self, step: int, n: int) -> list[Maze]:
        """``[maze(step, 0), ..., maze(step, n - 1)]``."""
        return [self.maze(step, i) for i in range(int(n))]
