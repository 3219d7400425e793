"""Maze2D: VisGym's 2-D maze navigation task as a Gymnasium environment with text actions.

Semantics follow VisGym's ``Maze2DEnv`` (github.com/visgym/VisGym, ``gymnasium/envs/maze_2d/maze_2d.py``):

* The maze is a square grid of odd ``size`` (walls included). Rooms sit at odd (row, col); the outer ring
  is wall. The interior is a *perfect* maze (exactly one path between any two open cells) carved by
  Wilson's loop-erased random walk, which draws a uniformly random spanning tree of the room grid
  (D. B. Wilson, "Generating random spanning trees more quickly than the cover time", STOC 1996).
* Start and goal are opposite interior corners; which corner pair and which end is the start is seeded
  (VisGym's four choices).
* Picture: ``cell_px`` pixels per cell (VisGym: 25), walls gray (169, 169, 169), paths white, the goal a
  red square filling its cell, the agent a blue disc of radius ``cell_px / 4`` at the cell centre, drawn
  over the goal when it stands there.
* Moves: right, up, left, down (VisGym numbering 0..3) and stop. A move into a wall leaves the agent in
  place.

Where this module decides beyond VisGym, the choice is documented on :class:`Maze2DEnv`.
"""

from __future__ import annotations

import hashlib
import string
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

from .actions import ACTION_FORMATS, DIRECTIONS, STOP, format_action, parse_action, syntax_hint

__all__ = [
    "AGENT_RGB",
    "DIRECTIONS",
    "GOAL_RGB",
    "OBSERVATIONS",
    "PATH_RGB",
    "SUCCESS_ON",
    "WALL_RGB",
    "Maze",
    "Maze2DEnv",
    "count_layouts",
    "distance_map",
    "generate_maze",
    "instructions",
    "maze_from_seed",
    "render_ascii",
    "render_rgb",
    "solve",
]

#: Colours as in VisGym's renderer (RGB, uint8).
WALL_RGB: tuple[int, int, int] = (169, 169, 169)
PATH_RGB: tuple[int, int, int] = (255, 255, 255)
AGENT_RGB: tuple[int, int, int] = (0, 0, 255)
GOAL_RGB: tuple[int, int, int] = (255, 0, 0)

#: Success rules (``environment.successOn``).
SUCCESS_ON: tuple[str, ...] = ("stop-on-goal", "arrival")
#: What the model is shown (``environment.observation``); used by :func:`instructions`.
OBSERVATIONS: tuple[str, ...] = ("image", "ascii", "image+ascii")

#: (row, col) step of each direction; row grows downwards, so "up" is row - 1.
DELTAS: dict[str, tuple[int, int]] = {"right": (0, 1), "up": (-1, 0), "left": (0, -1), "down": (1, 0)}

MIN_CELL_PX = 4  # below this the agent disc (radius cell_px/4) has no pixel of its own
_FEEDBACK_CHARSET = string.ascii_letters + string.digits + string.punctuation + " "
_FEEDBACK_MAX = 256

Cell = tuple[int, int]


def _check_size(size: object) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise ValueError(f"maze size must be an int, got {type(size).__name__}")
    if size < 5 or size % 2 == 0:
        raise ValueError(f"maze size must be odd and >= 5 (walls included), got {size}")
    return int(size)


def _cell(value: object, name: str) -> Cell:
    try:
        r, c = value  # type: ignore[misc]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (row, col) pair, got {value!r}") from None
    if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in (r, c)):
        raise ValueError(f"{name} must hold integers, got {value!r}")
    return int(r), int(c)


