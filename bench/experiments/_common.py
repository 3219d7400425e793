"""Shared bits of the experiment scripts: the repository root, the example job and ``key.path=value`` overrides.

Not a benchmark (``make bench`` runs ``bench/*.py`` only) and not imported by the project.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "local-tiny.yaml"


def override(text: str) -> tuple[str, str]:
    """argparse type for ``key.path=value`` (a path under the job's ``spec``; the value is parsed as YAML).

    Raises:
        argparse.ArgumentTypeError: no ``=`` in ``text``.
    """
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected key.path=value (e.g. algorithm.learningRate=1e-3), got {text!r}")
    key, value = text.split("=", 1)
    return key, value


def apply_overrides(doc: dict[str, Any], overrides: list[tuple[str, str]]) -> dict[str, Any]:
    """Set each ``(key.path, value)`` under ``doc["spec"]``, in order (YAML-parsed value; missing intermediate
    mappings are created). Returns ``doc``, changed in place."""
    for key, value in overrides:
        d = doc["spec"]
        parts = key.split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = yaml.safe_load(value)
    return doc


def in_process_parser(description: str, work_dir: str) -> argparse.ArgumentParser:
    """The arguments of the in-process GRPO experiments (``grpo_vision_lora.py``, ``grpo_restart_states.py``): the
    start model, the number of steps, ``key.path=value`` overrides of the example and ``--work-dir`` (default
    ``work_dir``) for the actors' files. The caller adds its own options."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("start", help="start model directory (e.g. runs/local-tiny/sft/model)")
    ap.add_argument("steps", type=int, help="GRPO steps")
    ap.add_argument("overrides", nargs="*", type=override, metavar="KEY.PATH=VALUE",
                    help="overrides under the spec of examples/local-tiny.yaml, values parsed as YAML")
    ap.add_argument("--work-dir", default=work_dir, help="work directory of the actors")
    return ap


def heldout_greedy(worker: Any, learner: Any, mazes: list[Any], step: int, t0: float) -> list[int]:
    """Greedy success (0/1 per maze) of the learner's current adapter on ``mazes``, played by the in-process
    ``RolloutWorker`` ``worker`` as adapter version ``step``; prints ``EVAL step <step> <rate> (<wins>/<n>)
    t=<seconds since t0>``."""
    import time

    wins = [int(w) for w in worker.evaluate(mazes, learner.adapter_state(), step)]
    print("EVAL step", step, sum(wins) / len(wins), f"({sum(wins)}/{len(wins)})", f"t={time.time() - t0:.0f}",
          flush=True)
    return wins


def load_example(overrides: list[tuple[str, str]] = ()) -> dict[str, Any]:
    """``examples/local-tiny.yaml`` as a dict with ``environment.evalCorners`` set to 1 (one episode per held-out
    layout, as every figure recorded before the example moved to 4), then ``overrides`` applied
    (:func:`apply_overrides`; ``environment.evalCorners=4`` restores the example's)."""
    with open(EXAMPLE) as f:
        doc = yaml.safe_load(f)
    doc["spec"].setdefault("environment", {})["evalCorners"] = 1
    return apply_overrides(doc, overrides)
