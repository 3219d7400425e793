"""Supervised fine-tuning on solver demonstrations: the starting point GRPO begins from.

VisGym shipped an SFT checkpoint for its mazes; for the tiny model we make our own. Each training example is one turn
of a demonstration (:func:`demonstration`: the breadth-first-search solver's move from the agent's cell, or ``stop`` on
the goal under ``stop-on-goal``; optionally along an episode in which some executed moves are random so that
recoveries are demonstrated too, :data:`DEMO_NOISE`), rendered **exactly like a rollout turn** by :mod:`daedalus_trainer.prompts`: same system prompt, same history window, same image
processing; the target is the canonical reply's tokens plus ``<|im_end|>``, the tokens a rollout engine would
generate. The loss is the token-mean negative log-likelihood over those assistant tokens only.

- Tiny model (``model.tiny``): full fine-tune of the random-init model; writes a full checkpoint ``<out>/model``.
- Real model: a LoRA adapter (``spec.lora``) on the frozen base; writes ``<out>/adapter`` (PEFT format).

Demonstrations come from :class:`daedalus_trainer.layouts.TrainingSampler`, so no evaluation layout is ever shown.
Each step draws ``batch_size`` mazes from ``(sft.seed, step)`` and one uniformly chosen turn of each, so the data of
step ``k`` does not depend on what ran before, and a resumed run sees the same data as an uninterrupted one.

On-policy states (DAgger; Ross, Gordon and Bagnell 2011, "A Reduction of Imitation Learning and Structured Prediction
to No-Regret Online Learning", arXiv:1011.0686): with ``sft.onPolicyFraction = f > 0``, ``f * batchSize`` (rounded) turns
of each batch come from an :class:`OnPolicyPool` instead of demonstrations: every ``sft.onPolicyEvery`` steps the
current policy plays :data:`POOL_MAZES` training mazes greedily and each distinct state it visits is labelled with the
solver's action from there. Demonstrations show the states an expert visits; the pool shows the states the policy's own
mistakes lead to, which is where a greedy policy fails (looping into a wall it misread). Measured on the tiny model
(size 7, batch 32, 64 held-out mazes, one seed each; ``bench/experiments/dagger.py``): from the random model, 1000 steps
at lr 1e-3 with f = 0.5 reached 71.9% greedy success (wall-bump rate 0.06 per turn) against 46.9% (0.47) for
demonstrations alone, for 1.2x the wall time; 600 more steps from a 60.9% model: 79.7% against 51.6%.

Step accuracy (logged with the loss): the fraction of held-out demonstration turns (from evaluation layouts) on which
greedy decoding reproduces the solver's reply exactly (:meth:`daedalus_trainer.policy.Policy.greedy_match`). Greedy
success stays near 0 until it passes ~0.9 (one wrong move into a wall repeats forever), so it is the figure to watch.

Budget: ``sft.steps`` optimizer steps or ``sft.maxSeconds`` seconds of training, whichever comes first. The seconds
count the training loop (data, forward, backward, update, step-accuracy logging, checkpoints), summed across resumed
runs, and exclude the periodic held-out evaluations (``sft.evalEvery``), which are timed separately. The learning
rate follows a warmup-stable-decay schedule over that budget (:func:`lr_at`) with AdamW betas (0.9, 0.95).

Measured on the tiny model, size 7, batch 32, lr 1e-3 (greedy success on the 64 held-out mazes, +-12% at 95%): a
constant rate plateaued at ~0.9 step accuracy (33% after 600 steps); decay over the last 30% gave 36-38% at ~550 steps
and 47% at 1100; betas (0.9, 0.95) and decay over the last half: 45% at 550 steps and 61% after 960 steps (330 s on an
idle core). Learning rates of 1.5e-3 and 2e-3 stalled at 0.6-0.7 step accuracy; batch 16 was worse per sample.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from daedalus_trainer import prompts
from daedalus_trainer.envs import DIRECTIONS, STOP, distance_map, format_action, solve
from daedalus_trainer.envs.maze import DELTAS
from daedalus_trainer.layouts import TrainingSampler, check_layouts, eval_corners, eval_mazes
from daedalus_trainer.policy import Policy, TokenSequence, load_policy, load_pretrained, resolve_base_dir
from daedalus_trainer.rollout.episode import make_env

log = logging.getLogger("daedalus.sft")

CHECKPOINT_DIRNAME = "checkpoint"
MODEL_DIRNAME = "model"
SNAPSHOTS_DIRNAME = "snapshots"
ADAPTER_DIRNAME = "adapter"
REPORT_NAME = "sft_report.json"
#: Linear learning-rate warm-up (steps) before the constant rate.
WARMUP_STEPS = 20
#: Final fraction of the budget over which the learning rate decays linearly to 0 (see :func:`lr_at`; measurements in
#: the module docstring).
DECAY_FRACTION = 0.5
#: Probability that a demonstration turn executes a random move instead of the expert's (see :func:`demonstration`).
#: Measured on the tiny model (size 7, 900 steps, batch 32, lr 1e-3, 64 held-out mazes): once the wall-bump feedback
#: names the direction ("Hit a wall moving up"), 0.15 gave 54.7% greedy success against 43.8% without noise, and the
#: share of greedy turns spent bumping into walls fell from 63% to 45%: the recoveries it demonstrates are what a greedy
#: policy needs after its own mistakes. (While the feedback did not name the direction, 0.2 gave 27% against 36%.)
DEMO_NOISE = 0.15
#: Held-out demonstration turns used for step accuracy.
ACCURACY_TURNS = 128
#: Steps between step-accuracy measurements and log records.
LOG_EVERY = 50
#: Seconds of training between resumable checkpoints.
CHECKPOINT_SECONDS = 60.0
MAX_GRAD_NORM = 1.0
#: AdamW betas: beta2 = 0.95 as common for transformers (e.g. GPT-3, Brown et al. 2020), better than 0.999 here.
ADAM_BETAS = (0.9, 0.95)
#: Greedy episodes the policy plays per on-policy pool refresh (see :class:`OnPolicyPool`).
POOL_MAZES = 32
#: Pool round ``r`` plays the training sampler's mazes of step ``POOL_STEP_OFFSET + r``, away from the steps whose
#: mazes the demonstrations use (a coincidence would only repeat training mazes, never show an evaluation layout).
POOL_STEP_OFFSET = 10_000


# ------------------------------------------------------------------------------------------------- demonstrations
@dataclass
class DemoTurn:
    """One demonstration turn: the prompt messages and images a rollout would see, and the solver's reply."""

    messages: list[dict[str, Any]]
    images: list[Any]
    reply: str