@dataclass(frozen=True, eq=False)
class Maze:
    """An immutable maze: wall grid plus start and goal.

    Attributes:
        walls: bool array ``[size, size]``, True = wall, row-major (row 0 at the top). Stored read-only.
        start: (row, col) of the agent's starting cell.
        goal: (row, col) of the goal cell.

    Raises:
        ValueError: not a square 2-D grid of 0/1 values, even size or size < 5, outer ring not all wall,
            start or goal outside the grid or on a wall, or start == goal.
    """

    walls: np.ndarray
    start: Cell
    goal: Cell

    def __post_init__(self) -> None:
        raw = np.asarray(self.walls)
        if raw.ndim != 2 or raw.shape[0] != raw.shape[1]:
            raise ValueError(f"walls must be a square 2-D array, got shape {raw.shape}")
        if raw.dtype != bool:
            if raw.dtype.kind not in "iu" or not np.isin(raw, (0, 1)).all():
                raise ValueError("walls must be bool or hold only 0 and 1")
        walls = np.array(raw, dtype=bool, copy=True)
        size = _check_size(walls.shape[0])
        ring = np.concatenate([walls[0], walls[-1], walls[:, 0], walls[:, -1]])
        if not ring.all():
            raise ValueError("the outer ring of the maze must be wall")
        start, goal = _cell(self.start, "start"), _cell(self.goal, "goal")
        for name, (r, c) in (("start", start), ("goal", goal)):
            if not (0 <= r < size and 0 <= c < size):
                raise ValueError(f"{name} {(r, c)} is outside the {size}x{size} grid")
            if walls[r, c]:
                raise ValueError(f"{name} {(r, c)} is on a wall")
        if start == goal:
            raise ValueError("start and goal must differ")
        walls.setflags(write=False)
        object.__setattr__(self, "walls", walls)
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "goal", goal)

    @property
    def size(self) -> int:
        """Side length in cells, walls included."""
        return int(self.walls.shape[0])

    def layout_hash(self) -> str:
        """Canonical hash of the wall grid only: 16 hex digits of SHA-256 over the size and the packed walls.

        Equal wall grids give equal hashes whatever the start and goal; used to hold evaluation mazes
        out of training by layout.
        """
        digest = hashlib.sha256(f"maze2d/v1/{self.size}:".encode() + np.packbits(self.walls).tobytes())
        return digest.hexdigest()[:16]

    def is_open(self, cell: Cell) -> bool:
        """True when ``cell`` is inside the grid and not a wall."""
        r, c = cell
        return 0 <= r < self.size and 0 <= c < self.size and not self.walls[r, c]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Maze):
            return NotImplemented
        return self.start == other.start and self.goal == other.goal and np.array_equal(self.walls, other.walls)

    def __hash__(self) -> int:
        return hash((self.layout_hash(), self.start, self.goal))

    def __repr__(self) -> str:
        return f"Maze(size={self.size}, start={self.start}, goal={self.goal}, layout={self.layout_hash()})"

    def __reduce__(self) -> tuple[type[Maze], tuple[np.ndarray, Cell, Cell]]:
        # Rebuild through the constructor so that a pickled copy (Ray, deepcopy) is validated and read-only too.
        return (Maze, (self.walls, self.start, self.goal))

    @classmethod
    def from_ascii(cls, text: str) -> Maze:
        """Parse the map drawn by :func:`render_ascii` with the agent on the start.

        Characters: ``#`` wall, ``.`` path, ``A`` start (path), ``G`` goal (path); one row per line;
        surrounding blank lines and spaces are ignored.

        Raises:
            ValueError: ragged rows, unknown characters, not exactly one ``A`` and one ``G``, or any
                :class:`Maze` check.
        """
        rows = [line.strip() for line in text.strip().splitlines()]
        if not rows or any(len(row) != len(rows[0]) for row in rows):
            raise ValueError("maze rows must all have the same length")
        bad = set("".join(rows)) - set("#.AG")
        if bad:
            raise ValueError(f"unknown maze characters {sorted(bad)!r}; use # . A G")
        found = {ch: [(r, c) for r, row in enumerate(rows) for c, x in enumerate(row) if x == ch] for ch in "AG"}
        for ch in "AG":
            if len(found[ch]) != 1:
                raise ValueError(f"expected exactly one {ch!r}, found {len(found[ch])}")
        walls = np.array([[ch == "#" for ch in row] for row in rows], dtype=bool)
        return cls(walls=walls, start=found["A"][0], goal=found["G"][0])


