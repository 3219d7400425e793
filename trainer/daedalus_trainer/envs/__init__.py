"""Environments for Daedalus: VisGym-style Maze2D (:mod:`.maze`) and its action parser (:mod:`.actions`).

Importing this package registers ``daedalus/Maze2D-v0`` with Gymnasium, so
``gymnasium.make("daedalus/Maze2D-v0", size=9)`` works as well as ``Maze2DEnv(size=9)``.
"""

from __future__ import annotations

import gymnasium

from .actions import ACTION_FORMATS, ACTIONS, DIRECTIONS, STOP, ParsedAction, format_action, parse_action, syntax_hint
from .maze import (
    AGENT_RGB,
    GOAL_RGB,
    OBSERVATIONS,
    PATH_RGB,
    SUCCESS_ON,
    WALL_RGB,
    Maze,
    Maze2DEnv,
    corner_pairs,
    count_layouts,
    distance_map,
    generate_maze,
    instructions,
    maze_from_seed,
    render_ascii,
    render_rgb,
    solve,
)

#: Gymnasium id of :class:`Maze2DEnv`.
ENV_ID = "daedalus/Maze2D-v0"

if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="daedalus_trainer.envs.maze:Maze2DEnv")

__all__ = [
    "ACTIONS",
    "ACTION_FORMATS",
    "AGENT_RGB",
    "DIRECTIONS",
    "ENV_ID",
    "GOAL_RGB",
    "OBSERVATIONS",
    "PATH_RGB",
    "STOP",
    "SUCCESS_ON",
    "WALL_RGB",
    "Maze",
    "Maze2DEnv",
    "ParsedAction",
    "corner_pairs",
    "count_layouts",
    "distance_map",
    "format_action",
    "generate_maze",
    "instructions",
    "maze_from_seed",
    "parse_action",
    "render_ascii",
    "render_rgb",
    "solve",
    "syntax_hint",
]
