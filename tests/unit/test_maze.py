"""Tests for the Maze2D environment (daedalus_trainer.envs.maze) and the `daedalus maze` command.

Graph facts are checked with small independent helpers written here (breadth-first search over the
grid, edge counting, brute-force spanning-tree enumeration), never with the module's own solver.
"""

from __future__ import annotations

import itertools
import math
import pickle
import warnings
from collections import Counter, deque
from copy import deepcopy

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image

from daedalus_trainer.envs import ENV_ID, maze_cli
from daedalus_trainer.envs.actions import ACTION_FORMATS, DIRECTIONS, format_action, parse_action
from daedalus_trainer.envs.maze import (
    AGENT_RGB,
    GOAL_RGB,
    OBSERVATIONS,
    PATH_RGB,
    SUCCESS_ON,
    WALL_RGB,
    Maze,
    Maze2DEnv,
    count_layouts,
    distance_map,
    generate_maze,
    instructions,
    maze_from_seed,
    render_ascii,
    render_rgb,
    solve,
)

PROPERTY = settings(max_examples=500, deadline=None)
sizes = st.sampled_from([5, 7, 9, 11, 13, 15, 21])
seeds = st.integers(min_value=0, max_value=2**63 - 1)
STEP = {"right": (0, 1), "up": (-1, 0), "left": (0, -1), "down": (1, 0)}

# A hand-made 7x7 perfect maze:
#   start (1,1) -> right, right, down, down, left, left, down, down, right x4 -> goal (5,5)
HAND = """
#######
#A..#.#
###.#.#
#...#.#
#.###.#
#....G#
#######
"""


def _open_cells(walls: np.ndarray) -> list[tuple[int, int]]:
    return [(int(r), int(c)) for r, c in zip(*np.nonzero(~walls))]


def _grid_bfs(walls: np.ndarray, source: tuple[int, int]) -> dict[tuple[int, int], int]:
    """Independent BFS: distances (in moves) from ``source`` to every reachable open cell."""
    h, w = walls.shape
    dist = {source: 0}
    queue = deque([source])
    while queue:
        r, c = queue.popleft()
        for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            nr, nc = r + dr, c + dc
            if 0 <= nr < h and 0 <= nc < w and not walls[nr, nc] and (nr, nc) not in dist:
                dist[(nr, nc)] = dist[(r, c)] + 1
                queue.append((nr, nc))
    return dist


def _adjacent_open_pairs(walls: np.ndarray) -> int:
    open_ = ~walls
    return int((open_[1:, :] & open_[:-1, :]).sum() + (open_[:, 1:] & open_[:, :-1]).sum())


def _walk(start: tuple[int, int], moves: list[str]) -> list[tuple[int, int]]:
    cells = [start]
    for m in moves:
        cells.append((cells[-1][0] + STEP[m][0], cells[-1][1] + STEP[m][1]))
    return cells


# ---------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------


@PROPERTY
@given(size=sizes, seed=seeds)
def test_every_generated_maze_is_perfect(size: int, seed: int) -> None:
    maze = generate_maze(size, np.random.default_rng(seed))
    walls = maze.walls
    assert walls.shape == (size, size) and walls.dtype == bool and maze.size == size
    assert walls[0].all() and walls[-1].all() and walls[:, 0].all() and walls[:, -1].all()
    assert not walls[1::2, 1::2].any()  # every room is open
    assert walls[::2, ::2].all()  # cells between four rooms are always wall
    cells = _open_cells(walls)
    reach = _grid_bfs(walls, cells[0])
    assert len(reach) == len(cells)  # connected
    assert _adjacent_open_pairs(walls) == len(cells) - 1  # a connected graph with V-1 edges has no cycle
    lo, hi = 1, size - 2
    assert {maze.start, maze.goal} in ({(lo, lo), (hi, hi)}, {(lo, hi), (hi, lo)})  # opposite corners


def test_start_goal_corner_pairs_are_all_used_about_equally() -> None:
    rng = np.random.default_rng(7)
    counts = Counter((m.start, m.goal) for m in (generate_maze(5, rng) for _ in range(2000)))
    assert set(counts) == {((1, 1), (3, 3)), ((3, 3), (1, 1)), ((3, 1), (1, 3)), ((1, 3), (3, 1))}
    assert min(counts.values()) > 400  # expected 500 each


