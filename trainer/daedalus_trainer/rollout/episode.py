"""The multi-turn episode loop: drive Maze2D environments turn by turn with a rollout engine.

Record design (what the learner needs to be faithful): **one training sequence per turn**. Turn ``t``'s sequence is
the exact prompt the engine read at that turn (system prompt + the ``history_turns`` window, images included) followed
by the exact tokens it sampled. Recomputing log-probs on these sequences gives the log-probs of exactly the sampled
tokens in exactly the sampling context, whatever the history window drops or how a past reply would re-tokenize.
Every turn of an episode shares the episode's reward and advantage (GRPO outcome supervision); the cost is that the
shared system prompt and history are re-encoded per turn, which is small at ``history_turns = 1``.

Episodes of a batch run in lockstep: at each turn the still-running episodes' prompts go to the engine as one batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from daedalus_trainer.envs import Maze, Maze2DEnv
from daedalus_trainer.policy import TokenSequence
from daedalus_trainer.prompts import PromptSettings, build_conversation
from daedalus_trainer.rollout.engine import RolloutEngine, SamplingParams


@dataclass
class TurnRecord:
    """One turn: what the model saw, what it sampled, what the environment answered.

    Attributes:
        prompt_ids: exact prompt tokens given to the engine (image pads expanded).
        completion_ids: sampled tokens (ending with ``<|im_end|>`` unless cut at ``max_tokens``).
        logprobs: behaviour log-prob of each completion token (same length as ``completion_ids``).
        images: the context's images in order, uint8 ``[H, W, 3]`` (``min(history_turns, turn)`` of them with image
            observations).
        text: the decoded reply.
        action: the parsed action (``right``/``up``/``left``/``down``/``stop``) or None on a parse failure.
        feedback: the environment's feedback to this reply.
        reward: the environment's reward for this turn (1.0 on the successful turn, else 0.0).
        parse_error / wall_bump: as the environment's info.
        finish_reason: ``stop`` or ``length``.
        state: the environment state the reply acted in, the agent's cell ``(row, column)`` before the turn (the
            anchor of GiGPO's step groups, :func:`daedalus_trainer.grpo.step_advantages`); None if not recorded.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    images: list[np.ndarray]
    text: str
    action: str | None
    feedback: str
    reward: float
    parse_error: bool
    wall_bump: bool
    finish_reason: str
    state: tuple[int, int] | None = None

    @property
    def tokens(self) -> list[int]:
        """``prompt_ids + completion_ids``: the turn's training sequence."""
        return list(self.prompt_ids) + list(self.completion_ids)

    @property
    def assistant_mask(self) -> list[int]:
        """1 on completion tokens (the loss is taken there), 0 on prompt, image and feedback tokens."""
        return [0] * len(self.prompt_ids) + [1] * len(self.completion_ids)

    @property
    def token_logprobs(self) -> list[float]:
        """Log-probs aligned with :attr:`tokens` (0.0 on prompt tokens)."""
        return [0.0] * len(self.prompt_ids) + list(self.logprobs)

    def sequence(self) -> TokenSequence:
        """The turn as a :class:`~daedalus_trainer.policy.TokenSequence` for the learner."""
        return TokenSequence(list(self.prompt_ids), list(self.completion_ids), list(self.images))


@dataclass
class Trajectory:
    """One episode.

    Attributes:
        maze: the maze played.
        turns: one :class:`TurnRecord` per turn.
        reward: episode return (sum of turn rewards: 1.0 on success, else 0.0).
        success: solved under the environment's ``success_on`` rule.
        truncated: hit the turn limit without terminating.
        optimal_path_length: BFS moves from start to goal.
        max_turns: the episode's turn limit.
        final_image: the picture after the last turn (for GIFs).
        adapter_version: the engine's adapter version when the episode started.
    """

    maze: Maze
    turns: list[TurnRecord] = field(default_factory=list)
    reward: float = 0.0
    success: bool = False
    truncated: bool = False
    optimal_path_length: int = 0
    max_turns: int = 0
    final_image: np.ndarray | None = None
    adapter_version: int = 0

    @property
    def num_turns(self) -> int:
        """Turns taken (parse failures and wall bumps included)."""
        return len(self.turns)

    @property
    def actions(self) -> list[str | None]:
        """Parsed action of each turn (None for a parse failure)."""
        return [t.action for t in self.turns]

    @property
    def feedback(self) -> list[str]:
        """The environment's feedback after each turn."""
        return [t.feedback for t in self.turns]

    def sequences(self) -> list[TokenSequence]:
        """One training sequence per turn (see the module docstring)."""
        return [t.sequence() for t in self.turns]