# ---------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------


def _room_neighbors(n: int) -> list[list[int]]:
    out: list[list[int]] = []
    for k in range(n * n):
        r, c = divmod(k, n)
        nb = [k + 1 if c + 1 < n else -1, k - n if r > 0 else -1, k - 1 if c > 0 else -1, k + n if r + 1 < n else -1]
        out.append([x for x in nb if x >= 0])
    return out


def generate_maze(size: int, rng: np.random.Generator) -> Maze:
    """Generate a perfect maze with Wilson's algorithm (pure: the result depends only on ``size`` and ``rng``).

    The room grid has ``(size - 1) // 2`` rooms per side at odd (row, col). Wilson's loop-erased random
    walk (Wilson 1996) joins every room to a growing tree; the walls between consecutive rooms of each
    erased walk are opened, so the open cells form a uniformly random spanning tree of the room grid:
    connected, without cycles. Start and goal are then one of VisGym's four opposite-corner pairs.

    Args:
        size: side in cells, walls included; odd and >= 5.
        rng: NumPy generator; it is advanced (the same state gives the same maze).

    Returns:
        A :class:`Maze` of shape ``[size, size]``.

    Raises:
        ValueError: ``size`` even, below 5 or not an int.
    """
    size = _check_size(size)
    n = (size - 1) // 2
    rooms = n * n
    neighbors = _room_neighbors(n)
    walls = np.ones((size, size), dtype=bool)
    walls[1::2, 1::2] = False

    in_tree = [False] * rooms
    in_tree[int(rng.integers(rooms))] = True
    order = rng.permutation(rooms).tolist()
    nxt = [-1] * rooms
    uniforms: list[float] = []  # drawn in chunks: one Generator call per step would dominate the cost

    for first in order:
        room = first
        while not in_tree[room]:  # random walk until the tree is hit; nxt keeps the last exit = loop erasure
            if not uniforms:
                uniforms = rng.random(256).tolist()[::-1]
            nb = neighbors[room]
            nxt[room] = nb[int(uniforms.pop() * len(nb))]
            room = nxt[room]
        room = first
        while not in_tree[room]:  # add the loop-erased path to the tree, opening the walls along it
            in_tree[room] = True
            (r1, c1), (r2, c2) = divmod(room, n), divmod(nxt[room], n)
            walls[r1 + r2 + 1, c1 + c2 + 1] = False  # the wall between rooms (2r1+1, 2c1+1) and (2r2+1, 2c2+1)
            room = nxt[room]

    corners = corner_pairs(size)
    start, goal = corners[int(rng.integers(len(corners)))]
    return Maze(walls=walls, start=start, goal=goal)


def corner_pairs(size: int) -> tuple[tuple[Cell, Cell], ...]:
    """VisGym's four opposite-corner ``(start, goal)`` pairs of a maze of side ``size`` (interior corners: row and
    column 1 or ``size - 2``): top-left -> bottom-right, its reverse, bottom-left -> top-right, its reverse. The
    order :func:`generate_maze` draws from."""
    lo, hi = 1, int(size) - 2
    return (((lo, lo), (hi, hi)), ((hi, hi), (lo, lo)), ((hi, lo), (lo, hi)), ((lo, hi), (hi, lo)))


def maze_from_seed(size: int, seed: int) -> Maze:
    """``generate_maze(size, np.random.default_rng(seed))``: the maze ``Maze2DEnv.reset(seed=seed)`` builds.

    Raises:
        ValueError: see :func:`generate_maze`.
    """
    return generate_maze(size, np.random.default_rng(seed))