def _spanning_trees_brute_force(n: int) -> int:
    """Count spanning trees of the n x n grid graph by trying every (V-1)-edge subset (tiny n only)."""
    nodes = n * n
    edges = [(k, k + 1) for k in range(nodes) if (k + 1) % n] + [(k, k + n) for k in range(nodes - n)]
    total = 0
    for subset in itertools.combinations(edges, nodes - 1):
        parent = list(range(nodes))

        def find(x: int) -> int:
            while parent[x] != x:
                x = parent[x]
            return x

        ok = True
        for a, b in subset:
            ra, rb = find(a), find(b)
            if ra == rb:
                ok = False
                break
            parent[ra] = rb
        total += ok
    return total


def test_count_layouts_matches_brute_force_and_known_values() -> None:
    assert count_layouts(5) == _spanning_trees_brute_force(2) == 4
    assert count_layouts(7) == _spanning_trees_brute_force(3) == 192
    # OEIS A007341 (spanning trees of the n x n grid graph), n = 4, 5, 6
    assert count_layouts(9) == 100352
    assert count_layouts(11) == 557568000
    assert count_layouts(13) == 32565539635200
    with pytest.raises(ValueError, match="odd"):
        count_layouts(8)


def test_generator_reaches_every_layout_uniformly() -> None:
    """Wilson's algorithm samples spanning trees uniformly: all 192 size-7 layouts appear, none favoured."""
    rng = np.random.default_rng(11)
    samples = 192 * 50
    counts = Counter(generate_maze(7, rng).layout_hash() for _ in range(samples))
    assert len(counts) == count_layouts(7)
    expected = samples / 192
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    # Wilson-Hilferty upper 1e-4 quantile of chi-square with k = 191 degrees of freedom (z = 3.719)
    k = 191
    critical = k * (1 - 2 / (9 * k) + 3.719 * math.sqrt(2 / (9 * k))) ** 3
    assert chi2 < critical, (chi2, critical)


@pytest.mark.parametrize("bad", [4, 6, 3, 1, 0, -5, 9.0, "9", True, None])
def test_generate_rejects_bad_sizes(bad: object) -> None:
    with pytest.raises(ValueError, match="maze size"):
        generate_maze(bad, np.random.default_rng(0))  # type: ignore[arg-type]


@PROPERTY
@given(size=sizes, seed=seeds)
def test_same_seed_gives_identical_maze_and_image(size: int, seed: int) -> None:
    a = generate_maze(size, np.random.default_rng(seed))
    b = maze_from_seed(size, seed)
    assert a == b and a.layout_hash() == b.layout_hash() and hash(a) == hash(b)
    assert np.array_equal(render_rgb(a, a.start, 8), render_rgb(b, b.start, 8))
    assert render_ascii(a, a.start) == render_ascii(b, b.start)


def test_env_reset_seed_builds_maze_from_seed() -> None:
    env = Maze2DEnv(size=9, cell_px=4)
    for seed in (0, 3, 12345):
        obs, info = env.reset(seed=seed)
        maze = maze_from_seed(9, seed)
        assert env.maze == maze and info["layout_hash"] == maze.layout_hash()
        assert obs["ascii"] == render_ascii(maze, maze.start)
        assert np.array_equal(obs["image"], render_rgb(maze, maze.start, 4))
    # different seeds give different mazes (the generator is really seeded)
    assert len({maze_from_seed(9, s).layout_hash() for s in range(50)}) > 45


# ---------------------------------------------------------------------------------------------------
# Maze value
# ---------------------------------------------------------------------------------------------------


def test_maze_from_ascii_round_trip_and_hash() -> None:
    maze = Maze.from_ascii(HAND)
    assert maze.size == 7 and maze.start == (1, 1) and maze.goal == (5, 5)
    assert render_ascii(maze, maze.start) == HAND.strip()
    moved = Maze(walls=maze.walls, start=(5, 5), goal=(1, 1))
    assert moved.layout_hash() == maze.layout_hash() and moved != maze
    other = maze.walls.copy()
    other[1, 2] = True
    other[2, 3] = True
    assert Maze(walls=other, start=(1, 1), goal=(5, 5)).layout_hash() != maze.layout_hash()
    assert len(maze.layout_hash()) == 16 and int(maze.layout_hash(), 16) >= 0
    with pytest.raises(ValueError, match="read-only"):
        maze.walls[1, 1] = True
    for copy in (pickle.loads(pickle.dumps(maze)), deepcopy(maze)):  # Ray ships mazes between actors
        assert copy == maze and copy.layout_hash() == maze.layout_hash() and not copy.walls.flags.writeable