def make_env(env_spec: Any) -> Maze2DEnv:
    """A :class:`Maze2DEnv` from an ``EnvironmentSpec``-like object (size, max_turns, action_format, success_on,
    cell_pixels)."""
    return Maze2DEnv(
        size=int(env_spec.size), max_turns=int(env_spec.max_turns), action_format=env_spec.action_format,
        success_on=env_spec.success_on, cell_px=int(env_spec.cell_pixels), render_mode="rgb_array",
    )


def run_episodes(
    engine: RolloutEngine,
    mazes: Sequence[Maze],
    env_spec: Any,
    sampling: SamplingParams,
    *,
    seed: int | None = None,
    on_turn: Callable[[int, int, int, int], None] | None = None,
) -> list[Trajectory]:
    """Play one episode per maze with ``engine`` and return the trajectories in the order of ``mazes``.

    Args:
        engine: a :class:`~daedalus_trainer.rollout.engine.RolloutEngine`.
        mazes: mazes to play (repeat a maze ``groupSize`` times for a GRPO group).
        env_spec: ``EnvironmentSpec``-like (size, max_turns, observation, history_turns, action_format, success_on,
            cell_pixels).
        sampling: decoding settings; its ``seed`` is ignored in favour of ``seed``.
        seed: when given, turn ``k``'s batch is sampled with seed ``seed * 1_000_003 + k`` (reproducible rollouts).
        on_turn: called after every turn (all playing episodes take their turn in one batch) with ``(turns played,
            the longest turn limit of the mazes, episodes ended, episodes)``: progress for evaluations that take
            tens of seconds. It does not change what is played.

    Every turn counts towards the limit, including replies that cannot be parsed (the environment answers with the
    parse-failure feedback, which the next prompt shows) and wall bumps.

    Raises:
        RuntimeError: the engine returned another number of generations than it was given conversations.
    """
    settings = PromptSettings.from_env(env_spec)
    envs = [make_env(env_spec) for _ in mazes]
    trajectories: list[Trajectory] = []
    observations: list[list[dict[str, Any]]] = []
    replies: list[list[str]] = []
    version = int(getattr(engine, "adapter_version", 0))
    for env, maze in zip(envs, mazes):
        obs, info = env.reset(options={"maze": maze})
        observations.append([obs])
        replies.append([])
        trajectories.append(Trajectory(maze=maze, optimal_path_length=int(info["optimal_path_length"]),
                                       max_turns=int(info["max_turns"]), final_image=obs["image"],
                                       adapter_version=version))
    active = list(range(len(mazes)))
    turn = 0
    limit = max((t.max_turns for t in trajectories), default=0)
    while active:
        convs, imgs = [], []
        for i in active:
            messages, images = build_conversation(observations[i], replies[i], settings)
            convs.append(messages)
            imgs.append(images)
        turn_sampling = sampling
        if seed is not None:
            turn_sampling = SamplingParams(sampling.temperature, sampling.top_p, sampling.max_tokens,
                                           seed=seed * 1_000_003 + turn)
        gens = engine.generate(convs, imgs, turn_sampling)
        if len(gens) != len(convs):  # zip would drop the rest and return half-played episodes for training
            raise RuntimeError(f"rollout engine {type(engine).__name__} returned {len(gens)} generations for "
                               f"{len(convs)} conversations (turn {turn})")
        still = []
        for i, gen, images in zip(active, gens, imgs):
            state = (int(envs[i].agent[0]), int(envs[i].agent[1]))
            obs, reward, terminated, truncated, info = envs[i].step(gen.text)
            traj = trajectories[i]
            traj.turns.append(TurnRecord(
                prompt_ids=gen.prompt_ids, completion_ids=gen.token_ids, logprobs=gen.logprobs, images=images,
                text=gen.text, action=info["action"], feedback=obs["feedback"], reward=float(reward),
                parse_error=bool(info["parse_error"]), wall_bump=bool(info["wall_bump"]),
                finish_reason=gen.finish_reason, state=state,
            ))
            traj.reward += float(reward)
            traj.final_image = obs["image"]
            if terminated or truncated:
                traj.success = bool(info["success"])
                traj.truncated = bool(truncated)
            else:
                observations[i].append(obs)
                replies[i].append(gen.text)
                still.append(i)
        active = still
        turn += 1
        if on_turn is not None:
            on_turn(turn, limit, len(mazes) - len(active), len(mazes))
    return trajectories