def _det_bareiss(matrix: list[list[int]]) -> int:
    """Exact integer determinant by fraction-free Gaussian elimination (Bareiss 1968), O(n^3) big-int ops."""
    m = [row[:] for row in matrix]
    n = len(m)
    sign, prev = 1, 1
    for k in range(n - 1):
        if m[k][k] == 0:
            swap = next((i for i in range(k + 1, n) if m[i][k] != 0), None)
            if swap is None:
                return 0
            m[k], m[swap] = m[swap], m[k]
            sign = -sign
        pivot, row_k = m[k][k], m[k]
        for i in range(k + 1, n):
            row_i, factor = m[i], m[i][k]
            for j in range(k + 1, n):
                row_i[j] = (row_i[j] * pivot - factor * row_k[j]) // prev
        prev = pivot
    return sign * m[n - 1][n - 1]


@lru_cache(maxsize=None)
def count_layouts(size: int) -> int:
    """Number of distinct perfect mazes of ``size``: spanning trees of the ``n x n`` room grid graph.

    Kirchhoff's matrix-tree theorem: the count equals any cofactor of the graph Laplacian; computed
    exactly with :func:`_det_bareiss`. Known values (OEIS A007341): size 5 -> 4, 7 -> 192, 9 -> 100352,
    11 -> 557568000. The cost grows like ``n**6`` big-integer operations for ``n`` rooms per side (measured on
    the 2-core CI machine: 0.05 s at size 21, 1 s at size 31, 4.5 s at size 41); results are cached.

    Raises:
        ValueError: see :func:`generate_maze`.
    """
    n = (_check_size(size) - 1) // 2
    neighbors = _room_neighbors(n)
    laplacian = [[0] * (n * n) for _ in range(n * n)]
    for k, nb in enumerate(neighbors):
        laplacian[k][k] = len(nb)
        for j in nb:
            laplacian[k][j] = -1
    minor = [row[:-1] for row in laplacian[:-1]]
    return _det_bareiss(minor)


# ---------------------------------------------------------------------------------------------------
# Shortest paths
# ---------------------------------------------------------------------------------------------------


def _bfs(maze: Maze, source: Cell) -> tuple[np.ndarray, dict[Cell, tuple[Cell, str]]]:
    dist = np.full(maze.walls.shape, -1, dtype=np.int64)
    parent: dict[Cell, tuple[Cell, str]] = {}
    dist[source] = 0
    queue = deque([source])
    walls = maze.walls
    while queue:
        r, c = queue.popleft()
        d = dist[r, c] + 1
        for name in DIRECTIONS:
            dr, dc = DELTAS[name]
            nr, nc = r + dr, c + dc
            if not walls[nr, nc] and dist[nr, nc] < 0:  # the outer ring is wall, so no bounds check is needed
                dist[nr, nc] = d
                parent[(nr, nc)] = ((r, c), name)
                queue.append((nr, nc))
    return dist, parent


def _open_cell(maze: Maze, cell: object, name: str) -> Cell:
    cell = _cell(cell, name)
    if not maze.is_open(cell):
        raise ValueError(f"{name} {cell} is a wall or outside the maze")
    return cell


def distance_map(maze: Maze, target: Cell | None = None) -> np.ndarray:
    """Breadth-first distances in moves from every cell to ``target`` (default: the goal).

    Returns:
        int64 array ``[size, size]``; -1 for walls and cells that cannot reach ``target``.

    Raises:
        ValueError: ``target`` is a wall or outside the grid.
    """
    target = maze.goal if target is None else _open_cell(maze, target, "target")
    return _bfs(maze, target)[0]


def solve(maze: Maze, start: Cell | None = None) -> list[str]:
    """Shortest sequence of moves from ``start`` (default ``maze.start``) to the goal, by breadth-first search.

    Returns:
        Directions (``"right"``, ``"up"``, ``"left"``, ``"down"``); empty when ``start`` is the goal. The
        final ``"stop"`` is not included. In a perfect maze the shortest path is the only simple path.

    Raises:
        ValueError: ``start`` is a wall or outside the grid, or the goal cannot be reached.
    """
    start = maze.start if start is None else _open_cell(maze, start, "start")
    dist, parent = _bfs(maze, start)
    if dist[maze.goal] < 0:
        raise ValueError(f"the goal {maze.goal} cannot be reached from {start}")
    moves: list[str] = []
    cell = maze.goal
    while cell != start:
        cell, move = parent[cell]
        moves.append(move)
    return moves[::-1]