@pytest.mark.parametrize(
    ("walls", "start", "goal", "message"),
    [
        (np.ones((7, 5), bool), (1, 1), (3, 3), "square"),
        (np.ones((6, 6), bool), (1, 1), (3, 3), "odd"),
        (np.full((7, 7), 2), (1, 1), (3, 3), "0 and 1"),
        (np.zeros((7, 7), bool), (1, 1), (3, 3), "outer ring"),
        (Maze.from_ascii(HAND).walls, (0, 0), (5, 5), "on a wall"),
        (Maze.from_ascii(HAND).walls, (1, 1), (9, 9), "outside"),
        (Maze.from_ascii(HAND).walls, (1, 1), (1, 1), "differ"),
        (Maze.from_ascii(HAND).walls, (1.0, 1), (5, 5), "integers"),
        (Maze.from_ascii(HAND).walls, 11, (5, 5), "pair"),
    ],
)
def test_maze_validation(walls: np.ndarray, start: object, goal: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Maze(walls=walls, start=start, goal=goal)  # type: ignore[arg-type]


def test_from_ascii_errors() -> None:
    with pytest.raises(ValueError, match="same length"):
        Maze.from_ascii("#####\n#A.G#\n###")
    with pytest.raises(ValueError, match="unknown maze characters"):
        Maze.from_ascii(HAND.replace("A", "S"))
    with pytest.raises(ValueError, match="exactly one 'G'"):
        Maze.from_ascii(HAND.replace("G", "."))


# ---------------------------------------------------------------------------------------------------
# Solver
# ---------------------------------------------------------------------------------------------------


@PROPERTY
@given(size=sizes, seed=seeds, pick=st.integers(min_value=0), holes=st.lists(st.integers(min_value=0), max_size=8))
# Found by hypothesis: knocking out a pillar (a wall cell at even row and column, walls all round) made an open cell
# that no path reaches; holes now go only into walls between two rooms.
@example(size=21, seed=8860677, pick=599498, holes=[0, 26, 27, 22_301_107_682_208])
def test_solver_paths_are_shortest_from_any_open_cell(size: int, seed: int, pick: int, holes: list[int]) -> None:
    maze = maze_from_seed(size, seed)
    # In a perfect maze every simple path is the shortest one, so also knock holes in inner walls: the loops
    # this makes give a wrong search (depth-first, say) a chance to return a longer path. Rooms sit at odd (row,
    # column); the walls between two rooms are the inner wall cells with exactly one odd coordinate.
    walls = maze.walls.copy()
    inner = [(r, c) for r, c in _open_cells(~walls) if 0 < r < size - 1 and 0 < c < size - 1 and (r + c) % 2 == 1]
    for h in holes:
        walls[inner[h % len(inner)]] = False
    maze = Maze(walls=walls, start=maze.start, goal=maze.goal)
    cells = _open_cells(maze.walls)
    start = cells[pick % len(cells)]
    moves = solve(maze, start)
    path = _walk(start, moves)
    assert all(not maze.walls[cell] for cell in path)  # never through a wall
    assert path[-1] == maze.goal
    from_goal = _grid_bfs(maze.walls, maze.goal)
    assert len(moves) == from_goal[start]  # as short as an independent BFS says
    assert distance_map(maze)[start] == from_goal[start]
    assert len(solve(maze)) == from_goal[maze.start]


def test_solver_on_hand_made_maze() -> None:
    maze = Maze.from_ascii(HAND)
    assert solve(maze) == ["right", "right", "down", "down", "left", "left", "down", "down",
                           "right", "right", "right", "right"]
    assert solve(maze, maze.goal) == []
    dist = distance_map(maze)
    assert dist[0, 0] == -1 and dist[maze.goal] == 0 and dist[maze.start] == 12 and dist[1, 5] == 4
    with pytest.raises(ValueError, match="wall"):
        solve(maze, (0, 0))
    walled = maze.walls.copy()
    walled[4, 1] = True  # cuts the only path
    with pytest.raises(ValueError, match="cannot be reached"):
        solve(Maze(walls=walled, start=(1, 1), goal=(5, 5)))


@PROPERTY
@given(size=st.sampled_from([5, 7, 9, 11, 13]), seed=seeds, fmt=st.sampled_from(ACTION_FORMATS),
       rule=st.sampled_from(SUCCESS_ON))
def test_replaying_the_solution_through_step_succeeds(size: int, seed: int, fmt: str, rule: str) -> None:
    env = Maze2DEnv(size=size, action_format=fmt, success_on=rule, cell_px=4)
    obs, info = env.reset(seed=seed)
    moves = solve(env.maze)
    assert info["optimal_path_length"] == info["distance_to_goal"] == len(moves)
    assert info["max_turns"] == 2 * (len(moves) + (rule == "stop-on-goal"))
    replies = [format_action(a, fmt) for a in moves + (["stop"] if rule == "stop-on-goal" else [])]
    total, done = 0.0, False
    for turn, reply in enumerate(replies, start=1):
        assert not done
        obs, reward, terminated, truncated, info = env.step(f"I choose {reply}")
        assert obs in env.observation_space
        total += reward
        done = terminated or truncated
        assert info["turn"] == turn and not info["parse_error"] and not info["wall_bump"]
        assert info["distance_to_goal"] == max(len(moves) - turn, 0)
    assert done and terminated and not truncated
    assert total == reward == 1.0 and info["success"]
    assert env.agent == env.maze.goal


# ---------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------


@PROPERTY
@given(size=sizes, seed=seeds, pick=st.integers(min_value=0), cell_px=st.integers(min_value=4, max_value=32))
def test_pixel_colours_at_cell_centres(size: int, seed: int, pick: int, cell_px: int) -> None:
    maze = maze_from_seed(size, seed)
    cells = _open_cells(maze.walls)
    agent = cells[pick % len(cells)]
    image = render_rgb(maze, agent, cell_px)
    assert image.shape == (size * cell_px, size * cell_px, 3) and image.dtype == np.uint8
    centres = image[cell_px // 2 :: cell_px, cell_px // 2 :: cell_px]  # [size, size, 3]
    expected = np.where(maze.walls[..., None], WALL_RGB, PATH_RGB)
    expected[maze.goal] = GOAL_RGB
    expected[agent] = AGENT_RGB
    assert np.array_equal(centres, expected)
    # the disc stays inside its cell: the agent cell's corner keeps the floor (or goal) colour
    corner = image[agent[0] * cell_px, agent[1] * cell_px]
    assert tuple(corner) == (GOAL_RGB if agent == maze.goal else PATH_RGB)
    # only the agent's disc is blue, and it has about pi * (cell_px / 4)^2 pixels
    blue = np.all(image == AGENT_RGB, axis=-1)
    rows, cols = np.nonzero(blue)
    assert set(rows // cell_px) == {agent[0]} and set(cols // cell_px) == {agent[1]}
    assert abs(blue.sum() - math.pi * (cell_px / 4) ** 2) <= 2 * cell_px
    # the goal is a full red cell unless the agent stands on it
    red = np.all(image == GOAL_RGB, axis=-1).sum()
    assert red == cell_px**2 - (blue.sum() if agent == maze.goal else 0)


def test_visgym_colours_and_default_cell_size() -> None:
    assert (WALL_RGB, PATH_RGB, AGENT_RGB, GOAL_RGB) == ((169, 169, 169), (255, 255, 255), (0, 0, 255), (255, 0, 0))
    maze = Maze.from_ascii(HAND)
    assert render_rgb(maze, maze.start).shape == (175, 175, 3)
    for bad in (3, 0, 2.5, True):
        with pytest.raises(ValueError, match="cell_px"):
            render_rgb(maze, maze.start, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="agent"):
        render_rgb(maze, (0, 0))
    with pytest.raises(ValueError, match="agent"):
        render_ascii(maze, (7, 1))


def test_ascii_agent_hides_goal() -> None:
    maze = Maze.from_ascii(HAND)
    text = render_ascii(maze, maze.goal)
    assert "G" not in text and text.count("A") == 1 and text.splitlines()[5] == "#....A#"


# ---------------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------------


def _hand_env(**kwargs: object) -> Maze2DEnv:
    env = Maze2DEnv(size=7, cell_px=4, **kwargs)  # type: ignore[arg-type]
    env.reset(options={"maze": Maze.from_ascii(HAND)})
    return env


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"size": 7, "render_mode": "ansi", "success_on": "arrival", "action_format": "tag"},
     {"size": 5, "action_format": "tuple", "cell_px": 16, "max_turns": 3}],
)
def test_gymnasium_check_env_passes(kwargs: dict) -> None:
    env = gymnasium.make(ENV_ID, **kwargs)  # through make so check_env also tries the other render mode
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any checker warning fails the test
        check_env(env.unwrapped)


