"""Shared fixtures around the tiny offline Qwen3-VL (real architecture, random weights; ~1 s to build).

Fixtures:
- ``tiny_checkpoint`` (session): a tiny checkpoint directory built once, saved exactly like a real one.
- ``tiny_policy``: a fresh :class:`daedalus_trainer.policy.Policy` loaded from it (tests may mutate it).
- ``tiny_job`` (session): an ``RLTrainingJob`` for the tiny model on size-7 mazes (16 px cells, current image only).

Helpers: :func:`make_tiny_job` (the same job with overrides), :class:`ScriptedEngine` (a rollout engine that replies
with fixed texts, for testing the episode loop's bookkeeping without a model's randomness).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

TINY_JOB: dict[str, Any] = {
    "apiVersion": "daedalus.dev/v1alpha1",
    "kind": "RLTrainingJob",
    "metadata": {"name": "tiny-test"},
    "spec": {
        "model": {"name": "daedalus/tiny-qwen3-vl", "tiny": True, "dtype": "float32"},
        "lora": {"rank": 8, "alpha": 16, "targetModules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "algorithm": {"temperature": 1.0, "maxTokensPerTurn": 12, "groupSize": 2, "mazesPerStep": 2, "steps": 2},
        "environment": {"size": 7, "maxTurns": 0, "observation": "image", "historyTurns": 1,
                        "actionFormat": "function", "successOn": "stop-on-goal", "cellPixels": 16,
                        "evalMazes": 64, "evalSeed": 1234},
        "sft": {"steps": 10, "batchSize": 8, "learningRate": 0.001, "maxSeconds": 0},
        "cluster": {"workerGroups": [{"name": "cpu", "replicas": 1, "gpusPerWorker": 0}]},
    },
}


def make_tiny_job(model_path: str | Path | None = None, **sections: dict[str, Any]) -> Any:
    """An ``RLTrainingJob`` from :data:`TINY_JOB`; ``sections`` maps a spec section to fields to override
    (camelCase, as in YAML), e.g. ``make_tiny_job(path, environment={"historyTurns": 3})``."""
    from daedalus_trainer.config import parse_job

    job = copy.deepcopy(TINY_JOB)
    if model_path is not None:
        job["spec"]["model"]["path"] = str(model_path)
    for section, fields in sections.items():
        job["spec"].setdefault(section, {}).update(copy.deepcopy(fields))
    return parse_job(job)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """Directory of a freshly built tiny Qwen3-VL checkpoint (config, safetensors, tokenizer, processor)."""
    from daedalus_trainer.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-vl"))


@pytest.fixture
def tiny_policy(tiny_checkpoint):
    """A fresh policy (no adapter, float32, CPU) loaded from ``tiny_checkpoint``."""
    from daedalus_trainer.policy import load_pretrained

    return load_pretrained(tiny_checkpoint, "float32", "cpu")


@pytest.fixture(scope="session")
def tiny_job(tiny_checkpoint):
    """:func:`make_tiny_job` pointing at ``tiny_checkpoint``."""
    return make_tiny_job(tiny_checkpoint)


class ScriptedEngine:
    """A :class:`daedalus_trainer.rollout.engine.RolloutEngine` whose reply is ``script(messages, images)``.

    Prompts are tokenized by the real processor (like :class:`TransformersEngine`), replies by the real tokenizer
    plus ``<|im_end|>``; log-probs are 0. Used to test episode bookkeeping with known replies.
    """

    def __init__(self, policy, script):
        self.policy = policy
        self.script = script
        self.adapter_version = 0
        self.batches: list[int] = []

    def load_adapter(self, path_or_state, version):  # pragma: no cover - not used by the tests
        self.adapter_version = version

    def generate(self, conversations, images, sampling):
        from daedalus_trainer import prompts
        from daedalus_trainer.rollout.engine import Generation

        enc = prompts.encode_prompts(self.policy.processor, conversations, images)
        out = []
        for i, (messages, imgs) in enumerate(zip(conversations, images)):
            text = self.script(messages, list(imgs))
            ids = prompts.completion_ids(self.policy.tokenizer, text, self.policy.im_end_id)
            mask = enc["attention_mask"][i].bool()
            out.append(Generation(text, enc["input_ids"][i][mask].tolist(), ids, [0.0] * len(ids), "stop", list(imgs)))
        self.batches.append(len(conversations))
        return out


def solver_reply(image, cell_px: int, action_format: str = "function") -> str:
    """The optimal reply for the maze drawn in ``image`` (uint8 ``[H, W, 3]``, as ``render_rgb`` draws it), read from
    the pixels alone: gray cells are walls, the cell with blue pixels is the agent, the one with red pixels the goal.
    ``stop`` when the agent stands on the goal."""
    import numpy as np

    from daedalus_trainer.envs import STOP, WALL_RGB, Maze, format_action, solve

    img = np.asarray(image)
    n = img.shape[0] // cell_px
    cells = img.reshape(n, cell_px, n, cell_px, 3).transpose(0, 2, 1, 3, 4)  # [row, col, y, x, rgb]
    walls = (cells[:, :, 0, 0] == np.array(WALL_RGB)).all(-1)
    blue = ((cells[..., 2] == 255) & (cells[..., 0] == 0)).any((2, 3))
    red = ((cells[..., 0] == 255) & (cells[..., 2] == 0)).any((2, 3))
    agent = tuple(int(x) for x in np.argwhere(blue)[0])
    goal = tuple(int(x) for x in np.argwhere(red)[0])
    if agent == goal:
        return format_action(STOP, action_format)
    return format_action(solve(Maze(walls=walls, start=agent, goal=goal))[0], action_format)