# ---------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------


@lru_cache(maxsize=32)
def _disc_mask(cell_px: int) -> np.ndarray:
    centres = np.arange(cell_px) + 0.5  # pixel centres
    half, radius = cell_px / 2, cell_px / 4
    mask = (centres[:, None] - half) ** 2 + (centres[None, :] - half) ** 2 <= radius**2
    mask.setflags(write=False)
    return mask


def _check_cell_px(cell_px: object) -> int:
    if isinstance(cell_px, bool) or not isinstance(cell_px, (int, np.integer)) or cell_px < MIN_CELL_PX:
        raise ValueError(f"cell_px must be an int >= {MIN_CELL_PX}, got {cell_px!r}")
    return int(cell_px)


def render_rgb(maze: Maze, agent: Cell, cell_px: int = 25) -> np.ndarray:
    """Draw the maze as VisGym does: gray walls, white paths, red goal square, blue agent disc.

    Args:
        maze: the maze.
        agent: (row, col) of the agent; must be an open cell.
        cell_px: pixels per cell side (VisGym: 25; 16 puts one ViT patch on each cell).

    Returns:
        uint8 array ``[size * cell_px, size * cell_px, 3]`` (RGB, row 0 at the top), a new array each call.
        Cell (r, c) covers pixel rows ``r*cell_px .. (r+1)*cell_px - 1``. The agent is a disc of radius
        ``cell_px / 4`` centred in its cell (pixels whose centre lies within the radius), drawn over the goal.

    Raises:
        ValueError: ``cell_px`` below 4, or ``agent`` on a wall or outside the grid.
    """
    cell_px = _check_cell_px(cell_px)
    ar, ac = _open_cell(maze, agent, "agent")
    cells = np.empty((maze.size, maze.size, 3), dtype=np.uint8)
    cells[maze.walls] = WALL_RGB
    cells[~maze.walls] = PATH_RGB
    cells[maze.goal] = GOAL_RGB
    image = np.repeat(np.repeat(cells, cell_px, axis=0), cell_px, axis=1)
    block = image[ar * cell_px : (ar + 1) * cell_px, ac * cell_px : (ac + 1) * cell_px]
    block[_disc_mask(cell_px)] = AGENT_RGB
    return image


def render_ascii(maze: Maze, agent: Cell) -> str:
    """Text map: ``#`` wall, ``.`` path, ``A`` agent, ``G`` goal; one row per line, no trailing newline.

    As in VisGym's ANSI map, the agent hides the goal when it stands on it (the map then has no ``G``).

    Raises:
        ValueError: ``agent`` on a wall or outside the grid.
    """
    agent = _open_cell(maze, agent, "agent")
    rows = [["#" if w else "." for w in row] for row in maze.walls.tolist()]
    rows[maze.goal[0]][maze.goal[1]] = "G"
    rows[agent[0]][agent[1]] = "A"
    return "\n".join("".join(row) for row in rows)


# ---------------------------------------------------------------------------------------------------
# Prompt
# ---------------------------------------------------------------------------------------------------


def _check_choice(value: object, choices: Sequence[str], name: str) -> str:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(choices)}")
    return str(value)