def test_moves_wall_bumps_and_feedback() -> None:
    env = _hand_env()
    obs, reward, terminated, truncated, info = env.step('move("up")')
    assert obs["feedback"] == "Hit a wall moving up; you did not move."
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["wall_bump"] and info["action"] == "up" and env.agent == (1, 1) and info["turn"] == 1
    assert info["distance_to_goal"] == 12
    obs, reward, terminated, truncated, info = env.step('move("right")')
    assert obs["feedback"] == "Moved right." and env.agent == (1, 2) and not info["wall_bump"]
    assert info["distance_to_goal"] == 11 and info["optimal_path_length"] == 12 and info["turn"] == 2
    assert obs["ascii"].splitlines()[1] == "#.A.#.#"
    assert tuple(obs["image"][1 * 4 + 2, 2 * 4 + 2]) == AGENT_RGB


def test_parse_failure_consumes_a_turn_with_clear_feedback() -> None:
    env = _hand_env(action_format="tuple")
    obs, reward, terminated, truncated, info = env.step("go north please")
    assert info["parse_error"] and info["action"] is None and info["turn"] == 1
    assert (reward, terminated, truncated) == (0.0, False, False) and env.agent == (1, 1)
    assert obs["feedback"] == ("Invalid action: no action found. "
                               "Use ('move', N) with N 0=right 1=up 2=left 3=down, or ('stop', 'stop').")
    obs, *_ = env.step("('Move', 0)")
    assert obs["feedback"].startswith("Invalid action: wrong letter case")
    obs, *_ = env.step(None)  # type: ignore[arg-type]
    assert obs["feedback"].startswith("Invalid action: the action must be text")
    function_env = _hand_env()
    obs, *_ = function_env.step("up")
    assert obs["feedback"] == ('Invalid action: no action found. '
                               'Use move("up"), move("down"), move("left"), move("right") or stop().')
    assert len(obs["feedback"]) <= 110