def demonstration(maze: Any, env_spec: Any, upto: int | None = None, noise: float = 0.0,
                  rng: np.random.Generator | None = None) -> list[DemoTurn]:
    """An episode on ``maze`` labelled by the solver, as prompt/reply turns rendered like rollout turns.

    Every turn's reply is the expert's: the first move of the shortest path from the agent's current cell
    (:func:`daedalus_trainer.envs.solve`), or ``stop`` on the goal under ``stop-on-goal``. With ``noise = 0`` the
    environment executes those replies (the plain solver episode). With ``noise > 0`` each turn executes, with that
    probability, a uniformly random move instead, so the episode also visits cells off the shortest path, dead ends
    and wall bumps, each labelled with the expert's reply from there: DART-style noise injection (Laskey et al. 2017,
    "DART: Noise Injection for Robust Imitation Learning", arXiv:1703.09327), which teaches the recoveries a greedy
    policy needs after its own mistakes. The context shows the replies the environment actually executed, exactly as
    in a rollout, and every observation and feedback line is the environment's own.

    Ends at termination or the turn limit, or after turn ``upto`` (0-based) if given.

    Raises:
        ValueError: ``noise`` outside [0, 1], or ``noise > 0`` without ``rng``.
    """
    observations, executed, labels = _play_demonstration(maze, env_spec, upto, noise, rng)
    settings = prompts.PromptSettings.from_env(env_spec)
    return [_demo_turn(observations, executed, labels, k, settings) for k in range(len(labels))]


def _play_demonstration(maze: Any, env_spec: Any, upto: int | None, noise: float,
                        rng: np.random.Generator | None) -> tuple[list, list[str], list[str]]:
    """Play the (noisy) expert episode: ``(observations, executed replies, expert labels)``, see
    :func:`demonstration`."""
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise}")
    if noise > 0 and rng is None:
        raise ValueError("noise > 0 needs an rng")
    fmt = env_spec.action_format
    env = make_env(env_spec)
    obs, info = env.reset(options={"maze": maze})
    dist = distance_map(maze)  # BFS moves to the goal from every cell: the expert's move descends it
    observations, executed, labels = [obs], [], []
    while True:
        labels.append(format_action(expert_action(maze, dist, tuple(info["agent"])), fmt))
        if upto is not None and len(labels) > upto:
            break
        action = labels[-1] if noise == 0 or rng.random() >= noise else format_action(
            DIRECTIONS[int(rng.integers(len(DIRECTIONS)))], fmt)
        executed.append(action)
        obs, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            break
        observations.append(obs)
    return observations, executed, labels


def _demo_turn(observations: list, executed: list[str], labels: list[str], k: int,
               settings: prompts.PromptSettings) -> DemoTurn:
    """Turn ``k`` of a played demonstration rendered like a rollout turn."""
    messages, images = prompts.build_conversation(observations[: k + 1], executed[:k], settings)
    return DemoTurn(messages, images, labels[k])


def expert_action(maze: Any, dist: np.ndarray, cell: tuple[int, int]) -> str:
    """The solver's action at ``cell``: ``stop`` on the goal, else the first move (in :data:`DIRECTIONS` order) to a
    neighbour one step closer to the goal; in a perfect maze that neighbour is unique, so this is the first move of
    :func:`daedalus_trainer.envs.solve`. ``dist`` is :func:`daedalus_trainer.envs.distance_map` of ``maze`` (int
    ``[size, size]``, moves to the goal).

    Raises:
        ValueError: the goal cannot be reached from ``cell`` (no neighbour one step closer).
    """
    if cell == tuple(maze.goal):
        return STOP
    r, c = cell
    for name in DIRECTIONS:
        dr, dc = DELTAS[name]
        if dist[r + dr, c + dc] == dist[r, c] - 1 and dist[r + dr, c + dc] >= 0:
            return name
    raise ValueError(f"the goal cannot be reached from {cell}")


def demo_length(maze: Any, env_spec: Any) -> int:
    """Turns of the noise-free demonstration: the BFS moves, plus ``stop`` under ``stop-on-goal``, within a fixed
    ``max_turns``."""
    n = len(solve(maze)) + (1 if env_spec.success_on == "stop-on-goal" else 0)
    return min(n, int(env_spec.max_turns)) if int(env_spec.max_turns) > 0 else n


def encode_turns(policy: Policy, turns: list[DemoTurn]) -> list[TokenSequence]:
    """Tokenize demonstration turns exactly as a rollout engine would (one processor call, padding stripped)."""
    enc = policy.encode_prompts([t.messages for t in turns], [t.images for t in turns])
    out = []
    for i, t in enumerate(turns):
        ids = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
        out.append(TokenSequence(ids, prompts.completion_ids(policy.tokenizer, t.reply, policy.im_end_id), t.images))
    return out


class DemoSource:
    """Demonstration batches: step ``k`` -> ``batch_size`` turns, one uniformly chosen turn of a (noisy, see
    :func:`demonstration`) expert episode on each sampled maze. Deterministic in ``(seed, step)``."""

    def __init__(self, policy: Policy, env_spec: Any, sampler: TrainingSampler, seed: int, noise: float = DEMO_NOISE):
        self.policy, self.env_spec, self.sampler, self.seed, self.noise = policy, env_spec, sampler, int(seed), noise
        self.settings = prompts.PromptSettings.from_env(env_spec)

    def turns(self, step: int, batch_size: int) -> list[DemoTurn]:
        """The demonstration turns of ``step`` (deterministic).

        Raises:
            ValueError: the source's ``noise`` is outside [0, 1] (checked here, not at construction).
        """
        rng = np.random.default_rng([self.seed, int(step), 104729])
        out = []
        for maze in self.sampler.mazes(step, batch_size):
            if self.noise == 0:  # the length is known in advance: stop the episode at the chosen turn
                k = int(rng.integers(demo_length(maze, self.env_spec)))
                out.append(demonstration(maze, self.env_spec, upto=k)[k])
            else:  # play the whole noisy episode, render only the chosen turn
                observations, executed, labels = _play_demonstration(maze, self.env_spec, None, self.noise, rng)
                k = int(rng.integers(len(labels)))
                out.append(_demo_turn(observations, executed, labels, k, self.settings))
        return out

    def batch(self, step: int, batch_size: int) -> list[TokenSequence]:
        """:meth:`turns` tokenized (``[]`` for ``batch_size == 0``)."""
        return encode_turns(self.policy, self.turns(step, batch_size)) if batch_size > 0 else []


