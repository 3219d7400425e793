"""Strict parser and formatter for Maze2D actions written by a model.

Three textual action formats are supported (``environment.actionFormat`` in the RLTrainingJob spec):

=============  =========================  ==========================  =============================
format         move (example: up)         stop                        direction argument
=============  =========================  ==========================  =============================
``function``   ``move("up")``             ``stop()``                  ``"right"``, ``"up"``, ``"left"``,
                                                                      ``"down"`` in single or double quotes
``tuple``      ``('move', 1)``            ``('stop', 'stop')``        VisGym's numbering: 0 right, 1 up,
                                                                      2 left, 3 down
``tag``        ``<action>up</action>``    ``<action>stop</action>``   the bare word
=============  =========================  ==========================  =============================

The ``tuple`` format is VisGym's own Maze2D syntax (``gymnasium/envs/maze_2d/maze_2d.py`` in
github.com/visgym/VisGym, which reads it with ``ast.literal_eval``). This module never evaluates model
text: no ``eval``, ``exec``, ``compile`` or ``ast``; each format is a fixed regular expression whose
matching runs in time linear in the length of the text (every repeated element is a run of blanks
that can follow only one fixed token, so no backtracking blow-up is possible).

Rules (the grammar is deliberately strict so that the reward measures the task, not format luck):

* Names and words are lowercase ASCII; ``Move("Up")`` or ``<ACTION>up</ACTION>`` is rejected (the
  error says so).
* Blanks (spaces and tabs only) are allowed around the argument(s); newlines inside an action are not.
* The action may be surrounded by other text (reasoning, code fences). ``move`` and ``stop`` must not
  be the tail of a longer identifier (``remove("up")`` is not an action).
* **Several actions: the LAST complete action in the text is taken.** A model that thinks aloud
  usually writes its final answer last ("not move("up"), the wall is there; move("down")"), and a
  prompt that echoes an example action precedes the answer. Incomplete fragments are ignored.
* Only the configured format counts: ``<action>up</action>`` is not an action in the ``function``
  format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "ACTIONS",
    "ACTION_FORMATS",
    "DIRECTIONS",
    "STOP",
    "ParsedAction",
    "format_action",
    "parse_action",
    "syntax_hint",
]

#: Move directions in VisGym's numbering (``('move', 0)`` is right, 1 up, 2 left, 3 down).
DIRECTIONS: tuple[str, ...] = ("right", "up", "left", "down")
#: The action that ends an episode.
STOP = "stop"
#: Every action the environment knows.
ACTIONS: tuple[str, ...] = (*DIRECTIONS, STOP)
#: The textual formats, as named by ``environment.actionFormat``.
ACTION_FORMATS: tuple[str, ...] = ("function", "tuple", "tag")

_BLANK = r"[ \t]*"
_WORD = "right|up|left|down"

# "move(?<![\w.]move)": the name must not end a longer identifier nor follow a dot ("env.move(...)" is not our
# syntax). The look-behind sits after the literal so the regex engine can still scan for the literal quickly.
_PATTERNS_SOURCE: dict[str, str] = {
    "function": (
        rf"""move(?<![\w.]move)\({_BLANK}(?P<q>["'])(?P<dir>{_WORD})(?P=q){_BLANK}\)"""
        rf"""|(?P<stop>stop)(?<![\w.]stop)\({_BLANK}\)"""
    ),
    "tuple": (
        rf"""\({_BLANK}(?P<q>["'])move(?P=q){_BLANK},{_BLANK}(?P<num>[0-3]){_BLANK}\)"""
        rf"""|\({_BLANK}(?P<q2>["'])(?P<stop>stop)(?P=q2){_BLANK},{_BLANK}(?P<q3>["'])stop(?P=q3){_BLANK}\)"""
    ),
    "tag": rf"<action>{_BLANK}(?P<word>{_WORD}|stop){_BLANK}</action>",
}
_PATTERNS: dict[str, re.Pattern[str]] = {k: re.compile(v) for k, v in _PATTERNS_SOURCE.items()}
# Used only after a failed strict parse, to tell the model that the case is wrong.
_PATTERNS_ANY_CASE: dict[str, re.Pattern[str]] = {
    k: re.compile(v, re.IGNORECASE) for k, v in _PATTERNS_SOURCE.items()
}

_HINTS: dict[str, str] = {
    "function": 'move("up"), move("down"), move("left"), move("right") or stop()',
    "tuple": "('move', N) with N 0=right 1=up 2=left 3=down, or ('stop', 'stop')",
    "tag": "<action>up</action> (or down, left, right, stop)",
}


@dataclass(frozen=True)
class ParsedAction:
    """Result of :func:`parse_action`.

    Attributes:
        action: ``"right"``, ``"up"``, ``"left"``, ``"down"`` or ``"stop"``; ``None`` when the text holds no
            valid action.
        error: short human-readable reason (ASCII, never quotes the model's text) when ``action`` is
            ``None``; ``None`` otherwise.
        count: number of complete actions found in the text (the last one is ``action``).
    """

    action: str | None
    error: str | None = None
    count: int = 0

    @property
    def ok(self) -> bool:
        """True when an action was recognised."""
        return self.action is not None


def _check_format(action_format: str) -> None:
    if action_format not in _PATTERNS:
        raise ValueError(f"unknown action format {action_format!r}; expected one of {', '.join(ACTION_FORMATS)}")


def syntax_hint(action_format: str) -> str:
    """The exact syntax of every action in ``action_format``, for prompts and feedback.

    Raises:
        ValueError: unknown ``action_format``.
    """
    _check_format(action_format)
    return _HINTS[action_format]


def _action_of(match: re.Match[str], action_format: str) -> str:
    if action_format == "tag":
        return match.group("word")
    if match.group("stop") is not None:
        return STOP
    if action_format == "function":
        return match.group("dir")
    return DIRECTIONS[int(match.group("num"))]


def parse_action(text: object, action_format: str) -> ParsedAction:
    """Read one action from a model's reply. Never raises for any ``text``; never evaluates it.

    Rule for several actions: the LAST complete action in ``text`` is the one taken (see the module
    docstring for the reason and the exact grammar of each format).

    Args:
        text: the model's reply (any object; non-strings are reported as an error, not raised).
        action_format: ``"function"``, ``"tuple"`` or ``"tag"``.

    Returns:
        :class:`ParsedAction` with the action, or with ``action=None`` and a short reason.

    Raises:
        ValueError: only for an unknown ``action_format`` (a programming error, not model output).

    Runs in time linear in ``len(text)``.
    """
    _check_format(action_format)
    if not isinstance(text, str):
        return ParsedAction(None, "the action must be text")
    last: re.Match[str] | None = None
    count = 0
    for match in _PATTERNS[action_format].finditer(text):
        last = match
        count += 1
    if last is not None:
        return ParsedAction(_action_of(last, action_format), None, count)
    if not text.strip():
        return ParsedAction(None, "empty reply")
    if _PATTERNS_ANY_CASE[action_format].search(text) is not None:
        return ParsedAction(None, "wrong letter case; actions are lowercase")
    return ParsedAction(None, "no action found")


def format_action(action: str, action_format: str) -> str:
    """The canonical text of ``action`` in ``action_format`` (used for SFT demonstrations and prompts).

    ``parse_action(format_action(a, f), f).action == a`` for every action ``a`` and format ``f``.

    Raises:
        ValueError: unknown action or format.
    """
    _check_format(action_format)
    if action not in ACTIONS:
        raise ValueError(f"unknown action {action!r}; expected one of {', '.join(ACTIONS)}")
    if action_format == "function":
        return "stop()" if action == STOP else f'move("{action}")'
    if action_format == "tuple":
        return "('stop', 'stop')" if action == STOP else f"('move', {DIRECTIONS.index(action)})"
    return f"<action>{action}</action>"