def test_stop_on_goal_rules() -> None:
    env = _hand_env()
    obs, reward, terminated, truncated, info = env.step("stop()")
    assert (reward, terminated, truncated, info["success"]) == (0.0, True, False, False)
    assert obs["feedback"] == "Stopped, but not on the goal." and info["action"] == "stop"
    with pytest.raises(RuntimeError, match="reset"):
        env.step("stop()")

    env = _hand_env()
    for move in solve(env.maze):
        obs, reward, terminated, truncated, info = env.step(format_action(move, "function"))
        assert reward == 0.0 and not terminated  # arriving is not enough under stop-on-goal
    assert env.agent == env.maze.goal and info["distance_to_goal"] == 0
    obs, reward, terminated, truncated, info = env.step("stop()")
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
    assert obs["feedback"] == "Stopped on the goal."


def test_arrival_rule() -> None:
    env = _hand_env(success_on="arrival", action_format="tag")
    assert env.max_turns == 24
    moves = solve(env.maze)
    for move in moves[:-1]:
        *_, terminated, truncated, info = env.step(format_action(move, "tag"))
        assert not terminated
    obs, reward, terminated, truncated, info = env.step("<action>right</action>")
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
    assert obs["feedback"] == "Moved right and reached the goal."

    env = _hand_env(success_on="arrival")
    obs, reward, terminated, truncated, info = env.step("stop()")
    assert (reward, terminated, info["success"]) == (0.0, True, False)


