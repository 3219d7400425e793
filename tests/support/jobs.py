"""Small RLTrainingJob manifests for tests, derived from examples/local-tiny.yaml."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def set_spec_fields(spec: dict, **overrides) -> dict:
    """Set fields of a job's ``spec`` in place: ``a__b=value`` sets ``spec["a"]["b"]`` (sections created as needed,
    values deep-copied). Returns ``spec``."""
    for dotted, value in overrides.items():
        node = spec
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = copy.deepcopy(value)
    return spec


def tiny_job_dict(**spec_overrides) -> dict:
    """examples/local-tiny.yaml with small sizes for tests; ``spec_overrides`` maps section -> fields to update.

    Defaults: size-7 mazes, 16 eval mazes (one corner pair each), success on arrival within 16 turns (a half-trained
    policy then gets mixed rewards, so GRPO updates are real), 2 mazes x 4 episodes per step, 6 steps, checkpoints
    every 3 steps.
    """
    job = yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text())
    job["metadata"] = {"name": "e2e", "namespace": "default"}
    spec = job["spec"]
    spec["environment"].update({"evalMazes": 16, "evalCorners": 1, "successOn": "arrival", "maxTurns": 16})
    spec["algorithm"].update({"groupSize": 4, "mazesPerStep": 2, "steps": 6, "maxTokensPerTurn": 10})
    # demonstrations only: the suite's SFT start (and thresholds measured from it) stay as measured before DAgger
    spec["sft"].update({"steps": 150, "batchSize": 16, "maxSeconds": 120, "onPolicyFraction": 0.0})
    spec["checkpoint"].update({"intervalSteps": 3, "keep": 3})
    for section, fields in spec_overrides.items():
        spec.setdefault(section, {}).update(copy.deepcopy(fields))
    return job