@dataclass
class OnPolicyPool:
    """The DAgger states of one refresh: the current policy's greedy episodes, relabelled by the solver.

    Attributes:
        round: refresh index (``step // sft.onPolicyEvery``); its mazes are the training sampler's mazes of step
            ``POOL_STEP_OFFSET + round``.
        replies: the executed replies of each episode, as text (what a checkpoint stores: :meth:`replay` rebuilds the
            pool from them exactly, without the model that played them).
        turns: each distinct state of those episodes rendered like a rollout turn, with the solver's reply
            (:func:`expert_action`) as the target. A state repeated in a loop (same cells, feedback and replies in
            the prompt window) is kept once, so a policy stuck in a loop does not fill the pool with one prompt.
        success: share of the episodes the policy solved (its greedy success on training mazes at this step).
    """

    round: int
    replies: list[list[str]]
    turns: list[DemoTurn]
    success: float

    @classmethod
    def play(cls, policy: Policy, env_spec: Any, sampler: TrainingSampler, round_: int, max_tokens: int,
             n: int = POOL_MAZES) -> OnPolicyPool:
        """Play ``n`` greedy episodes with ``policy`` (in eval mode, no gradients; the mode is restored) and label
        them."""
        from daedalus_trainer.rollout.engine import SamplingParams, TransformersEngine
        from daedalus_trainer.rollout.episode import run_episodes

        mazes = sampler.mazes(POOL_STEP_OFFSET + round_, n)
        was = policy.model.training
        policy.model.eval()
        try:
            with torch.no_grad():
                trajs = run_episodes(TransformersEngine(policy), mazes, env_spec,
                                     SamplingParams(temperature=0.0, max_tokens=max_tokens))
        finally:
            policy.model.train(was)
        return cls.replay(env_spec, sampler, round_, [[t.text for t in traj.turns] for traj in trajs])

    @classmethod
    def replay(cls, env_spec: Any, sampler: TrainingSampler, round_: int, replies: list[list[str]]) -> OnPolicyPool:
        """Rebuild the pool of round ``round_`` from the episodes' executed ``replies`` (the environment is
        deterministic given the maze and the replies). ``success`` is recomputed from the environment."""
        settings = prompts.PromptSettings.from_env(env_spec)
        fmt, h = env_spec.action_format, settings.history_turns
        mazes = sampler.mazes(POOL_STEP_OFFSET + round_, len(replies))
        turns, solved = [], 0
        for maze, episode in zip(mazes, replies):
            env = make_env(env_spec)
            obs, info = env.reset(options={"maze": maze})
            dist = distance_map(maze)
            observations, cells, labels = [obs], [tuple(info["agent"])], []
            success = False
            for reply in episode:
                labels.append(format_action(expert_action(maze, dist, cells[-1]), fmt))
                obs, _, terminated, truncated, info = env.step(reply)
                success = bool(info.get("success", False))
                if terminated or truncated:
                    break
                observations.append(obs)
                cells.append(tuple(info["agent"]))
            solved += success
            seen = set()
            for k in range(len(labels)):
                first = max(0, k - h + 1)
                key = (tuple((cells[j], observations[j].get("feedback")) for j in range(first, k + 1)),
                       tuple(episode[first:k]))
                if key not in seen:
                    seen.add(key)
                    turns.append(_demo_turn(observations, episode, labels, k, settings))
        return cls(round_, [list(e) for e in replies], turns, solved / max(1, len(replies)))


def heldout_turns(env_spec: Any, n: int = ACCURACY_TURNS, seed: int = 0) -> list[DemoTurn]:
    """``n`` demonstration turns from the evaluation mazes (cycled), one random turn each: step-accuracy data."""
    mazes = eval_mazes(env_spec)
    rng = np.random.default_rng([seed, 15485863])
    out = []
    for i in range(n):
        demo = demonstration(mazes[i % len(mazes)], env_spec)
        out.append(demo[int(rng.integers(len(demo)))])
    return out


@torch.no_grad()
def step_accuracy(policy: Policy, sequences: list[TokenSequence], chunk: int = 64) -> float:
    """Fraction of ``sequences`` whose completion greedy decoding reproduces exactly (see module docstring)."""
    was = policy.model.training
    policy.model.eval()
    hits = 0
    try:
        for lo in range(0, len(sequences), chunk):
            hits += int(policy.greedy_match(policy.collate(sequences[lo : lo + chunk])).sum())
    finally:
        policy.model.train(was)
    return hits / max(1, len(sequences))


# ----------------------------------------------------------------------------------------------------- training
@dataclass
class SFTState:
    """What a resumed SFT run continues from (``<out>/checkpoint/state.json``)."""

    step: int = 0
    #: Wall-clock seconds counted against ``sft.maxSeconds``: the training steps (data, on-policy pool refreshes,
    #: forward, backward, optimizer), the step-accuracy checks and the checkpoint writes; not ``eval_seconds``.
    seconds: float = 0.0
    #: CPU seconds of this process, all threads (``time.process_time``), over the training steps only.
    cpu_seconds: float = 0.0
    #: Wall-clock seconds of the periodic held-out greedy evaluations and the snapshots (outside the budget).
    eval_seconds: float = 0.0
    #: Tokens trained on: the non-padding tokens of every batch (prompt, image and reply tokens; ``attention_mask``).
    tokens: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    #: The on-policy pool in use (:class:`OnPolicyPool`): its round (-1: none yet) and executed replies.
    pool_round: int = -1
    pool_replies: list[list[str]] = field(default_factory=list)
    #: :func:`run_identity` of the job that started the run (``None`` in checkpoints written before it was kept).
    identity: dict[str, Any] | None = None

    def to_json(self) -> str:
        """JSON text."""
        return json.dumps(self.__dict__, indent=2)