def test_max_turns_truncation_automatic_and_explicit() -> None:
    env = _hand_env()
    assert env.max_turns == 2 * (12 + 1)  # automatic: twice the optimal number of actions
    for turn in range(1, 27):
        obs, reward, terminated, truncated, info = env.step('move("up")')  # bumps forever
        assert truncated == (turn == 26) and not terminated and reward == 0.0
    assert info["max_turns"] == 26 and info["turn"] == 26
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step('move("up")')

    env = _hand_env(max_turns=2)
    env.step("garbage")
    *_, terminated, truncated, info = env.step('move("right")')
    assert truncated and not terminated and info["max_turns"] == 2
    # success on the last allowed turn is termination, not truncation
    env = _hand_env(max_turns=1, success_on="arrival")
    env.reset(options={"maze": Maze(walls=Maze.from_ascii(HAND).walls, start=(5, 4), goal=(5, 5))})
    _, reward, terminated, truncated, _ = env.step('move("right")')
    assert (reward, terminated, truncated) == (1.0, True, False)


def test_an_unreachable_goal_needs_an_explicit_turn_limit() -> None:
    """A hand-made maze whose goal cannot be reached has no optimal number of actions: the automatic limit used to
    come out as 0 (stop-on-goal) or -2 (arrival) and every episode ended after one turn, reporting that limit."""
    walled_in = Maze.from_ascii("#####\n#A#.#\n###.#\n#..G#\n#####")
    for rule in SUCCESS_ON:
        with pytest.raises(ValueError, match=r"cannot be reached from the start \(1, 1\).*give max_turns"):
            Maze2DEnv(size=5, success_on=rule).reset(options={"maze": walled_in})
        env = Maze2DEnv(size=5, success_on=rule, max_turns=3)  # explicit: played, never solved
        _, info = env.reset(options={"maze": walled_in})
        assert (info["max_turns"], info["optimal_path_length"]) == (3, -1)
        for turn in (1, 2, 3):
            *_, reward, terminated, truncated, info = env.step('move("right")')
            assert (reward, terminated, truncated) == (0.0, False, turn == 3)


def test_info_keys_and_observation_types() -> None:
    env = Maze2DEnv(size=9, cell_px=16)
    obs, info = env.reset(seed=3)
    assert set(obs) == {"image", "ascii", "feedback"} and obs["feedback"] == ""
    assert obs["image"].shape == (144, 144, 3) and obs in env.observation_space
    assert set(info) == {"turn", "distance_to_goal", "optimal_path_length", "success", "parse_error", "wall_bump",
                         "action", "layout_hash", "max_turns", "agent", "goal"}
    assert info["turn"] == 0 and info["action"] is None and info["agent"] == env.maze.start
    assert env.solution() == solve(env.maze)


def test_step_before_reset_and_bad_options() -> None:
    env = Maze2DEnv(size=7)
    with pytest.raises(RuntimeError, match="reset"):
        env.step('move("up")')
    with pytest.raises(RuntimeError, match="reset"):
        env.render()
    with pytest.raises(ValueError, match="size 7"):
        env.reset(options={"maze": maze_from_seed(9, 0)})
    with pytest.raises(ValueError, match="unknown reset options"):
        env.reset(options={"start": (1, 1)})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"size": 8}, "odd"), ({"max_turns": -1}, "max_turns"), ({"action_format": "json"}, "action format"),
     ({"success_on": "touch"}, "success rule"), ({"cell_px": 2}, "cell_px"), ({"render_mode": "human"}, "render mode")],
)
def test_constructor_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Maze2DEnv(**kwargs)


def test_render_modes() -> None:
    maze = Maze.from_ascii(HAND)
    for mode, expected in (("rgb_array", render_rgb(maze, maze.start, 4)), ("ansi", HAND.strip())):
        env = Maze2DEnv(size=7, cell_px=4, render_mode=mode)
        env.reset(options={"maze": maze})
        frame = env.render()
        assert np.array_equal(frame, expected) if mode == "rgb_array" else frame == expected
    env = Maze2DEnv(size=7, render_mode=None)
    env.reset(seed=0)
    assert env.render() is None