def instructions(
    action_format: str, success_on: str, observation: str = "image", max_turns: int | None = None
) -> str:
    """The task prompt shown to the model: what it sees, the exact action syntax, when the episode ends.

    Kept short for the tiny model's context. The action examples are produced by
    :func:`~daedalus_trainer.envs.actions.format_action`, so the prompt and the parser cannot disagree.

    Args:
        action_format: ``"function"``, ``"tuple"`` or ``"tag"``.
        success_on: ``"stop-on-goal"`` or ``"arrival"``.
        observation: ``"image"``, ``"ascii"`` or ``"image+ascii"``.
        max_turns: when given, the prompt states the turn limit.

    Raises:
        ValueError: unknown format, rule or observation, or ``max_turns`` < 1.
    """
    _check_choice(action_format, ACTION_FORMATS, "action format")
    _check_choice(success_on, SUCCESS_ON, "success rule")
    _check_choice(observation, OBSERVATIONS, "observation")
    parts = ["You are in a maze and must reach the goal."]
    if "image" in observation:
        parts.append("In the picture gray cells are walls, white cells are paths, you are the blue circle "
                     "and the goal is the red square.")
    if "ascii" in observation:
        parts.append("In the map # is a wall, . is a path, A is you and G is the goal (A hides G when you "
                     "are on it).")
    if action_format == "tuple":
        moves = ", ".join(f"{format_action(d, action_format)} {d}" for d in DIRECTIONS)
    else:
        moves = ", ".join(format_action(d, action_format) for d in ("up", "down", "left", "right"))
    stop = format_action(STOP, action_format)
    parts.append(f"Each turn reply with one action: {moves}, or {stop}. A move goes one cell (up is toward the "
                 "top); moving into a wall does nothing.")
    if success_on == "stop-on-goal":
        parts.append(f"When you are on the goal, reply {stop}. You succeed only if you stop on the goal; "
                     "stopping anywhere else ends the episode as a failure.")
    else:
        parts.append(f"You succeed as soon as you reach the goal. {stop} ends the episode as a failure.")
    if max_turns is not None:
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be a positive int, got {max_turns!r}")
        parts.append(f"You have at most {max_turns} turns.")
    parts.append("If a reply holds several actions, only the last one counts.")
    return " ".join(parts)


# ---------------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------------


