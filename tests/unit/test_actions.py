"""Tests for the strict Maze2D action parser (daedalus_trainer.envs.actions).

The fuzz test checks each parse against an independent, regex-free reference reader written below
(`_oracle`), watches the interpreter's audit events (PEP 578) to prove that nothing was compiled,
executed, imported or opened while parsing, and checks a sentinel file and a sentinel global that the
code-like inputs would create if anything ran them.
"""

from __future__ import annotations

import builtins
import random
import string
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daedalus_trainer.envs import actions
from daedalus_trainer.envs.actions import (
    ACTION_FORMATS,
    ACTIONS,
    DIRECTIONS,
    ParsedAction,
    format_action,
    parse_action,
    syntax_hint,
)

# ---------------------------------------------------------------------------------------------------
# Independent reference reader: plain string scanning, no regular expressions.
# ---------------------------------------------------------------------------------------------------

_WORDS = ("right", "up", "left", "down")


def _blanks(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t":
        i += 1
    return i


def _quoted(text: str, i: int, words: tuple[str, ...]) -> tuple[str, int] | None:
    if i >= len(text) or text[i] not in "\"'":
        return None
    quote = text[i]
    for word in words:
        end = i + 1 + len(word)
        if text.startswith(word, i + 1) and end < len(text) and text[end] == quote:
            return word, end + 1
    return None


def _match_function(text: str, i: int) -> tuple[str, int] | None:
    if i > 0 and (text[i - 1].isalnum() or text[i - 1] in "_."):
        return None
    if text.startswith("move(", i):
        got = _quoted(text, _blanks(text, i + 5), _WORDS)
        if got is None:
            return None
        word, j = got
        j = _blanks(text, j)
        return (word, j + 1) if text.startswith(")", j) else None
    if text.startswith("stop(", i):
        j = _blanks(text, i + 5)
        return ("stop", j + 1) if text.startswith(")", j) else None
    return None


def _match_tuple(text: str, i: int) -> tuple[str, int] | None:
    if not text.startswith("(", i):
        return None
    got = _quoted(text, _blanks(text, i + 1), ("move", "stop"))
    if got is None:
        return None
    name, j = got
    j = _blanks(text, j)
    if not text.startswith(",", j):
        return None
    j = _blanks(text, j + 1)
    if name == "move":
        if j >= len(text) or text[j] not in "0123":
            return None
        result, j = _WORDS[int(text[j])], j + 1
    else:
        got = _quoted(text, j, ("stop",))
        if got is None:
            return None
        result, j = got
    j = _blanks(text, j)
    return (result, j + 1) if text.startswith(")", j) else None


def _match_tag(text: str, i: int) -> tuple[str, int] | None:
    if not text.startswith("<action>", i):
        return None
    j = _blanks(text, i + 8)
    for word in (*_WORDS, "stop"):
        if text.startswith(word, j):
            k = _blanks(text, j + len(word))
            if text.startswith("</action>", k):
                return word, k + 9
    return None


_MATCHERS = {"function": _match_function, "tuple": _match_tuple, "tag": _match_tag}
_OPENINGS = {"function": ("move(", "stop("), "tuple": ("(",), "tag": ("<action>",)}


def _oracle(text: str, action_format: str) -> tuple[str | None, int]:
    """(last complete action or None, number of complete actions), scanning left to right."""
    match, i, last, count = _MATCHERS[action_format], 0, None, 0
    while True:
        found = [p for p in (text.find(opening, i) for opening in _OPENINGS[action_format]) if p >= 0]
        if not found:
            return last, count
        got = match(text, min(found))
        if got is None:
            i = min(found) + 1
        else:
            last, i = got
            count += 1


# ---------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------

ACCEPTED = [
    # function format
    ("function", 'move("right")', "right"),
    ("function", 'move("up")', "up"),
    ("function", 'move("left")', "left"),
    ("function", 'move("down")', "down"),
    ("function", "move('down')", "down"),
    ("function", 'move( "up" )', "up"),
    ("function", 'move(\t"left"\t)', "left"),
    ("function", "stop()", "stop"),
    ("function", "stop( )", "stop"),
    ("function", 'I will go up.\nmove("up")', "up"),
    ("function", '```\nmove("right")\n```', "right"),
    ("function", 'Action: move("down").', "down"),
    ("function", '(move("up"))', "up"),
    ("function", 'move("up")move("left")', "left"),
    ("function", 'move("up") then stop()', "stop"),
    ("function", 'stop() no, move("down")', "down"),
    # tuple format: VisGym numbering 0 right, 1 up, 2 left, 3 down
    ("tuple", "('move', 0)", "right"),
    ("tuple", "('move', 1)", "up"),
    ("tuple", "('move', 2)", "left"),
    ("tuple", "('move', 3)", "down"),
    ("tuple", '("move", 3)', "down"),
    ("tuple", "( 'move' , 2 )", "left"),
    ("tuple", "('move',1)", "up"),
    ("tuple", "('stop', 'stop')", "stop"),
    ("tuple", "('stop', \"stop\")", "stop"),
    ("tuple", "Answer: `('move', 0)`", "right"),
    ("tuple", "(('move', 2))", "left"),
    ("tuple", "[('move', 1)]", "up"),
    # tag format
    ("tag", "<action>right</action>", "right"),
    ("tag", "<action>up</action>", "up"),
    ("tag", "<action>left</action>", "left"),
    ("tag", "<action>down</action>", "down"),
    ("tag", "<action>stop</action>", "stop"),
    ("tag", "<action> up </action>", "up"),
    ("tag", "<think>the wall is left</think><action>down</action>", "down"),
    ("tag", "<action><action>up</action></action>", "up"),
]

REJECTED = [
    # function format: wrong case, wrong quotes, wrong names, other formats, incomplete
    ("function", 'Move("up")', "wrong letter case"),
    ("function", 'move("UP")', "wrong letter case"),
    ("function", 'MOVE("Up")', "wrong letter case"),
    ("function", "STOP()", "wrong letter case"),
    ("function", "move(up)", "no action found"),
    ("function", "move(\"up')", "no action found"),
    ("function", 'move("up"', "no action found"),
    ("function", 'move("north")', "no action found"),
    ("function", 'move("up", 2)', "no action found"),
    ("function", 'move(""up"")', "no action found"),
    ("function", "move(\"'up'\")", "no action found"),
    ("function", 'remove("up")', "no action found"),
    ("function", 'os.move("up")', "no action found"),
    ("function", '_move("up")', "no action found"),
    ("function", 'move\n("up")', "no action found"),
    ("function", 'move(\n"up")', "no action found"),
    ("function", 'move (“up”)', "no action found"),
    ("function", 'move(“up”)', "no action found"),
    ("function", "stop('stop')", "no action found"),
    ("function", "stop", "no action found"),
    ("function", "up", "no action found"),
    ("function", "('move', 1)", "no action found"),
    ("function", "<action>up</action>", "no action found"),
    ("function", "mоve(\"up\")", "no action found"),  # Cyrillic o
    ("function", "ｍｏｖｅ(\"up\")", "no action found"),  # full-width letters
    ("function", "", "empty reply"),
    ("function", " \n\t", "empty reply"),
    # tuple format
    ("tuple", "('move', 4)", "no action found"),
    ("tuple", "('move', -1)", "no action found"),
    ("tuple", "('move', 01)", "no action found"),
    ("tuple", "('move', 1.0)", "no action found"),
    ("tuple", "('move', True)", "no action found"),
    ("tuple", "('move', '1')", "no action found"),
    ("tuple", "('move', 0x1)", "no action found"),
    ("tuple", "('move', 1, 2)", "no action found"),
    ("tuple", "('move', 1,)", "no action found"),
    ("tuple", "('move', １)", "no action found"),  # full-width digit
    ("tuple", "('move', ١)", "no action found"),  # Arabic-Indic digit one
    ("tuple", "('move\", 1)", "no action found"),
    ("tuple", "(move, 1)", "no action found"),
    ("tuple", "('Move', 1)", "wrong letter case"),
    ("tuple", "('STOP', 'STOP')", "wrong letter case"),
    ("tuple", "('stop',)", "no action found"),
    ("tuple", "('stop', 'stop', 'stop')", "no action found"),
    ("tuple", "('move', (1))", "no action found"),
    ("tuple", "move 1", "no action found"),
    ("tuple", 'move("up")', "no action found"),
    # tag format
    ("tag", "<Action>up</Action>", "wrong letter case"),
    ("tag", "<action>UP</action>", "wrong letter case"),
    ("tag", "<action>up</actions>", "no action found"),
    ("tag", "<action>up<action>", "no action found"),
    ("tag", "<action>upward</action>", "no action found"),
    ("tag", "<action>'up'</action>", "no action found"),
    ("tag", "<action>\nup\n</action>", "no action found"),
    ("tag", "<action >up</action>", "no action found"),
    ("tag", "<action>up down</action>", "no action found"),
    ("tag", "<action></action>", "no action found"),
    ("tag", "up", "no action found"),
    ("tag", 'move("up")', "no action found"),
]


@pytest.mark.parametrize(("fmt", "text", "expected"), ACCEPTED)
def test_accepted_forms_map_to_the_right_action(fmt: str, text: str, expected: str) -> None:
    parsed = parse_action(text, fmt)
    assert parsed == ParsedAction(expected, None, _oracle(text, fmt)[1])
    assert parsed.ok
    assert _oracle(text, fmt)[0] == expected


@pytest.mark.parametrize(("fmt", "text", "reason"), REJECTED)
def test_rejected_forms_say_why(fmt: str, text: str, reason: str) -> None:
    parsed = parse_action(text, fmt)
    assert parsed.action is None and not parsed.ok and parsed.count == 0
    assert parsed.error is not None and parsed.error.startswith(reason), parsed.error
    assert _oracle(text, fmt) == (None, 0)


def test_tuple_format_uses_visgym_numbering() -> None:
    # VisGym Maze2D: _action_to_direction = {0: right, 1: up, 2: left, 3: down}
    assert DIRECTIONS == ("right", "up", "left", "down")
    for number, direction in enumerate(DIRECTIONS):
        assert format_action(direction, "tuple") == f"('move', {number})"
        assert parse_action(f"('move', {number})", "tuple").action == direction
    assert format_action("stop", "tuple") == "('stop', 'stop')"


def test_canonical_forms() -> None:
    assert [format_action(a, "function") for a in ACTIONS] == [
        'move("right")', 'move("up")', 'move("left")', 'move("down")', "stop()"]
    assert [format_action(a, "tag") for a in ACTIONS] == [
        "<action>right</action>", "<action>up</action>", "<action>left</action>", "<action>down</action>",
        "<action>stop</action>"]


@pytest.mark.parametrize("fmt", ACTION_FORMATS)
def test_format_then_parse_round_trips(fmt: str) -> None:
    for action in ACTIONS:
        text = format_action(action, fmt)
        assert parse_action(text, fmt) == ParsedAction(action, None, 1)
        # only the configured format counts
        for other in ACTION_FORMATS:
            if other != fmt:
                assert parse_action(text, other).action is None


@pytest.mark.parametrize("fmt", ACTION_FORMATS)
def test_last_complete_action_wins(fmt: str) -> None:
    """The documented rule: several actions in one reply -> the LAST complete one is taken."""
    assert "LAST complete action" in actions.__doc__ and "LAST complete action" in parse_action.__doc__
    up, down, stop = (format_action(a, fmt) for a in ("up", "down", "stop"))
    assert parse_action(f"{up} no wait {down}", fmt) == ParsedAction("down", None, 2)
    assert parse_action(f"{down}\n{up}", fmt) == ParsedAction("up", None, 2)
    assert parse_action(f"{up} {down} {stop}", fmt) == ParsedAction("stop", None, 3)
    assert parse_action(f"{stop} {up}", fmt) == ParsedAction("up", None, 2)
    # an incomplete fragment after the last complete action is ignored
    assert parse_action(f"{down} and then {up[:-1]}", fmt) == ParsedAction("down", None, 1)


def test_non_text_is_an_error_not_an_exception() -> None:
    for value in (None, 1, 1.5, b'move("up")', ["move('up')"], {"move": 1}, ("move", 1), object()):
        parsed = parse_action(value, "function")
        assert parsed == ParsedAction(None, "the action must be text", 0)
    assert parse_action(("move", 1), "tuple").action is None  # a real tuple is not text either


def test_programming_errors_raise() -> None:
    with pytest.raises(ValueError, match="unknown action format"):
        parse_action('move("up")', "json")
    with pytest.raises(ValueError, match="unknown action format"):
        format_action("up", "json")
    with pytest.raises(ValueError, match="unknown action format"):
        syntax_hint("json")
    with pytest.raises(ValueError, match="unknown action 'north'"):
        format_action("north", "function")


@pytest.mark.parametrize("fmt", ACTION_FORMATS)
def test_syntax_hint_lists_every_action(fmt: str) -> None:
    hint = syntax_hint(fmt)
    for action in ACTIONS:
        text = format_action(action, fmt)
        # the hint shows each action either literally or as its bare word next to a literal example
        assert text in hint or action in hint
    assert parse_action(hint, fmt).ok  # the hint itself holds valid examples


# ---------------------------------------------------------------------------------------------------
# Generated accepted forms (hypothesis)
# ---------------------------------------------------------------------------------------------------

_blank = st.text(alphabet=" \t", max_size=4)
_quote = st.sampled_from(["'", '"'])
_action = st.sampled_from(ACTIONS)
# text after the action: cannot hold '(' or '<', so it cannot hold another complete action
_tail = st.text(alphabet=st.characters(blacklist_characters="(<", blacklist_categories=("Cs",)), max_size=30)


@st.composite
def _written_action(draw: st.DrawFn, fmt: str) -> tuple[str, str]:
    action = draw(_action)
    b = [draw(_blank) for _ in range(4)]
    q, q2 = draw(_quote), draw(_quote)
    if fmt == "function":
        core = f"stop({b[0]})" if action == "stop" else f"move({b[0]}{q}{action}{q}{b[1]})"
    elif fmt == "tuple":
        arg = f"{q2}stop{q2}" if action == "stop" else str(DIRECTIONS.index(action))
        core = f"({b[0]}{q}{'stop' if action == 'stop' else 'move'}{q}{b[1]},{b[2]}{arg}{b[3]})"
    else:
        core = f"<action>{b[0]}{action}{b[1]}</action>"
    prefix = draw(st.text(max_size=40))  # may itself hold actions: ours comes last
    return action, f"{prefix}\n{core}{draw(_tail)}"


@pytest.mark.parametrize("fmt", ACTION_FORMATS)
def test_generated_accepted_forms_map_to_their_action(fmt: str) -> None:
    @settings(max_examples=500, deadline=None)
    @given(_written_action(fmt))
    def check(case: tuple[str, str]) -> None:
        action, text = case
        parsed = parse_action(text, fmt)
        assert parsed.action == action and parsed.error is None and parsed.count >= 1
        assert _oracle(text, fmt) == (parsed.action, parsed.count)

    check()


@settings(max_examples=500, deadline=None)
@given(st.text(), st.sampled_from(ACTION_FORMATS))
def test_arbitrary_text_agrees_with_the_reference_reader(text: str, fmt: str) -> None:
    parsed = parse_action(text, fmt)
    assert (parsed.action, parsed.count) == _oracle(text, fmt)


# ---------------------------------------------------------------------------------------------------
# Fuzz: >= 100k random and adversarial strings
# ---------------------------------------------------------------------------------------------------

_AUDIT_EVENTS: list[tuple[str, str]] = []
_AUDIT: dict = {"on": False, "installed": False, "thread": None}


def _audit_hook(event: str, args: tuple) -> None:
    # Only the parsing thread counts: in the full suite, background threads of other tests (a local Ray, HTTP
    # servers, kopf) open sockets and files of their own while this test runs.
    if _AUDIT["on"] and threading.get_ident() == _AUDIT["thread"]:
        _AUDIT_EVENTS.append((event, repr(args)[:200]))


def _adversarial_seeds(sentinel: str) -> list[str]:
    code = [
        f"__import__('pathlib').Path(r'{sentinel}').touch()",
        f"__import__('os').system('touch {sentinel}')",
        f"open(r'{sentinel}', 'w').write('x')",
        f"exec(\"open(r'{sentinel}','w')\")",
        f"eval(\"__import__('pathlib').Path(r'{sentinel}').touch()\")",
        "globals().update(DAEDALUS_PWNED=1)",
        "setattr(__builtins__, 'DAEDALUS_PWNED', 1)",
        "__builtins__.__dict__.__setitem__('DAEDALUS_PWNED', 1)",
        "[c for c in ().__class__.__base__.__subclasses__()]",
        f"('move', __import__('pathlib').Path(r'{sentinel}').touch() or 1)",
        f"move(__import__('pathlib').Path(r'{sentinel}').touch() or \"up\")",
        f"<action>{{{{__import__('os').system('touch {sentinel}')}}}}</action>",
        f"('move', 1) if __import__('pathlib').Path(r'{sentinel}').touch() else 0",
        "lambda: __import__('subprocess').run(['true'])",
        "${IFS}`touch x`$(touch x)",
        "{{7*7}} {% print 1 %} <script>alert(1)</script>",
    ]
    valid = [format_action(a, f) for f in ACTION_FORMATS for a in ACTIONS]
    tricky = [
        'move("up")move("down")', "move(\"up')", 'move("\\"up\\"")', 'move(""up"")', "move('''up''')",
        'move(f"{up}")', "move(r'up')", 'move(b"up")', 'move("up" "down")', "move(*['up'])",
        "move(direction='up')", "('move', 1)('move', 2)", "((('move', 1)))", "('move', 1)) + ('move', 2",
        "('move', 1 + 1)", "('move', 1 if True else 2)", "('move', 1); ('stop', 'stop')", "('move', 0b1)",
        "('move', 1_0)", "('move', +1)", "('move', ~1)", "('move', 1j)", "('move', [1])", "('move', {1})",
        "<action><action>up</action>", "<action>up</action></action>", "<<action>>up<</action>>",
        "<action>up</action><action>", "<ACTION>UP</ACTION>", "<action>Up</action>", "<action>st op</action>",
        "Move('Up')", "MOVE('UP')", "mOvE('uP')", "STOP()", "Stop()", "('MOVE', 1)", "('Stop', 'Stop')",
        "move('up\u200b')", "move('u\u0301p')", "mo\u200bve('up')", "\u202emove('up')", "move('\u202eup')",
        "\ufeffmove(\"up\")", "move(\u00a0'up'\u00a0)", "move(\u3000'up')", "move('\U0001f600')",
        "\ud800move('up')\udfff", "move('up')\x00", "\x00" * 50, "\\" * 100, "'" * 200, '"' * 200,
        "(" * 300, ")" * 300, "<" * 300, "move(" * 100, "('move', " * 100, "<action>" * 100,
        "move(" + " " * 500, "(" + " " * 500 + "'move'", "<action>" + "\t" * 500,
        "I think I should go up. Actually the wall is there, so move(\"down\").",
        "The answer is ('move', 3) because ('move', 1) hits the wall.",
        "<think>up?</think><action>left</action> or maybe <action>right</action>",
        "```python\nmove('up')\n```", "```json\n{\"action\": \"move\", \"direction\": \"up\"}\n```",
        "move('up') # stop()", "stop() # move('up')", "\"move('up')\"", "'move(\"up\")'",
    ]
    return code + valid + tricky


_MUTATION_ALPHABET = (
    "moveupdownleftrightstopaction"  # grammar letters
    "MOVEUPDOWNSTOPACTION"  # wrong case
    "()<>/,'\" \t\n0123456789_."  # grammar punctuation
    "\u200b\u00a0\u3000\ufeff\u202e\u0301оＭ１"  # invisible, lookalike and full-width characters
)


def _mutate(text: str, rnd: random.Random) -> str:
    for _ in range(rnd.randint(1, 3)):
        op = rnd.randrange(6)
        pos = rnd.randint(0, len(text))
        if op == 0:
            text = text[:pos] + rnd.choice(_MUTATION_ALPHABET) + text[pos:]
        elif op == 1 and text:
            text = text[:pos] + text[pos + 1 :]
        elif op == 2 and text:
            pos = min(pos, len(text) - 1)
            text = text[:pos] + rnd.choice(_MUTATION_ALPHABET) + text[pos + 1 :]
        elif op == 3:
            text = text.swapcase() if rnd.random() < 0.2 else text[:pos] + text[pos:].upper()
        elif op == 4:
            text = text + rnd.choice(("", " ", "\n")) + text[: rnd.randint(0, len(text))]
        else:
            text = text[:pos] + format_action(rnd.choice(ACTIONS), rnd.choice(ACTION_FORMATS)) + text[pos:]
    return text


def _random_text(rnd: random.Random) -> str:
    n = rnd.randint(0, 60)
    kind = rnd.randrange(3)
    if kind == 0:  # any code point, surrogates included
        return "".join(chr(rnd.randrange(0x110000)) for _ in range(n))
    if kind == 1:
        return "".join(rnd.choice(string.printable) for _ in range(n))
    return "".join(rnd.choice(_MUTATION_ALPHABET) for _ in range(n))


def test_fuzz_100k_strings_never_raise_never_execute_and_agree_with_reference(tmp_path) -> None:
    sentinel = str(tmp_path / "pwned")
    rnd = random.Random(20261130)
    seeds = _adversarial_seeds(sentinel)
    corpus: list[str] = list(seeds)
    while len(corpus) < 60_000:
        corpus.append(_mutate(rnd.choice(seeds), rnd))
    while len(corpus) < 100_000:
        corpus.append(_random_text(rnd))
    huge = [
        "move(" * 200_000,
        "move(" + " " * 2_000_000 + "'up'",
        "(" + " " * 1_000_000 + "'move'" + " " * 1_000_000 + ",",
        "<action>" + " " * 2_000_000,
        'move("up") ' * 100_000,
        "('move', 1)" * 100_000,
        "\U0001f600" * 1_000_000,
        "'" * 2_000_000,
    ]
    if not _AUDIT["installed"]:
        sys.addaudithook(_audit_hook)  # process-wide and permanent (PEP 578); records only while "on"
        _AUDIT["installed"] = True
    results: list[tuple[str, str, ParsedAction]] = []
    _AUDIT_EVENTS.clear()
    _AUDIT["thread"] = threading.get_ident()
    _AUDIT["on"] = True
    try:
        for fmt in ACTION_FORMATS:
            for text in corpus:
                results.append((fmt, text, parse_action(text, fmt)))
            for text in huge:
                results.append((fmt, text, parse_action(text, fmt)))
    finally:
        _AUDIT["on"] = False
    assert len(results) >= 3 * 100_000

    # nothing was compiled, executed, imported, opened or spawned while parsing
    assert _AUDIT_EVENTS == []
    assert not (tmp_path / "pwned").exists()
    assert not hasattr(builtins, "DAEDALUS_PWNED") and "DAEDALUS_PWNED" not in globals()

    accepted = 0
    printable = set(string.printable)
    for fmt, text, parsed in results:
        assert isinstance(parsed, ParsedAction)
        assert (parsed.action is None) == (parsed.error is not None)
        assert (parsed.action is None) == (parsed.count == 0)
        if parsed.action is None:
            assert set(parsed.error) <= printable and len(parsed.error) <= 60
        else:
            assert parsed.action in ACTIONS
            accepted += 1
        if len(text) <= 10_000:
            assert (parsed.action, parsed.count) == _oracle(text, fmt), (fmt, text)
    # the corpus exercises both sides of the grammar
    assert 10_000 < accepted < len(results) - 100_000


def test_huge_input_is_linear_time() -> None:
    # worst cases for a backtracking matcher: many openings, long blank runs, no closing
    for text in ("move(" + " \t" * 1_000_000, "( '" + "move', " * 500_000, "<action>" * 500_000,
                 "(\t'move'\t,\t" * 300_000):
        for fmt in ACTION_FORMATS:
            start = time.perf_counter()
            parsed = parse_action(text, fmt)
            elapsed = time.perf_counter() - start
            assert parsed.action is None
            # ~0.2 s here; a backtracking matcher takes hours on these inputs, so a loaded CI machine cannot blur it
            assert elapsed < 30.0, f"{fmt}: {elapsed:.2f} s for {len(text)} characters"