# ---------------------------------------------------------------------------------------------------
# Prompt
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ACTION_FORMATS)
@pytest.mark.parametrize("rule", SUCCESS_ON)
@pytest.mark.parametrize("observation", OBSERVATIONS)
def test_instructions_show_the_exact_syntax(fmt: str, rule: str, observation: str) -> None:
    text = instructions(fmt, rule, observation, max_turns=20)
    for action in (*DIRECTIONS, "stop"):
        assert format_action(action, fmt) in text
    assert ("gray" in text) == ("image" in observation)
    assert ("# is a wall" in text) == ("ascii" in observation)
    assert ("stop on the goal" in text) == (rule == "stop-on-goal")
    assert "20 turns" in text and "last one counts" in text
    assert text.isascii() and len(text) < 800
    # the prompt lists several actions; the parser takes the last one, which the prompt also names
    assert parse_action(text, fmt).ok


def test_instructions_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="action format"):
        instructions("json", "arrival")
    with pytest.raises(ValueError, match="success rule"):
        instructions("tag", "touch")
    with pytest.raises(ValueError, match="observation"):
        instructions("tag", "arrival", "video")
    with pytest.raises(ValueError, match="max_turns"):
        instructions("tag", "arrival", "image", max_turns=0)


# ---------------------------------------------------------------------------------------------------
# `daedalus maze`
# ---------------------------------------------------------------------------------------------------


def test_cli_writes_png_and_prints_map_and_solution(tmp_path, capsys) -> None:
    out = tmp_path / "sub" / "maze.png"
    assert maze_cli.run(9, 3, str(out)) == 0
    maze = maze_from_seed(9, 3)
    with Image.open(out) as png:
        assert png.format == "PNG" and png.mode == "RGB"
        assert np.array_equal(np.asarray(png), render_rgb(maze, maze.start, 25))
    printed = capsys.readouterr().out
    assert render_ascii(maze, maze.start) in printed and maze.layout_hash() in printed
    solution = printed.split("then stop):\n", 1)[1].splitlines()[:-1]  # last line: "Wrote ..."
    assert solution == [format_action(m, "function") for m in solve(maze)] + ["stop()"]
    env = Maze2DEnv(size=9, cell_px=4)
    env.reset(seed=3)
    for line in solution:
        *_, reward, terminated, _, _ = env.step(line)
    assert reward == 1.0 and terminated


def test_cli_writes_the_format_the_extension_names_and_refuses_one_that_is_not_an_image(tmp_path, capsys) -> None:
    for name, fmt in (("m.jpg", "JPEG"), ("m.gif", "GIF"), ("m", "PNG")):  # it wrote a PNG under any name
        assert maze_cli.run(7, 1, str(tmp_path / name)) == 0
        with Image.open(tmp_path / name) as im:
            assert im.format == fmt and im.size == (7 * 25, 7 * 25)
    capsys.readouterr()
    assert maze_cli.run(7, 1, str(tmp_path / "new" / "m.txt")) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"daedalus maze: --out {tmp_path / 'new' / 'm.txt'}: .txt is not an image format Pillow writes; name a .png "
        "file (or .jpg, .gif, .webp)\n")
    assert not (tmp_path / "new").exists()  # refused before its directory is made


def test_cli_main_other_format_and_errors(tmp_path, capsys) -> None:
    assert maze_cli.main(["--size", "7", "--seed", "1", "--action-format", "tuple", "--cell-px", "16"]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("('stop', 'stop')") and "Wrote" not in printed
    assert maze_cli.run(8, 1, None) == 2
    assert "odd" in capsys.readouterr().err
    assert maze_cli.run(9, -1, None) == 2
    assert maze_cli.run(9, 1, None, cell_px=1) == 2
    assert maze_cli.run(8, 1, str(tmp_path / "new" / "sub" / "m.png")) == 2  # refused arguments create no --out dir
    assert not (tmp_path / "new").exists()
    capsys.readouterr()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    # bad --out: one line, exit 2 (`daedalus --help`: bad input), before the maze is printed; before, exit 1 (which
    # the help keeps for failures printed with a traceback), after the map, and "[Errno 17] File exists: '...file'"
    assert maze_cli.run(9, 1, str(blocker / "maze.png")) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"daedalus maze: --out: cannot create the directory {blocker}: {blocker} is a file, not a directory\n")
    assert maze_cli.run(9, 1, str(tmp_path)) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"daedalus maze: --out {tmp_path} is a directory; give the path of the PNG file to write\n")