class Maze2DEnv(gymnasium.Env):
    """VisGym-style Maze2D with text actions written by a model.

    ## Description
    Navigate from the start to the goal of a perfect maze (:func:`generate_maze`). A new maze is
    generated from the environment's seeded generator at every :meth:`reset`, or given through
    ``reset(options={"maze": maze})``. ``reset(seed=s)`` builds ``maze_from_seed(size, s)``.

    ## Action space
    A model's reply (``str``), read by :func:`~daedalus_trainer.envs.actions.parse_action` in
    ``action_format``; the last complete action in the reply counts. ``action_space`` is a
    :class:`gymnasium.spaces.Text` over printable ASCII so that ``sample()`` yields replies, but any string
    (any object, even) is accepted by :meth:`step`.

    ## Observation space
    ``Dict(image=Box(0, 255, [size*cell_px, size*cell_px, 3], uint8), ascii=Text, feedback=Text)``:
    the picture (:func:`render_rgb`), the map (:func:`render_ascii`) and a short feedback line about the
    last turn ("" after reset).

    ## Rewards
    1.0 on the turn that succeeds, 0.0 on every other turn (no shaping, no format bonus).

    ## Episode end
    * ``success_on="stop-on-goal"`` (VisGym): ``stop`` terminates the episode; it succeeds when the agent
      is on the goal. Stop elsewhere terminates with reward 0 (as VisGym, whose reward is 1 only when
      stopping on the target). Walking onto the goal does not end the episode.
    * ``success_on="arrival"``: entering the goal succeeds and terminates. ``stop`` terminates with
      reward 0 (the agent cannot be on the goal then: arriving already ended the episode).
    * Truncation when ``turn == max_turns`` without termination. ``max_turns=0`` means automatic:
      twice the optimal number of actions (``len(solve(maze)) + 1`` with stop-on-goal, ``len(solve)``
      with arrival), decided per maze at reset.
    * Every turn counts, including replies that cannot be parsed and wall bumps.
    * Calling :meth:`step` after the episode ended, or before :meth:`reset`, raises ``RuntimeError``.

    ## Feedback
    ``"Moved up."``; ``"Hit a wall moving up; you did not move."`` (the direction is named, so a policy that
    sees only the current observation can tell which move failed); ``"Invalid action: <reason>. Use <syntax>."``;
    ``"Stopped on the goal."``; ``"Stopped, but not on the goal."``; ``"Moved down and reached the goal."``
    (arrival). None of them quotes the model's text.

    ## Info
    ``turn`` (int, turns taken), ``distance_to_goal`` (BFS moves from the agent), ``optimal_path_length``
    (BFS moves from the start), ``success``, ``parse_error``, ``wall_bump`` (bools of this turn),
    ``action`` (the parsed action or None), ``layout_hash``, ``max_turns``, ``agent`` and ``goal``
    ((row, col) tuples).

    ## Arguments
    ``size`` (odd, >= 5, walls included), ``max_turns`` (0 = automatic), ``action_format`` (``function``,
    ``tuple``, ``tag``), ``success_on`` (``stop-on-goal``, ``arrival``), ``cell_px`` (>= 4),
    ``render_mode`` (``rgb_array`` or ``ansi``; what :meth:`render` returns).

    Raises:
        ValueError: any invalid argument.
    """

    metadata = {"render_modes": ["rgb_array", "ansi"], "render_fps": 4}

    def __init__(
        self,
        size: int = 9,
        max_turns: int = 0,
        action_format: str = "function",
        success_on: str = "stop-on-goal",
        cell_px: int = 25,
        render_mode: str | None = "rgb_array",
    ) -> None:
        self.size = _check_size(size)
        if isinstance(max_turns, bool) or not isinstance(max_turns, (int, np.integer)) or max_turns < 0:
            raise ValueError(f"max_turns must be an int >= 0 (0 = automatic), got {max_turns!r}")
        self.max_turns_setting = int(max_turns)
        self.action_format = _check_choice(action_format, ACTION_FORMATS, "action format")
        self.success_on = _check_choice(success_on, SUCCESS_ON, "success rule")
        self.cell_px = _check_cell_px(cell_px)
        if render_mode is not None:
            _check_choice(render_mode, self.metadata["render_modes"], "render mode")
        self.render_mode = render_mode

        px = self.size * self.cell_px
        map_len = self.size * self.size + self.size - 1
        self.observation_space = spaces.Dict(
            {
                "image": spaces.Box(0, 255, shape=(px, px, 3), dtype=np.uint8),
                "ascii": spaces.Text(min_length=map_len, max_length=map_len, charset="#.AG\n"),
                "feedback": spaces.Text(min_length=0, max_length=_FEEDBACK_MAX, charset=_FEEDBACK_CHARSET),
            }
        )
        self.action_space = spaces.Text(min_length=1, max_length=64, charset=_FEEDBACK_CHARSET)

        self.maze: Maze | None = None
        self.agent: Cell | None = None
        self.turn = 0
        self.max_turns = 0
        self.optimal_path_length = 0
        self._dist: np.ndarray | None = None
        self._done = True

    # -- gymnasium API -----------------------------------------------------------------------------

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Start an episode on a new maze (or ``options["maze"]``).

        Raises:
            ValueError: ``options["maze"]`` is not a :class:`Maze` of this environment's size, ``options`` has
                unknown keys, or the maze's goal cannot be reached from its start while ``max_turns`` is automatic
                (0: twice the optimal number of actions, which such a maze does not have). With an explicit
                ``max_turns`` such a maze is played (it cannot be solved).
        """
        super().reset(seed=seed)
        options = dict(options or {})
        maze = options.pop("maze", None)
        if options:
            raise ValueError(f"unknown reset options {sorted(options)}; only 'maze' is supported")
        if maze is None:
            maze = generate_maze(self.size, self.np_random)
        elif not isinstance(maze, Maze) or maze.size != self.size:
            raise ValueError(f"options['maze'] must be a Maze of size {self.size}, got {maze!r}")
        dist = distance_map(maze)
        if dist[maze.start] < 0 and not self.max_turns_setting:
            raise ValueError(f"the goal {maze.goal} cannot be reached from the start {maze.start}: the automatic turn "
                             "limit (max_turns=0, twice the optimal number of actions) is undefined; give max_turns")
        self.maze = maze
        self.agent = maze.start
        self.turn = 0
        self._dist = dist
        self.optimal_path_length = int(self._dist[maze.start])
        optimal_actions = self.optimal_path_length + (1 if self.success_on == "stop-on-goal" else 0)
        self.max_turns = self.max_turns_setting or 2 * optimal_actions
        self._done = False
        return self._obs(""), self._info(action=None, success=False, parse_error=False, wall_bump=False)

    def step(self, action_text: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """Apply one reply. See the class docstring for rewards, termination and feedback.

        Raises:
            RuntimeError: before :meth:`reset` or after the episode ended.
        """
        if self.maze is None or self.agent is None:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("the episode is over; call reset()")
        self.turn += 1
        parsed = parse_action(action_text, self.action_format)
        terminated = success = wall_bump = False
        if parsed.action is None:
            feedback = f"Invalid action: {parsed.error}. Use {syntax_hint(self.action_format)}."
        elif parsed.action == STOP:
            terminated = True
            success = self.success_on == "stop-on-goal" and self.agent == self.maze.goal
            feedback = "Stopped on the goal." if self.agent == self.maze.goal else "Stopped, but not on the goal."
        else:
            dr, dc = DELTAS[parsed.action]
            target = (self.agent[0] + dr, self.agent[1] + dc)
            if self.maze.walls[target]:
                wall_bump = True
                feedback = f"Hit a wall moving {parsed.action}; you did not move."
            else:
                self.agent = target
                feedback = f"Moved {parsed.action}."
                if self.success_on == "arrival" and target == self.maze.goal:
                    terminated = success = True
                    feedback = f"Moved {parsed.action} and reached the goal."
        truncated = not terminated and self.turn >= self.max_turns
        self._done = terminated or truncated
        info = self._info(action=parsed.action, success=success, parse_error=parsed.action is None,
                          wall_bump=wall_bump)
        return self._obs(feedback), 1.0 if success else 0.0, terminated, truncated, info

    def render(self) -> np.ndarray | str | None:
        """The current frame: for ``rgb_array`` a uint8 RGB array ``[size * cell_px, size * cell_px, 3]``
        (:func:`render_rgb`), for ``ansi`` the text map (:func:`render_ascii`), None without a mode.

        Raises:
            RuntimeError: before :meth:`reset`.
        """
        if self.maze is None or self.agent is None:
            raise RuntimeError("call reset() before render()")
        if self.render_mode == "rgb_array":
            return render_rgb(self.maze, self.agent, self.cell_px)
        if self.render_mode == "ansi":
            return render_ascii(self.maze, self.agent)
        return None

    # -- helpers -----------------------------------------------------------------------------------

    def solution(self) -> list[str]:
        """Shortest moves from the agent's current cell to the goal (:func:`solve`).

        Raises:
            RuntimeError: before :meth:`reset`.
        """
        if self.maze is None or self.agent is None:
            raise RuntimeError("call reset() before solution()")
        return solve(self.maze, self.agent)

    def _obs(self, feedback: str) -> dict[str, Any]:
        assert self.maze is not None and self.agent is not None
        return {
            "image": render_rgb(self.maze, self.agent, self.cell_px),
            "ascii": render_ascii(self.maze, self.agent),
            "feedback": feedback,
        }

    def _info(self, *, action: str | None, success: bool, parse_error: bool, wall_bump: bool) -> dict[str, Any]:
        assert self.maze is not None and self.agent is not None and self._dist is not None
        return {
            "turn": self.turn,
            "distance_to_goal": int(self._dist[self.agent]),
            "optimal_path_length": self.optimal_path_length,
            "success": success,
            "parse_error": parse_error,
            "wall_bump": wall_bump,
            "action": action,
            "layout_hash": self.maze.layout_hash(),
            "max_turns": self.max_turns,
            "agent": self.agent,
            "goal": self.maze.goal,
        }