def _atomic_replace_dir(tmp: Path, final: Path) -> None:
    """Put the complete directory ``tmp`` in place of ``final`` so that a crash at any point leaves one complete copy:
    ``final``, else ``final.old`` (for the checkpoint, :func:`_find_checkpoint` reads either). The ``.old`` copy is
    deleted only while ``final`` exists (after a crash between the two renames, ``.old`` is the only copy left, and
    it is kept until ``tmp`` has taken ``final``'s place)."""
    from daedalus_trainer.checkpoint import _fsync_path

    old = final.with_name(final.name + ".old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    _fsync_path(final.parent, directory=True)  # the renames are durable before the fallback copy goes
    if old.exists():
        shutil.rmtree(old)


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory, deepest first, ``root`` last (a file's directory entry
    is durable only once its directory is fsynced)."""
    from daedalus_trainer.checkpoint import _fsync_path

    paths = list(root.rglob("*"))
    for p in paths:
        if p.is_file() and not p.is_symlink():
            _fsync_path(p)
    for d in sorted({p for p in paths if p.is_dir() and not p.is_symlink()} | {root}, key=lambda d: -len(d.parts)):
        _fsync_path(d, directory=True)


def _save_result(out_dir: Path, policy: Policy) -> Path:
    """Write the final model (``<out>/model``, full fine-tune) or adapter (``<out>/adapter``) atomically: into
    ``<name>.tmp`` (a leftover of an interrupted write is removed first), fsynced, then renamed into place by
    :func:`_atomic_replace_dir`. A crash leaves the previous result or none (``<name>.old`` after a crash between the
    renames), never a half-written one under the final name. Returns the final directory."""
    name = ADAPTER_DIRNAME if policy.has_adapter else MODEL_DIRNAME
    final, tmp = out_dir / name, out_dir / (name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    if policy.has_adapter:
        policy.save_adapter(tmp)
    else:
        policy.save_pretrained(tmp)
    _fsync_tree(tmp)
    _atomic_replace_dir(tmp, final)
    return final


def _write_report(path: Path, report: dict[str, Any]) -> None:
    """Write ``sft_report.json`` atomically (:func:`daedalus_trainer.checkpoint.atomic_write_json`): it is the
    completion marker (:func:`finished_result`), so it is never seen half-written."""
    from daedalus_trainer.checkpoint import atomic_write_json

    atomic_write_json(path, report)


def _withdraw_report(out_dir: Path) -> None:
    """Remove ``sft_report.json`` (durably) before a run writes anything that replaces its result: from then until
    the new report is written, no report vouches for a result directory that is being replaced."""
    from daedalus_trainer.checkpoint import _fsync_path

    path = out_dir / REPORT_NAME
    if path.exists():
        path.unlink()
        _fsync_path(out_dir, directory=True)


def finished_result(out_dir: str | Path, step: int) -> Path | None:
    """The model or adapter directory a finished SFT run left in ``out_dir``, else ``None``.

    The completion marker is ``sft_report.json``: written last and atomically (:func:`_write_report`), after the
    result was renamed into place (:func:`_save_result`), and removed before a run starts to train
    (:func:`_withdraw_report`). A run counts as finished when the report parses as a JSON object marked
    ``completed``, records ``step`` (the step of the run's checkpoint, so a report left from an earlier, shorter
    run does not vouch for a later one), and names a result directory (relative to the report) that holds a model
    (``config.json``) or an adapter (``adapter_config.json``). What a crash leaves (``model.tmp``/``model.old`` and
    no report, or no ``model``) is not finished; the caller then continues from the checkpoint.
    """
    out_dir = Path(out_dir)
    try:
        done = json.loads((out_dir / REPORT_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not (isinstance(done, dict) and done.get("completed") is True and done.get("steps") == step
            and isinstance(done.get("result"), str)):
        return None
    result = out_dir / Path(done["result"]).name  # `model` or `adapter` here, wherever the run started from
    finished = (result / "config.json").is_file() or (result / "adapter_config.json").is_file()
    return result if finished else None


def save_checkpoint(out_dir: Path, policy: Policy, optimizer: torch.optim.Optimizer, state: SFTState) -> Path:
    """Write ``<out>/checkpoint`` (weights or adapter, optimizer, state) atomically: temp dir, fsync, rename."""
    final = out_dir / CHECKPOINT_DIRNAME
    tmp = out_dir / (CHECKPOINT_DIRNAME + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if policy.has_adapter:
        policy.save_adapter(tmp / ADAPTER_DIRNAME)
    else:
        policy.save_pretrained(tmp / MODEL_DIRNAME)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(state.to_json())
    _fsync_tree(tmp)
    _atomic_replace_dir(tmp, final)
    return final


#: ``sft`` fields a run may change and still continue (:func:`check_same_run`): its budget (a raised one continues
#: training) and the cadence of its held-out evaluations.
RESUMABLE_SFT_FIELDS = ("steps", "maxSeconds", "evalEvery")


def run_identity(job: Any) -> dict[str, Any]:
    """What an SFT run's data and weights depend on, flat as ``{"section.field": value}`` with the API's spelling
    (``environment.actionFormat``): the job's ``model`` and ``environment``, its ``sft`` section but for
    :data:`RESUMABLE_SFT_FIELDS`, ``algorithm.maxTokensPerTurn`` (the on-policy pool's replies) and, when SFT trains
    a LoRA adapter (a model that is not tiny), ``lora``."""
    spec = job.spec
    sections: dict[str, Any] = {"model": spec.model, "environment": spec.environment, "sft": spec.sft}
    if not spec.model.tiny:
        sections["lora"] = spec.lora
    flat: dict[str, Any] = {}
    for name, section in sections.items():
        for key, value in section.model_dump(mode="json", by_alias=True).items():
            if not (name == "sft" and key in RESUMABLE_SFT_FIELDS):
                flat[f"{name}.{key}"] = value
    flat["algorithm.maxTokensPerTurn"] = spec.algorithm.max_tokens_per_turn
    return flat


def check_same_run(ckpt: Path, job: Any, state: SFTState | None = None) -> None:
    """Refuse to continue, or to hand back as finished, an SFT run that another job's settings started.

    Compares the :func:`run_identity` kept in ``ckpt/state.json`` (``state``, when the caller has read it already)
    with ``job``'s, field by field (fields only one of them has, from another version of Daedalus, are not compared;
    a checkpoint without an identity passes).

    Raises:
        daedalus_trainer.checkpoint.CheckpointError: naming each differing field with both values and the ways on.
    """
    from daedalus_trainer.checkpoint import CheckpointError, identity_differences

    diff = identity_differences((state or _read_state(ckpt)).identity, run_identity(job))
    if diff:
        raise CheckpointError(
            f"{ckpt.parent} holds an SFT run started with other settings ({'; '.join(diff)}); continuing or reusing "
            "it would mix the two. Restore those settings, train SFT again into the same directory (`daedalus run "
            "JOB.yaml --resume none`, or `daedalus sft JOB.yaml --no-resume`: the old SFT model is replaced), or give "
            "the job another metadata.name")


class Retrain(Enum):
    """Why :func:`run_sft` would train instead of handing back its result as it is (:func:`reusable_result`)."""

    NO = "no"  #: it would not: the finished run is reused
    NO_RUN = "no SFT run"  #: the directory holds no SFT run
    BUDGET_RAISED = "budget raised"  #: finished, but sft.steps / sft.maxSeconds were raised since
    UNFINISHED = "unfinished"  #: stopped before its budget was spent
    OTHER_RUN = "other run"  #: started with other settings, or its checkpoint cannot be read


class SFTReuse(NamedTuple):
    """:func:`reusable_result`'s answer: ``result`` (the directory handed back, or ``None``), ``why`` it would train
    (a sentence; ``""`` when it would not) and the ``cause`` as a :class:`Retrain`."""

    result: Path | None
    why: str
    cause: Retrain


def reusable_result(job: Any, out_dir: str | Path) -> SFTReuse:
    """What :func:`run_sft` with ``resume`` would do in ``out_dir``, found without loading a model: ``result`` the
    model or adapter directory it would hand back as it is (finished, its ``sft.steps`` / ``sft.maxSeconds`` budget
    spent, started with ``job``'s settings), else ``None``, ``why`` it would train and its ``cause`` (no SFT run yet,
    a budget raised since, an unfinished run, other settings or an unreadable checkpoint).
    ``daedalus run`` asks before it continues GRPO checkpoints, whose starting point must stay as it was."""
    from daedalus_trainer.checkpoint import CheckpointError

    out_dir = Path(out_dir)
    ckpt = _find_checkpoint(out_dir)
    if ckpt is None:
        return SFTReuse(None, f"{out_dir} holds no SFT run: it would be trained from the start", Retrain.NO_RUN)
    try:
        saved = _read_state(ckpt)
        check_same_run(ckpt, job, saved)
    except CheckpointError as exc:
        return SFTReuse(None, str(exc), Retrain.OTHER_RUN)
    result = finished_result(out_dir, saved.step)
    max_steps, max_seconds = int(job.spec.sft.steps), float(job.spec.sft.max_seconds)
    if result is None:
        return SFTReuse(None, f"the SFT run in {out_dir} is unfinished (step {saved.step}): it would train on",
                        Retrain.UNFINISHED)
    if not (saved.step >= max_steps or (max_seconds > 0 and saved.seconds >= max_seconds)):
        return SFTReuse(None, (f"the SFT run in {out_dir} stopped at step {saved.step} ({saved.seconds:.0f} s); with "
                               f"sft.steps {max_steps} and sft.maxSeconds {max_seconds:g} it would train further"),
                        Retrain.BUDGET_RAISED)
    return SFTReuse(result, "", Retrain.NO)


def _damaged(ckpt: Path, file: str, exc: BaseException) -> Exception:
    """The :class:`~daedalus_trainer.checkpoint.CheckpointError` for the SFT checkpoint ``ckpt`` whose ``file``
    cannot be read: the first sentence of what ``exc`` (or the error it was raised from) says, and the way on."""
    from daedalus_trainer.checkpoint import CheckpointError, error_reason

    reason = error_reason(exc.__cause__ or exc, sentence=True)
    return CheckpointError(
        f"the SFT checkpoint {ckpt} cannot be read ({file}: {reason}): it is damaged (a disk error, or a file changed "
        "or cut short by hand). Train SFT again into the same directory (`daedalus sft JOB.yaml --no-resume`, or "
        "`daedalus run JOB.yaml --resume none`: the checkpoint and the SFT model are replaced)")


def _read_state(ckpt: Path) -> SFTState:
    """The :class:`SFTState` in ``ckpt/state.json``.

    Raises:
        daedalus_trainer.checkpoint.CheckpointError: it is not UTF-8 JSON holding an SFT state (:func:`_damaged`).
    """
    try:
        doc = json.loads((ckpt / "state.json").read_text(encoding="utf-8"))
        return SFTState(**doc)
    except (ValueError, TypeError) as exc:  # JSONDecodeError, UnicodeDecodeError; not an object, or unknown keys
        raise _damaged(ckpt, "state.json", exc) from None


def _find_checkpoint(out_dir: Path) -> Path | None:
    for name in (CHECKPOINT_DIRNAME, CHECKPOINT_DIRNAME + ".old"):
        p = out_dir / name
        if (p / "state.json").is_file() and (p / "optimizer.pt").is_file():
            return p
    return None


def lr_at(lr: float, step: int, progress: float) -> float:
    """Warmup-stable-decay learning rate (WSD; Hu et al. 2024, MiniCPM, arXiv:2404.06395).

    Linear warm-up over :data:`WARMUP_STEPS`, constant ``lr``, then a linear decay to 0 over the last
    :data:`DECAY_FRACTION` of the budget. ``progress`` in [0, 1] is the spent fraction of the budget: the larger of
    ``step / sft.steps`` and ``seconds / sft.maxSeconds`` (so with a time budget the decay is timed, and a run is
    reproducible step for step only when the step budget binds).
    """
    warm = min(1.0, (step + 1) / WARMUP_STEPS)
    decay = min(1.0, max(0.0, 1.0 - progress) / DECAY_FRACTION)
    return lr * warm * decay


def _load_start(job: Any, out_dir: Path, ckpt: Path | None, state: SFTState | None
                ) -> tuple[Policy, SFTState, dict | None]:
    """The policy, state and optimizer state to train from: the checkpoint ``ckpt`` with its already read
    ``state`` (resume), or a fresh start when ``ckpt`` is None."""
    spec = job.spec
    tiny = bool(spec.model.tiny) and not spec.model.sft_adapter
    if ckpt is not None:
        import pickle

        from daedalus_trainer.policy import ModelLoadError

        assert state is not None
        try:
            opt_state = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, pickle.UnpicklingError) as exc:  # what torch.load says of a damaged file
            raise _damaged(ckpt, "optimizer.pt", exc) from None
        if (ckpt / MODEL_DIRNAME).is_dir():
            try:
                policy = load_pretrained(ckpt / MODEL_DIRNAME, spec.model.dtype)
            except (ModelLoadError, FileNotFoundError) as exc:
                raise _damaged(ckpt, f"{MODEL_DIRNAME}/", exc) from None
        else:
            policy = load_pretrained(resolve_base_dir(spec.model, out_dir), spec.model.dtype)
            try:
                policy.load_adapter(ckpt / ADAPTER_DIRNAME, trainable=True)
            except (ModelLoadError, FileNotFoundError) as exc:
                raise _damaged(ckpt, f"{ADAPTER_DIRNAME}/", exc) from None
        return policy, state, opt_state
    if tiny:
        policy = load_pretrained(resolve_base_dir(spec.model, out_dir), spec.model.dtype)
    else:
        policy = load_policy(spec.model, spec.lora, work_dir=out_dir)
    return policy, SFTState(), None


def run_sft(
    job: Any,
    out_dir: str | Path,
    resume: bool = True,
    *,
    progress: bool = True,
    final_eval: bool = True,
    checkpoint_seconds: float = CHECKPOINT_SECONDS,
    log_every: int = LOG_EVERY,
    accuracy_turns: int = ACCURACY_TURNS,
    on_step: Callable[[SFTState], None] | None = None,
    snapshot_seconds: Sequence[float] = (),
    warn_budget: bool = True,
) -> Path:
    """Run SFT for ``job`` (an ``RLTrainingJob``) into ``out_dir``; return the saved model (tiny) or adapter dir.

    Writes ``<out>/model`` (tiny: full checkpoint, loadable by :func:`daedalus_trainer.policy.load_pretrained`) or
    ``<out>/adapter`` (PEFT), ``<out>/sft_report.json`` (settings, steps, seconds, loss and step-accuracy history,
    layout report, final greedy evaluation) and, while running, ``<out>/checkpoint`` every ``checkpoint_seconds`` and
    on interruption. The result is written into a temporary sibling, fsynced and renamed into place, and the report,
    the completion marker, is written last the same way and removed before training starts (:func:`finished_result`),
    so a crash at any point never leaves a half-written result that counts as finished. With ``resume``, a finished
    run whose budget is spent returns its result at once; an interrupted one (or one whose ``steps`` /
    ``maxSeconds`` were raised since) continues from its checkpoint, with the same data and optimizer state as an
    uninterrupted run.

    Keyword args: ``progress`` (tqdm bar on stderr with loss, step accuracy, tokens/s, training seconds and, with
    ``sft.onPolicyFraction > 0``, ``train_greedy``: the policy's greedy success on the last pool's training mazes;
    when stderr is not a terminal, one plain line with those figures per tenth of the budget instead; either way a
    last plain line at the step reached says whether the steps or the time budget ended the run; the line of each
    ``sft.evalEvery`` evaluation goes to stderr too, with or without ``progress``),
    ``final_eval`` (greedy evaluation on the held-out set at the end, stored in the report), ``checkpoint_seconds``,
    ``log_every`` (steps between step-accuracy measurements), ``accuracy_turns`` (held-out turns they use),
    ``on_step`` (called with the state after every optimizer step, e.g. for metrics; a ``KeyboardInterrupt`` raised
    there is handled like Ctrl-C: checkpoint, then re-raise), ``snapshot_seconds`` (training seconds at which the
    current weights are also written to ``<out>/snapshots/<seconds>s/``, a PEFT adapter or a full model; the writing
    time is not counted in the budget; ``bench/grpo_vs_sft.py`` evaluates them as a learning curve), ``warn_budget``
    (log a warning when ``sft.maxSeconds`` ends the run before ``sft.steps``; ``daedalus run`` turns it off and says it
    in its own summary line, read from the report).

    Raises:
        daedalus_trainer.layouts.LayoutError: the evaluation set leaves too few training layouts.
        FileNotFoundError: a real model without a local checkpoint.
        daedalus_trainer.checkpoint.CheckpointError: with ``resume``, ``out_dir`` holds a run another job's
            settings started (:func:`check_same_run`), or a checkpoint that cannot be read (a state that does not
            parse, a truncated optimizer state, damaged weights): the message says to train again without resuming.
    """
    from tqdm.auto import tqdm

    spec = job.spec
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report_path = out_dir / REPORT_NAME
    max_steps, max_seconds = int(spec.sft.steps), float(spec.sft.max_seconds)

    def exhausted(st: SFTState) -> bool:
        return st.step >= max_steps or (max_seconds > 0 and st.seconds >= max_seconds)

    ckpt = _find_checkpoint(out_dir) if resume else None
    saved = None
    if ckpt is not None:
        saved = _read_state(ckpt)  # once: the identity check, the finished test and the resume all use it
        check_same_run(ckpt, job, saved)
        result = finished_result(out_dir, saved.step)
        if result is not None and exhausted(saved):  # finished before: done unless the budget was raised since
            return result

    layout_report = check_layouts(spec.environment)
    policy, state, opt_state = _load_start(job, out_dir, ckpt, saved)
    state.identity = run_identity(job)
    policy.model.train()
    params = policy.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=spec.sft.learning_rate, betas=ADAM_BETAS, weight_decay=0.0)
    if opt_state is not None:
        optimizer.load_state_dict(opt_state)
    sampler = TrainingSampler.for_env(spec.environment, spec.sft.seed)
    source = DemoSource(policy, spec.environment, sampler, spec.sft.seed, noise=DEMO_NOISE)
    heldout = encode_turns(policy, heldout_turns(spec.environment, accuracy_turns, seed=spec.sft.seed))
    # DAgger (module docstring): n_policy turns of each batch from the on-policy pool, the rest demonstrations.
    n_policy = int(spec.sft.on_policy_fraction * spec.sft.batch_size + 0.5)
    n_demo = spec.sft.batch_size - n_policy
    every = int(spec.sft.on_policy_every)
    pool: OnPolicyPool | None = None
    pool_sequences: list[TokenSequence] = []
    if n_policy and state.pool_round >= 0:  # resumed: the pool of the interrupted run, rebuilt without the model
        pool = OnPolicyPool.replay(spec.environment, sampler, state.pool_round, state.pool_replies)
        pool_sequences = _encode_chunked(policy, pool.turns)

    def refresh_pool() -> None:
        nonlocal pool, pool_sequences
        pool = OnPolicyPool.play(policy, spec.environment, sampler, state.step // every,
                                 spec.algorithm.max_tokens_per_turn)
        pool_sequences = _encode_chunked(policy, pool.turns)
        state.pool_round, state.pool_replies = pool.round, pool.replies
        state.history.append({"step": state.step, "on_policy_success": pool.success, "pool_turns": len(pool.turns)})

    def pool_postfix() -> dict[str, str]:  # the policy's greedy success on the pool's training mazes
        return {"train_greedy": f"{pool.success:.2f}"} if pool is not None else {}

    def budget_left() -> bool:
        return not exhausted(state)

    def spent() -> float:
        return max(state.step / max(1, max_steps), state.seconds / max_seconds if max_seconds > 0 else 0.0)

    # The bar counts percent of the budget spent (spent(): steps or seconds, whichever binds), so it reaches 100%
    # whichever budget ends the run and its estimate of the time left follows the binding one.
    # On a terminal a live bar; in a log (CI, nohup, kubectl logs) a bar's carriage-return redraws would pile up
    # on one line, so there a plain line goes to stderr at each tenth of the budget instead.
    live = progress and sys.stderr.isatty()
    bar = tqdm(total=100, initial=min(100, round(100 * spent())), unit="%", desc="sft", disable=not live,
               dynamic_ncols=True, file=sys.stderr, bar_format="{l_bar}{bar}| [{elapsed}<{remaining}{postfix}]")
    next_line = (int(100 * spent()) // 10 + 1) * 10  # percent of the budget at which the next log line is due
    # From here on the run writes (checkpoints, then the result): the old report goes first (see finished_result).
    _withdraw_report(out_dir)
    last_ckpt = state.seconds
    marks = sorted(float(m) for m in snapshot_seconds if m > state.seconds)
    window_loss, window_tokens, window_time = [], 0, 0.0
    figures: dict[str, Any] = {}  # of the last measurement: the progress bar's postfix and the plain lines' figures

    def measure() -> dict[str, Any]:
        """Step accuracy on the held-out turns (its seconds count in the budget), recorded in the history with the
        loss and speed of the steps since the last measurement (the window, then emptied); returns the figures."""
        nonlocal window_loss, window_tokens, window_time
        t1 = time.perf_counter()
        acc = step_accuracy(policy, heldout)
        state.seconds += time.perf_counter() - t1
        state.history.append({
            "step": state.step, "seconds": round(state.seconds, 2), "cpu_seconds": round(state.cpu_seconds, 2),
            "loss": float(np.mean(window_loss)),
            "tokens_per_second": round(window_tokens / max(window_time, 1e-9), 1), "step_accuracy": acc,
        })
        measured = dict(step=state.step, loss=f"{np.mean(window_loss):.3f}", acc=f"{acc:.2f}",
                        tok_s=f"{window_tokens / max(window_time, 1e-9):.0f}", **pool_postfix())
        window_loss, window_tokens, window_time = [], 0, 0.0
        return measured

    def progress_line(done: int) -> str:
        """The plain progress line at ``done`` percent of the budget, with the last measurement's figures."""
        cap = f" of {max_seconds:.0f}" if max_seconds > 0 else ""
        shown = ", ".join(f"{k}={v}" for k, v in figures.items() if k != "step")
        return (f"sft: step {state.step}/{max_steps}, {state.seconds:.0f} s{cap} ({done}% of the budget)"
                + (f": {shown}" if shown else ""))

    # Demonstrations for step k + 1 are prepared (environment, rendering, processor) while step k trains: the data
    # of a step depends only on its index, so prefetching changes no value.
    prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sft-data")
    upcoming = prefetch.submit(source.batch, state.step, n_demo)
    try:
        while budget_left():
            t0, c0 = time.perf_counter(), time.process_time()
            sequences = upcoming.result()
            # The pool is refreshed while no prefetch runs: its rollouts and the prefetch share the processor (a
            # fast tokenizer must not be used from two threads at once). Its seconds count towards the budget.
            if n_policy and (pool is None or state.step % every == 0):
                refresh_pool()
            upcoming = prefetch.submit(source.batch, state.step + 1, n_demo)
            if n_policy:
                rng = np.random.default_rng([spec.sft.seed, state.step, 7919])
                sequences = sequences + [pool_sequences[i] for i in rng.integers(len(pool_sequences), size=n_policy)]
            batch = policy.collate(sequences)
            for g in optimizer.param_groups:
                g["lr"] = lr_at(spec.sft.learning_rate, state.step, spent())
            logp = policy.response_logprobs(batch)  # [B, T], 0 off the assistant tokens
            loss = -logp.sum() / batch.assistant_mask.sum()  # token-mean NLL of the assistant tokens
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            optimizer.step()
            state.step += 1
            n_tok = int(batch.attention_mask.sum())
            state.tokens += n_tok
            dt = time.perf_counter() - t0
            state.seconds += dt
            state.cpu_seconds += time.process_time() - c0  # this process, all threads: load-independent cost
            window_loss.append(loss.detach().item())
            window_tokens += n_tok
            window_time += dt
            bar.n = min(100, round(100 * spent()))
            bar.set_postfix(step=state.step, loss=f"{window_loss[-1]:.3f}",  # redraws the bar too
                            tok_s=f"{window_tokens / max(window_time, 1e-9):.0f}", **pool_postfix())
            if state.step % log_every == 0 or not budget_left():
                figures = measure()
                bar.set_postfix(**figures)
                done = min(100, int(100 * spent()))
                if progress and not live and done >= next_line and budget_left():  # the last line: after the loop
                    print(progress_line(done), file=sys.stderr, flush=True)
                    next_line = (done // 10 + 1) * 10
            if spec.sft.eval_every and state.step % spec.sft.eval_every == 0 and budget_left():
                t1 = time.perf_counter()
                res = _greedy_eval(policy, spec)
                state.eval_seconds += time.perf_counter() - t1
                state.history.append({"step": state.step, "eval_greedy_success": res["success_rate"]})
                # progress, like the bar and the plain lines: on stderr (tqdm.write's default is stdout), where a
                # live bar is cleared for it and redrawn below it
                bar.write(f"step {state.step}: held-out greedy success {res['success_rate']:.2f}", file=sys.stderr)
            if on_step is not None:
                on_step(state)
            while marks and state.seconds >= marks[0]:
                t1 = time.perf_counter()
                _snapshot(policy, out_dir / SNAPSHOTS_DIRNAME / f"{marks.pop(0):g}s")
                state.eval_seconds += time.perf_counter() - t1
            if state.seconds - last_ckpt >= checkpoint_seconds:
                t1 = time.perf_counter()
                save_checkpoint(out_dir, policy, optimizer, state)
                state.seconds += time.perf_counter() - t1
                last_ckpt = state.seconds
    except KeyboardInterrupt:
        save_checkpoint(out_dir, policy, optimizer, state)
        bar.close()
        raise
    finally:
        prefetch.shutdown(wait=True, cancel_futures=True)
    # The budget can run out after the last measurement (a checkpoint write, counted in it, took the last seconds):
    # the last steps are measured now, and the last line is always printed, at the step reached, saying why SFT
    # stopped (before, such a run ended without its 100% line, and its history without the last step's accuracy).
    if window_loss:
        figures = measure()
    done = min(100, int(100 * spent()))
    bar.n = done
    bar.set_postfix(**figures)
    bar.close()
    if progress:
        why = (f"all {max_steps} steps done" if state.step >= max_steps else
               f"the time budget (sft.maxSeconds {max_seconds:.0f} s) ran out before step {max_steps}")
        print(f"{progress_line(done)}; stopped: {why}", file=sys.stderr, flush=True)
    save_checkpoint(out_dir, policy, optimizer, state)
    if warn_budget and state.step < max_steps:
        log.warning("SFT stopped at its time budget (sft.maxSeconds %.0f s) after %d of %d steps (%.1f steps/s): "
                    "the starting point then depends on this machine's speed, and runs are not reproducible step "
                    "for step; raise sft.maxSeconds (0: no time budget) for the full %d steps", max_seconds,
                    state.step, max_steps, state.step / max(state.seconds, 1e-9), max_steps)

    policy.model.eval()
    result = _save_result(out_dir, policy)
    report = {
        "result": Path(result).name,  # relative to this report: the run may continue from another directory
        "completed": True,
        "steps": state.step,
        "seconds": round(state.seconds, 2),
        "cpu_seconds": round(state.cpu_seconds, 2),
        "load_average": list(os.getloadavg()),
        "eval_seconds": round(state.eval_seconds, 2),
        "tokens": state.tokens,
        "settings": {"steps": max_steps, "max_seconds": max_seconds, "batch_size": spec.sft.batch_size,
                     "learning_rate": spec.sft.learning_rate, "schedule": f"wsd(warmup={WARMUP_STEPS}, "
                     f"decay={DECAY_FRACTION})", "seed": spec.sft.seed,
                     "on_policy_fraction": spec.sft.on_policy_fraction, "on_policy_every": every,
                     "full_finetune": not policy.has_adapter, "torch_threads": torch.get_num_threads()},
        "layouts": layout_report.to_dict(),
        "history": state.history,
    }
    if final_eval:
        t1 = time.perf_counter()
        report["final_eval"] = _greedy_eval(policy, spec)
        report["final_eval_seconds"] = round(time.perf_counter() - t1, 2)
    _write_report(report_path, report)  # last: the completion marker
    return result


def _encode_chunked(policy: Policy, turns: list[DemoTurn], chunk: int = 64) -> list[TokenSequence]:
    """:func:`encode_turns` in chunks of ``chunk`` turns (bounded processor memory for a large pool)."""
    return [s for lo in range(0, len(turns), chunk) for s in encode_turns(policy, turns[lo : lo + chunk])]


def _snapshot(policy: Policy, out: Path) -> Path:
    """Write the current weights to ``out`` (PEFT adapter when one is attached, else the full model)."""
    was = policy.model.training
    policy.model.eval()
    try:
        return policy.save_adapter(out) if policy.has_adapter else policy.save_pretrained(out)
    finally:
        policy.model.train(was)


def _greedy_eval(policy: Policy, spec: Any) -> dict[str, Any]:
    from daedalus_trainer.evaluation import evaluate
    from daedalus_trainer.rollout.engine import SamplingParams, TransformersEngine

    engine = TransformersEngine(policy)
    sampling = SamplingParams(temperature=0.0, max_tokens=spec.algorithm.max_tokens_per_turn)
    was = policy.model.training
    try:
        result, _ = evaluate(engine, eval_mazes(spec.environment), spec.environment, sampling, mode="greedy",
                             corners=eval_corners(spec.environment))
    finally:
        policy.model.train(was)
    return result.to_dict()

