"""Rollouts: inference engines behind one interface and the multi-turn episode loop.

- :mod:`.engine`: :class:`RolloutEngine` protocol, :class:`SamplingParams`, :class:`Generation` and the transformers
  implementation :class:`TransformersEngine` (CPU, tests).
- :mod:`.vllm_engine`: :class:`VLLMEngine` (GPU; imports vLLM lazily, only when constructed).
- :mod:`.episode`: :func:`run_episodes` and the :class:`Trajectory` / :class:`TurnRecord` records.

No learning logic lives here.
"""

from daedalus_trainer.rollout.engine import Generation, RolloutEngine, SamplingParams, TransformersEngine
from daedalus_trainer.rollout.episode import Trajectory, TurnRecord, make_env, run_episodes

__all__ = [
    "Generation",
    "RolloutEngine",
    "SamplingParams",
    "Trajectory",
    "TransformersEngine",
    "TurnRecord",
    "make_env",
    "run_episodes",
]
