"""GRPO's math, pure and small: group-relative advantages and the clipped policy loss.

Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, §4.1): for each prompt (here: a
maze) sample a group of G episodes, score them, and use the reward standardised *within the group* as the advantage
of every token of the episode; no value network. The loss is PPO's clipped surrogate (Schulman et al. 2017,
arXiv:1707.06347) with the rollout policy as the old policy, plus an optional KL penalty to the reference policy with
the k3 estimator (Schulman 2020, "Approximating KL divergence").

Multi-turn: one episode is several turns; the learner sees one sequence per turn (the turn's context window and the
tokens sampled in it). An episode's advantage is broadcast to every assistant token of every one of its turns, and the
"sequence" of the aggregation modes is the episode, so a long episode does not count as many sequences. With
``algorithm.stepAdvantageWeight`` > 0 each turn also gets GiGPO's step-level advantage (:func:`step_advantages`).
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from daedalus_trainer.checkpoint import LoadedCheckpoint

ADVANTAGE_EPS = 1e-6
LOG_RATIO_CLAMP = 20.0  # verl compute_policy_loss: exp() of at most e^20 ~ 4.9e8, never inf in float32
KL_CLAMP = 10.0  # verl kl_penalty("low_var_kl") clamps k3 to 10


def group_advantages(rewards: torch.Tensor, norm: str = "group-std", eps: float = ADVANTAGE_EPS
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages.

    Args:
        rewards: ``[M, G]`` float, episode rewards, one row per group (maze), G episodes each.
        norm: ``"group-std"``: ``(r - mean_g) / (std_g + eps)`` (GRPO, DeepSeekMath eq. in §4.1.2, with the
            population std over the group, ddof 0; TRL and verl use the unbiased one, so their advantages are
            smaller by sqrt((G-1)/G): 0.94 at G=8); ``"none"``: ``r - mean_g`` (Dr. GRPO, Liu et al. 2025,
            arXiv:2503.20783, which drops the std normalisation to remove the difficulty bias).
        eps: added to the std, avoids division by zero.

    Returns:
        ``(advantages [M, G], zero_variance [M] bool)``: groups where every episode got the same reward carry no
        learning signal; their advantages are exactly 0.

    Raises:
        ValueError: ``rewards`` is not 2-D or ``norm`` is unknown.
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [groups, group_size], got shape {tuple(rewards.shape)}")
    mean = rewards.mean(dim=1, keepdim=True)
    centred = rewards - mean
    zero_variance = (rewards == rewards[:, :1]).all(dim=1)
    if norm == "group-std":
        std = rewards.std(dim=1, unbiased=False, keepdim=True)
        adv = centred / (std + eps)
    elif norm == "none":
        adv = centred
    else:
        raise ValueError(f"unknown advantage normalisation {norm!r}; use 'group-std' or 'none'")
    adv = torch.where(zero_variance[:, None], torch.zeros_like(adv), adv)
    return adv, zero_variance


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """Per-turn discounted returns ``R_t = r_t + gamma * R_{t+1}`` of one episode (``R`` past the last turn is 0).

    Args:
        rewards: ``[T]`` the episode's turn rewards (Maze2D: 1.0 on the successful last turn, else 0.0).
        gamma: discount in (0, 1].

    Returns:
        ``[T]`` returns; with Maze2D's sparse reward a successful episode's turn ``t`` returns ``gamma ** (T - 1 - t)``.
    """
    out = [0.0] * len(rewards)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        out[t] = running
    return out


def step_advantages(states: Sequence[Sequence[Hashable | None]], rewards: Sequence[Sequence[float]],
                    group_size: int, gamma: float, norm: str = "group-std", eps: float = ADVANTAGE_EPS
                    ) -> list[list[float]]:
    """Step-level relative advantages of GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent
    Training", arXiv:2505.10978, eq. 6-7).

    Within each episode group (the ``group_size`` episodes on one maze), the turns taken in the same environment
    state (the *anchor state*; Maze2D: the agent's cell) form a step group, however many times and in whichever
    episodes that state was visited. A turn's advantage is its discounted return compared within its step group:
    ``(R - mean) / (std + eps)`` with ``norm="group-std"``, ``R - mean`` with ``"none"``. The std is the population
    std, as in :func:`group_advantages` (verl-agent's GiGPO code uses the unbiased one: +-1 here is +-0.71 there for a
    step group of two). A step group of one turn, or whose returns are all equal, gives 0; so does a turn whose state
    is None.

    With a sparse success reward this is the credit GRPO's episode advantage lacks: at a cell visited by several
    episodes, the move that led to the goal sooner scores higher, also in groups where every episode succeeded
    (whose episode advantages are all 0).

    Args:
        states: ``[E][T_e]`` anchor state of each turn, episodes laid out group by group (episode ``e`` is in group
            ``e // group_size``); any hashable, or None where not recorded.
        rewards: ``[E][T_e]`` each turn's reward.
        group_size: G.
        gamma: discount of :func:`discounted_returns`, in (0, 1].
        norm: ``"group-std"`` or ``"none"``, as :func:`group_advantages`.
        eps: added to the std.

    Returns:
        ``[E][T_e]`` step-level advantages.

    Raises:
        ValueError: mismatched shapes, ``len(states)`` not a multiple of ``group_size``, ``gamma`` outside (0, 1], or
            an unknown ``norm``.
    """
    if len(states) != len(rewards) or any(len(s) != len(r) for s, r in zip(states, rewards)):
        raise ValueError("states and rewards must have the same [episodes][turns] shape")
    if group_size < 1 or len(states) % group_size:
        raise ValueError(f"{len(states)} episodes do not form groups of {group_size}")
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    if norm not in ("group-std", "none"):
        raise ValueError(f"unknown advantage normalisation {norm!r}; use 'group-std' or 'none'")
    returns = [discounted_returns(r, gamma) for r in rewards]
    out = [[0.0] * len(r) for r in rewards]
    members: dict[tuple[int, Hashable], list[tuple[int, int]]] = {}
    for e, episode_states in enumerate(states):
        for t, state in enumerate(episode_states):
            if state is not None:
                members.setdefault((e // group_size, state), []).append((e, t))
    for turns in members.values():
        if len(turns) < 2:
            continue
        # a step group is normalised exactly as an episode group (equal returns: zero variance, advantages 0)
        values = torch.tensor([[returns[e][t] for e, t in turns]], dtype=torch.float64)  # [1, K]
        adv, _ = group_advantages(values, norm, eps)
        for (e, t), a in zip(turns, adv[0].tolist()):
            out[e][t] = a
    return out


@dataclass
class LossStats:
    """Diagnostics of one loss evaluation (floats, detached)."""

    loss: float
    """The aggregated loss."""
    kl: float
    """Mean k3 KL estimate to the reference over assistant tokens (0 without a reference)."""
    clip_fraction: float
    """Fraction of assistant tokens whose ratio was clipped."""
    ratio_mean: float
    """Mean importance ratio pi / pi_old over assistant tokens."""
    tokens: int
    """Number of assistant tokens."""


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    episode_ids: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    aggregation: str = "token-mean",
    num_episodes: int | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Clipped surrogate loss of GRPO over a batch of turn sequences.

    Per assistant token t: ``ratio = exp(logp - logp_old)``,
    ``pg = -min(ratio * A, clip(ratio, 1 - low, 1 + high) * A)``
    (asymmetric "clip-higher" bounds from DAPO, Yu et al. 2025, arXiv:2503.14476), plus ``kl_coef * k3`` with
    ``k3 = exp(ref - logp) - (ref - logp) - 1`` (Schulman's estimator of KL(policy || reference)).

    Overflow guards, as verl's ``compute_policy_loss`` and ``kl_penalty("low_var_kl")``: ``logp - logp_old`` and
    ``ref - logp`` are clamped to [-20, 20] before ``exp`` and k3 to at most 10, so one token far off-policy (with
    ``iterationsPerStep`` or ``miniBatches`` > 1) cannot make the loss or its gradient infinite, which would skip the
    whole mini-batch's update. On-policy (the default: one update per batch) the log-ratio is 0 and neither binds.

    Args:
        logprobs: ``[B, T]`` log-probs of the sampled tokens under the current policy (requires grad).
        old_logprobs: ``[B, T]`` log-probs recorded by the rollout engine (the behaviour policy).
        advantages: ``[B]`` advantage of each row's turn (its episode's advantage, plus the turn's step-level one
            with GiGPO).
        mask: ``[B, T]`` 1 on assistant (sampled) tokens, 0 on prompt, image and padding tokens.
        episode_ids: ``[B]`` long, index of the episode of each row (several rows per multi-turn episode).
        ref_logprobs: ``[B, T]`` reference (SFT start) log-probs, required when ``kl_coef > 0``.
        aggregation: ``"token-mean"``: sum over all assistant tokens / their count (DAPO; the learner divides by
            every token of the step's rollouts, zero-variance groups included, with or without a KL term);
            ``"seq-mean-token-sum"``: per episode the token sum, mean over episodes (Dr. GRPO);
            ``"seq-mean-token-mean"``: per episode the token mean, mean over episodes (original GRPO).
        num_episodes: number of episodes (default ``episode_ids.max() + 1``).

    Returns:
        ``(loss scalar, LossStats)``.

    Raises:
        ValueError: unknown ``aggregation``, shape mismatch, or ``kl_coef > 0`` without ``ref_logprobs``.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(f"shape mismatch: logprobs {tuple(logprobs.shape)}, old {tuple(old_logprobs.shape)}, "
                         f"mask {tuple(mask.shape)}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)[:, None]  # [B, 1]
    log_ratio = torch.clamp((logprobs - old_logprobs) * mask, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high) * adv
    per_token = -torch.minimum(unclipped, clipped)  # [B, T]
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None:
        delta = torch.clamp((ref_logprobs - logprobs) * mask, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = torch.clamp(torch.exp(delta) - delta - 1.0, max=KL_CLAMP)
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl
    per_token = per_token * mask

    n_tokens = mask.sum()
    if aggregation == "token-mean":
        loss = per_token.sum() / n_tokens.clamp(min=1)
    elif aggregation in ("seq-mean-token-sum", "seq-mean-token-mean"):
        n_ep = int(num_episodes if num_episodes is not None else int(episode_ids.max()) + 1)
        ep_sum = torch.zeros(n_ep, dtype=per_token.dtype, device=per_token.device)
        ep_sum = ep_sum.index_add(0, episode_ids, per_token.sum(dim=1))
        if aggregation == "seq-mean-token-mean":
            ep_tokens = torch.zeros(n_ep, dtype=mask.dtype, device=mask.device).index_add(0, episode_ids, mask.sum(1))
            ep_sum = ep_sum / ep_tokens.clamp(min=1)
        loss = ep_sum.mean()
    else:
        raise ValueError(f"unknown loss aggregation {aggregation!r}; use token-mean, seq-mean-token-sum or "
                         "seq-mean-token-mean")

    with torch.no_grad():
        denom = float(n_tokens.clamp(min=1))
        was_clipped = ((ratio < 1.0 - clip_ratio_low) & (adv < 0)) | ((ratio > 1.0 + clip_ratio_high) & (adv > 0))
        stats = LossStats(
            loss=float(loss.detach()),
            kl=float((kl * mask).sum() / denom),
            clip_fraction=float((was_clipped.to(mask.dtype) * mask).sum() / denom),
            ratio_mean=float((ratio * mask).sum() / denom),
            tokens=int(n_tokens),
        )
    return loss, stats


# ------------------------------------------------------------------------------------------------------ the loop
# sample -> rollout -> reward -> advantage -> loss -> step -> publish adapter -> checkpoint -> log

log = logging.getLogger("daedalus.grpo")

#: How often (seconds) a held-out evaluation in progress looks for a checkpoint or stop request to answer.
EVAL_POLL_SECONDS = 0.2

#: Share of unparseable replies in a step above which the trainer warns that the action format has collapsed.
FORMAT_COLLAPSE_RATIO = 0.5


def learning_rate_at(algo: Any, step: int) -> float:
    """The learning rate of GRPO step ``step`` (1-based, ``1 <= step <= algo.steps``) under ``algo.lr_schedule``.

    ``constant``: ``algo.learning_rate``. ``cosine``: ``lr * (1 + cos(pi * (step - 1) / steps)) / 2``, i.e. ``lr`` at
    step 1, ``lr / 2`` halfway and close to 0 at the last step (SGDR without restarts, Loshchilov & Hutter 2017,
    arXiv:1608.03983). A step beyond ``steps`` (a run whose ``steps`` was lowered) gets 0.

    Raises:
        ValueError: ``step < 1`` or an unknown schedule.
    """
    if step < 1:
        raise ValueError(f"GRPO steps are numbered from 1, got {step}")
    if algo.lr_schedule == "constant":
        return float(algo.learning_rate)
    if algo.lr_schedule == "cosine":
        progress = min(1.0, (step - 1) / algo.steps)
        return float(algo.learning_rate) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lrSchedule {algo.lr_schedule!r}")


def step_seed(seed: int, step: int, part: int = 0) -> int:
    """Deterministic 31-bit seed for (run seed, step, part).

    A resumed run draws the same mazes whatever its actor layout, and the same tokens when it has as many rollout
    workers as the run it continues (each worker's batch is sampled under its own seed ``part``;
    :meth:`Trainer.train` warns when the count changed)."""
    import numpy as np

    return int(np.random.SeedSequence([seed, step, part]).generate_state(1, dtype=np.uint32)[0] >> 1)


@dataclass
class TrainResult:
    """How a :func:`train` call ended."""

    steps_done: int
    """Completed GRPO steps (including those before a resume)."""
    resumed_from: int | None
    """Step of the checkpoint the run resumed from, if any."""
    latest_checkpoint: Any
    """The last checkpoint written or loaded (``CheckpointInfo``-like), if any."""
    adapter_dir: Path | None
    """Exported adapter (``exports/adapter``) when the run finished."""
    history: list[dict[str, Any]]
    """One dict of step metrics per completed step, oldest first (including those before a resume)."""
    stopped: bool
    """True when a stop was requested (``POST /stop``) before the last step."""
    wall_seconds: float
    """Duration of this call."""


class CheckpointWriter:
    """Writes a trainer's checkpoints on one background thread, in step order, one at a time.

    :meth:`save` asks the learner actor for its state (``learner.checkpoint_state.remote(packed=True)``: adapter
    tensors, adapter config and optimizer ``state_dict``, tensors as byte views,
    :class:`~daedalus_trainer.checkpoint.PackedTensor`), waits for a previous write that is still running, and queues
    the rest on the writer thread: fetching that state (``ray.get``, which maps it without copying), unpacking it and
    :meth:`CheckpointManager.save <daedalus_trainer.checkpoint.CheckpointManager.save>`. The snapshot is exact: an
    actor runs its tasks one at a time and Ray copies a task's return value into the object store when the task
    returns, so the learner's next ``update`` cannot change what is saved. The caller goes on at once; the learner is
    busy only for that one copy (its next task, the next step's adapter publication, waits for it), and the files'
    write and fsync overlap the next step (``bench/checkpoint.py`` measures the stall).

    Args:
        manager: the job's :class:`~daedalus_trainer.checkpoint.CheckpointManager`.
        on_done: called in the writer thread with each committed ``CheckpointInfo``.
        on_failed: called in the writer thread with ``(step, exception)`` when a write fails
            (:class:`~daedalus_trainer.checkpoint.CheckpointSaveError`; the previous checkpoint is intact).
        latest: the checkpoint the run resumed from, if any (what :meth:`settle` returns until a write commits).
    """

    def __init__(self, manager, on_done: Callable[[Any], None] | None = None,
                 on_failed: Callable[[int, Exception], None] | None = None, latest: Any = None):
        self.manager = manager
        self.latest = latest
        self._on_done = on_done
        self._on_failed = on_failed
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="daedalus-checkpoint")
        self._pending: list[Future] = []

    def _write(self, step: int, state_ref, trainer_state) -> Any:
        import ray

        from daedalus_trainer.checkpoint import AdapterState, CheckpointSaveError, unpack_tensors

        adapter, config, optimizer_state = ray.get(state_ref)
        adapter, optimizer_state = unpack_tensors(adapter), unpack_tensors(optimizer_state)
        try:
            info = self.manager.save(step, AdapterState(adapter, config), optimizer_state, trainer_state)
        except CheckpointSaveError as exc:
            if self._on_failed:
                self._on_failed(step, exc)
            raise
        if self._on_done:
            self._on_done(info)
        return info

    def save(self, step: int, learner, trainer_state) -> None:
        """Snapshot ``learner``'s state (a Ray actor handle of :class:`~daedalus_trainer.actors.Learner`) and queue
        its checkpoint at ``step`` with ``trainer_state``; returns once the write is queued, not written. A learner
        that died before returning its state fails the next :meth:`settle` with Ray's error."""
        state_ref = learner.checkpoint_state.remote(packed=True)  # ordered before any later task of the learner
        self.settle()
        self._pending.append(self._writer.submit(self._write, step, state_ref, trainer_state))

    def settle(self, final: bool = False) -> Any:
        """Wait for the queued writes; return the newest committed ``CheckpointInfo`` (or the resume point).

        Raises:
            daedalus_trainer.checkpoint.CheckpointSaveError: a write failed and ``final`` is set (a failed
                intermediate write is reported through ``on_failed`` and otherwise skipped).
            ray.exceptions.RayError: the learner failed or died before returning its state.
        """
        from daedalus_trainer.checkpoint import CheckpointSaveError

        while self._pending:
            future = self._pending.pop(0)
            try:
                self.latest = future.result()
            except CheckpointSaveError:
                if final:
                    raise
        return self.latest

    def close(self) -> Any:
        """:meth:`settle` ``(final=True)`` and stop the writer thread; return the newest checkpoint."""
        try:
            return self.settle(final=True)
        finally:
            self._writer.shutdown(wait=True)


#: The last line of a Python traceback: ``"<dotted.ExceptionType>: <message>"``.
_TRACEBACK_LAST = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Unavailable|Interrupt|Exit)): (.+)$")
#: ANSI colour escapes, which Ray puts in the messages of its wrappers when stderr is a terminal.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def failure_reason(exc: BaseException) -> str:
    """One line saying why training failed: ``"<ExceptionType>: <first line of its message>"`` (``/status``'s
    ``failureReason``, the 409 answer to a waiting ``POST /checkpoint``).

    Ray wraps what an actor raises: a method's exception arrives as ``RayTaskError(<Type>)`` whose first line is
    only Ray's header (``ray::Learner.update() (pid=..., ip=...)``), so its ``cause`` (the actor's exception) is
    described instead; an exception in an actor's ``__init__`` arrives as ``ActorDiedError`` whose message embeds the
    creation task's traceback, so that traceback's last ``"<Type>: <message>"`` line is used (e.g.
    ``"RolloutEngineUnavailable: algorithm.rolloutEngine is vllm but ..."``). Other exceptions, and a wrapper
    without either, as :func:`~daedalus_trainer.checkpoint.error_reason`. Never raises.
    """
    from daedalus_trainer.checkpoint import error_reason

    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and type(exc).__name__.startswith("RayTaskError"):
        return failure_reason(cause)
    if type(exc).__name__ in ("RayActorError", "ActorDiedError"):
        lines = [_ANSI.sub("", line).strip() for line in str(exc).splitlines()]
        found = [m for m in map(_TRACEBACK_LAST.match, lines) if m]
        if found:
            name, message = found[-1].groups()
            return f"{type(exc).__name__}: {name.rsplit('.', 1)[-1]}: {message.rstrip('.')}"
    return f"{type(exc).__name__}: {_ANSI.sub('', error_reason(exc))}"


class Trainer:
    """Runs GRPO for one job: Ray actors for rollouts and learning, checkpoints, metrics and the control endpoint.

    Args:
        job: the RLTrainingJob.
        run_dir: job directory holding ``checkpoints/`` and ``exports/`` (on a cluster
            ``<checkpoint.path>/<namespace>/<name>``).
        start_dir: SFT starting point (full model or PEFT adapter dir); default ``job.spec.model.sft_adapter``.
        work_dir: where the tiny base model is built (default ``run_dir``).
        rollout_workers: number of rollout actors (default: ``algorithm.rolloutWorkers``, whose 0 is 2 on CPU,
            one per GPU the learner leaves; :func:`actor_layout`).
        control / metrics: shared with the HTTP endpoint (:mod:`daedalus_trainer.server`); created if None.
        on_step: called with each step's metrics dict (progress bars).
        on_resume: called with the step of the checkpoint the run resumes from, before its first new step (a
            progress bar then starts there, not at 0).
        final_eval: evaluate the final adapter greedily on the held-out mazes (``daedalus_eval_success_ratio``).
    """

    def __init__(self, job, run_dir: str | Path, *, start_dir: str | None = None, work_dir: str | Path | None = None,
                 rollout_workers: int | None = None, control=None, metrics=None,
                 on_step: Callable[[dict[str, Any]], None] | None = None,
                 on_resume: Callable[[int], None] | None = None, final_eval: bool = True):
        from daedalus_trainer.metrics import TrainerMetrics
        from daedalus_trainer.server import ControlState

        self.job = job
        self.run_dir = Path(run_dir)
        self.start_dir = start_dir if start_dir is not None else job.spec.model.sft_adapter
        self.work_dir = Path(work_dir) if work_dir else self.run_dir
        self.rollout_workers = rollout_workers or job.spec.algorithm.rollout_workers or None
        algo = job.spec.algorithm
        self.control = control or ControlState(total_steps=algo.steps)
        self.metrics = metrics or TrainerMetrics(job.metadata.name, job.metadata.namespace, total_steps=algo.steps,
                                                 checkpoint_interval=job.spec.checkpoint.interval_steps)
        self.on_step = on_step
        self.on_resume = on_resume
        self.final_eval = final_eval
        self.final_eval_success: float | None = None

    # -- set-up ----------------------------------------------------------------------------------------------------
    def _actors(self):
        import ray

        from daedalus_trainer.actors import Learner, RolloutWorker

        layout = actor_layout(_gpus_available(), self.rollout_workers)
        check_layout_fits(layout, ray.cluster_resources())
        job = self.job.model_dump(by_alias=True, mode="json")
        share = float(layout.worker.get("num_gpus", 0.0))
        learner_cls, worker_cls = ray.remote(Learner), ray.remote(RolloutWorker)

        def learner() -> Any:
            return learner_cls.options(**layout.learner).remote(job, self.start_dir, str(self.work_dir))

        def worker() -> Any:
            return worker_cls.options(**layout.worker).remote(job, self.start_dir, str(self.work_dir), gpu_share=share)

        # On a shared GPU the learner loads its weights before the first vLLM engine profiles memory, and each
        # engine profiles before the next starts (start_actors); on CPU, or a GPU per actor, all start at once.
        handles = start_actors([(learner, lambda a: a.adapter_config.remote())]
                               + [(worker, lambda a: a.engine_name.remote())] * layout.workers,
                               sequential=layout.shares_gpus)
        if layout.shares_gpus:
            log.info("started the learner and %d rollout workers one at a time (they share GPUs)", layout.workers)
        return handles[0], handles[1:]

    def train(self, resume: str | LoadedCheckpoint = "latest") -> TrainResult:
        """Run from the checkpoint ``resume`` names (``latest`` | ``none`` | a checkpoint path) to ``algorithm.steps``.

        ``resume`` may also be a checkpoint the caller has already read and verified
        (:func:`~daedalus_trainer.checkpoint.resolve_resume`, as ``daedalus train`` and ``daedalus run`` do for a
        ``--resume PATH`` before Ray starts): it is used as it is, not hashed a second time.

        A checkpoint or stop requested through :attr:`control` (``POST /checkpoint``, ``POST /stop``) is written at
        the end of the step it reaches; when that step's held-out evaluation (``algorithm.evalIntervalSteps``) is
        due, before the evaluation, so the caller does not wait for it; a stop then skips it, and the run resuming
        from that checkpoint evaluates first, so the metric history equals an uninterrupted run's (:meth:`_train`).
        A stop already requested when a resumed run with steps left is about to start its actors is answered by the
        checkpoint resumed from, and the run returns stopped without starting any (:meth:`_without_actors`).

        Raises:
            daedalus_trainer.checkpoint.CheckpointCorruptError: the checkpoint to resume from fails verification
                (for ``latest``: checkpoints exist but none verifies), or the final one does at export.
            daedalus_trainer.checkpoint.CheckpointError: ``resume`` is a path that does not exist or holds no
                checkpoint, or the checkpoint's LoRA adapter differs from this job's (:func:`check_adapter_matches`).
            daedalus_trainer.checkpoint.CheckpointSaveError: the last queued checkpoint write failed (an earlier
                failed write is only reported through the control state).
            daedalus_trainer.layouts.LayoutError: the evaluation set cannot be held out as configured, or no
                training maze was found.
            ray.exceptions.RayError: an actor failed: ``RayActorError`` when it died, ``RayTaskError`` wrapping
                what one of its methods raised (the caller's process exits non-zero; the operator resubmits).

        Whatever it raises (``KeyboardInterrupt`` included), the control phase is set to ``failed`` with
        ``failureReason`` (:func:`failure_reason`: ``"<ExceptionType>: <first line of its message>"``, that of the
        exception an actor raised for Ray's wrappers) first, once the queued checkpoint
        writes have landed: a ``POST /checkpoint`` or ``/stop`` waiting on :attr:`control` is answered 409 with that
        reason at once, on a cluster (``daedalus train``) as in a local run (``daedalus run``).
        """
        started = time.perf_counter()
        self.control.set_status(phase="starting", total_steps=self.job.spec.algorithm.steps)
        try:
            return self._start_and_train(resume, started)
        except BaseException as exc:
            # Before the exception leaves: a POST /checkpoint or /stop waiting on the control state gets 409 with
            # the reason now, rather than its timeout (504), and /status says why.
            self.control.set_status(phase="failed", failure_reason=failure_reason(exc))
            raise

    def _start_and_train(self, resume: str | LoadedCheckpoint, started: float) -> TrainResult:
        """:meth:`train` but for its failure handling: resume, start the actors, run :meth:`_train`, kill them."""
        import ray

        from daedalus_trainer.checkpoint import CheckpointManager
        from daedalus_trainer.layouts import TrainingSampler

        job, algo, ck = self.job, self.job.spec.algorithm, self.job.spec.checkpoint
        manager = CheckpointManager(self.run_dir / "checkpoints", keep=ck.keep)
        sampler = TrainingSampler.for_env(job.spec.environment, seed=algo.seed)
        if not self.start_dir:
            # Build the tiny base once, here, before actors race to build it in the same directory.
            from daedalus_trainer.policy import resolve_base_dir

            resolve_base_dir(job.spec.model, self.work_dir)
        # before the actors start: a bad --resume fails in a second, not minutes
        loaded = manager.resume(resume)
        identity = run_identity(job, self.start_dir)
        if loaded is not None:
            check_adapter_matches(loaded.load_adapter_config(), self._expected_adapter(), loaded.path)
            check_same_run(loaded.trainer_state.extra.get("identity"), identity, loaded.path)
        self._identity = identity
        manager.abandon_other_timelines(loaded)  # only once nothing can refuse the run any more
        if self.nothing_to_train(loaded):
            return self._without_actors(loaded, started, stopped=False)
        if loaded is not None and loaded.step < self.job.spec.algorithm.steps and self.control.stop_requested():
            return self._without_actors(loaded, started, stopped=True)
        learner, workers = self._actors()
        try:
            return self._train(manager, loaded, sampler, learner, workers, started)
        finally:  # also when the loop raises: an in-process caller's next Trainer needs the CPUs back
            for actor in [learner, *workers]:
                ray.kill(actor)

    def nothing_to_train(self, loaded: LoadedCheckpoint | None) -> bool:
        """Whether a run resumed from ``loaded`` needs no actor, and so no Ray: ``loaded`` is the checkpoint of the
        last step (``algorithm.steps``, or a later one after ``steps`` was lowered) and this trainer runs no final
        evaluation (``daedalus run`` evaluates after training itself; ``daedalus train`` evaluates the final adapter
        again, on its actors). :meth:`train` then returns at once instead of starting the actors (13-16 s on an
        idle 2-core machine, measured in session 30) to run no step, and ``daedalus run`` leaves its local Ray
        unstarted (another ~6 s there)."""
        return loaded is not None and loaded.step >= self.job.spec.algorithm.steps and not self.final_eval

    def _without_actors(self, loaded: LoadedCheckpoint, started: float, *, stopped: bool) -> TrainResult:
        """:meth:`train` of a resumed run that needs no actor: what the step loop reports for a resume that runs no
        step (status, metrics, ``on_resume``, a waiting request answered by the checkpoint resumed from), no actor
        started. Two cases:

        - ``stopped=False``: :meth:`nothing_to_train`; the adapter is exported again (verified against the
          manifest; a copy, milliseconds) and the run is ``finished``.
        - ``stopped=True``: a resumed run with steps left whose stop (``POST /stop``: a node replacement, a suspend)
          came in before its actors started. The checkpoint resumed from answers the stop (the state to save is that
          one) and the run returns ``stopped``. Starting the actors first would keep the caller waiting while every
          one imports torch and loads the model (13-16 s on an idle 2-core machine, measured in session 30), only to
          stop at the first step boundary with the same answer. A due evaluation left pending by that checkpoint
          stays pending: the next resume runs it. (A resume at the last step with a final evaluation to run goes
          through the step loop: a stop there abandons the evaluation, and the run still exports its adapter.)
        """
        from daedalus_trainer.checkpoint import export_adapter

        info = loaded.info
        self._announce_resume(loaded, ": stopped before the actors started" if stopped
                              else ": the run's last step, nothing left to train")
        adapter_dir = None
        if not stopped:
            adapter_dir = export_adapter(info, self.run_dir / "exports" / "adapter")
            self.control.set_status(adapter_path=adapter_dir)
        if self.control.checkpoint_requested():  # a stop is one
            self.control.checkpoint_done(info)
        self.control.set_status(phase="stopped" if stopped else "finished")
        return TrainResult(info.step, info.step, info, adapter_dir, list(loaded.trainer_state.metric_history), stopped,
                           time.perf_counter() - started)

    def _announce_resume(self, loaded: LoadedCheckpoint, why: str = "") -> None:
        """Make a resume from ``loaded`` known: ``/status`` (step, latest checkpoint, resumedFrom), the step and
        checkpoint metrics, a log line (``why`` appended), and ``on_resume``."""
        self.control.set_status(step=loaded.step, latest_checkpoint=loaded.info, resumed_from=loaded.step)
        self.metrics.set_step(loaded.step)
        self.metrics.set_latest_checkpoint(loaded.info)
        log.info("resumed from %s (step %d)%s", loaded.path, loaded.step, why)
        if self.on_resume:
            self.on_resume(loaded.step)

    def _expected_adapter(self) -> dict[str, Any]:
        """The :func:`~daedalus_trainer.policy.adapter_signature` of the adapter this run trains: the SFT adapter's
        own when the start is a PEFT adapter (GRPO trains it further), else ``spec.lora``'s (a fresh adapter)."""
        from daedalus_trainer.policy import adapter_signature, is_adapter_dir, read_adapter_config

        return adapter_signature(read_adapter_config(self.start_dir) if is_adapter_dir(self.start_dir)
                                 else self.job.spec.lora)

    def _train(self, manager, loaded, sampler, learner, workers, started: float) -> TrainResult:
        """The step loop of :meth:`train` on started actors (which the caller kills).

        At the end of step ``s``: the held-out evaluation when it is due (:meth:`_eval_due`), ``on_step``, then the
        checkpoint on the interval, at the last step, or on request. A checkpoint or stop requested by then at a step
        whose evaluation is due is written first (committed, and its callers answered, before the evaluation
        starts: the operator's wait is bounded by ``resilience.checkpointTimeoutSeconds``); a stop then skips the
        evaluation. One requested during the evaluation is written and answered at once (the learner is idle while
        the rollout workers evaluate), and a stop then abandons the evaluation. Such a checkpoint's history lacks the
        step's ``eval_success_ratio`` and its ``TrainerState.extra["eval_pending_step"]`` is ``s``: a run resuming
        from it evaluates step ``s``'s adapter first (greedy on the fixed held-out mazes, the same episodes in the
        same batches: on CPU the same ratio as the uninterrupted run) and fills it in, unless a stop is already waiting or the evaluation is no longer due
        under the resumed job's ``evalIntervalSteps``/``steps``. A periodic checkpoint still follows the evaluation: a
        step saved before it on request that is also on the interval (or gets a stop during the evaluation) is
        written again with the ratio.
        """
        import ray

        from daedalus_trainer.checkpoint import TrainerState, capture_rng_state, export_adapter
        from daedalus_trainer.metrics import StepStats

        algo, ck = self.job.spec.algorithm, self.job.spec.checkpoint
        # Each worker chose its engine as it started (algorithm.rolloutEngine; RolloutEngineUnavailable fails the
        # actor's creation, and so this call, before any step). One name when they agree, else one per worker.
        engines = ray.get([w.engine_name.remote() for w in workers])
        rollout_engine: str | list[str] = engines[0] if len(set(engines)) == 1 else engines
        log.info("rollout engine: %s (%d workers)", rollout_engine, len(workers))

        history: list[dict[str, Any]] = []
        step = 0
        latest = None
        if loaded is not None:
            ray.get(learner.restore.remote(loaded.load_adapter_tensors(), loaded.load_optimizer_state()))
            history = list(loaded.trainer_state.metric_history)
            step = loaded.step
            latest = loaded.info
            self._announce_resume(loaded)
            before = loaded.trainer_state.extra.get("rollout_workers")
            if before is not None and before != len(workers):
                log.warning("resumed with %d rollout workers where the checkpoint's run had %s: the mazes of every "
                            "step are the same, the sampled tokens are not (each worker samples its batch under its "
                            "own seed), so the run continues, but not bit-for-bit", len(workers), before)
            before_engine = loaded.trainer_state.extra.get("rollout_engine")
            if before_engine is not None and before_engine != rollout_engine:
                log.warning("resumed with the %s rollout engine where the checkpoint's run used %s: both sample the "
                            "same policy, with other random draws, so the run continues, but not bit-for-bit",
                            rollout_engine, before_engine)
        resumed_from = step if loaded is not None else None
        pending_eval = loaded.trainer_state.extra.get("eval_pending_step") if loaded is not None else None

        # The requests each queued save answers: those received before it was queued (a request that arrives while
        # an older save is still being written waits for the next one, which holds the state it asked for).
        covers: dict[int, int] = {}

        def on_done(info) -> None:
            self.metrics.observe_checkpoint(info)
            self.control.checkpoint_done(info, upto=covers.pop(info.step, None))
            self.control.set_status(latest_checkpoint=info)
            log.info("checkpoint step %d written to %s (%.2f s, %d bytes)", info.step, info.path, info.seconds,
                     info.bytes)

        def on_failed(step_now: int, exc: Exception) -> None:
            # The previous checkpoint is intact; training goes on and the stale-checkpoint alert fires.
            log.error("checkpoint at step %d failed, previous checkpoint kept: %s", step_now, exc)
            self.control.checkpoint_failed(str(exc), upto=covers.pop(step_now, None))

        checkpointer = CheckpointWriter(manager, on_done=on_done, on_failed=on_failed, latest=latest)

        def save(step_now: int, wait: bool = False) -> None:
            nonlocal saved_step
            # Every random draw comes from per-step seeds (mazes: (seed, step, index); sampling: step_seed), so the
            # sampler state is the step; the global RNG states are recorded for completeness.
            extra = {"rollout_workers": len(workers), "rollout_engine": rollout_engine, "identity": self._identity}
            if self._eval_due(step_now) and history and history[-1]["step"] == step_now \
                    and "eval_success_ratio" not in history[-1]:
                extra["eval_pending_step"] = step_now  # written before its due evaluation: a resume runs it
            # The records are copied: the writer thread serialises them after this returns, and a ratio added to
            # a live record later (its step's evaluation, after a save on request) must not reach the file.
            state = TrainerState(sampler={"seed": algo.seed, "next_step": step_now}, rng=capture_rng_state(),
                                 metric_history=[dict(h) for h in history], extra=extra)
            covers[step_now] = self.control.request_seq()
            checkpointer.save(step_now, learner, state)
            saved_step = step_now
            if wait:  # a failed write was reported through on_failed (its callers get 500); training goes on
                checkpointer.settle()

        def answer_or_save(step_now: int, durable: bool) -> None:
            # This step was saved before its evaluation; a request that came in since is answered by that
            # checkpoint (the learner has not changed), or, if its write failed, by a new one. When the evaluation
            # has run since and the step's checkpoint is the one a resume will start from (``durable``: the
            # interval's, the last step's, a stop's), it is written again with the ratio: a resume from the
            # pre-evaluation one would run the evaluation (minutes on a GPU model) a second time.
            committed = checkpointer.settle()
            evaluated = "eval_success_ratio" in history[-1]
            if committed is not None and committed.step == step_now and not (durable and evaluated):
                self.control.checkpoint_done(committed)
            else:
                save(step_now)

        def answer_during_eval(step_now: int) -> bool:
            # A checkpoint or stop requested while step ``step_now``'s evaluation runs on the rollout workers (the
            # learner is idle): written now (with the evaluation pending) and answered, or answered by the step's
            # checkpoint already written; a stop then abandons the evaluation (a resume runs it).
            if saved_step == step_now:
                answer_or_save(step_now, durable=False)
            else:
                save(step_now, wait=True)
            return self.control.stop_requested()

        def answer_with(ckpt: Any) -> bool:
            # A request that came while an evaluation runs whose adapter is checkpoint ``ckpt``'s (the one resumed
            # from, or the last step's): answered by it at once. A stop abandons the evaluation: the resumed-from
            # checkpoint still records it as pending, and a resume at the last step evaluates again.
            if ckpt is not None:
                self.control.checkpoint_done(ckpt)
            return self.control.stop_requested()

        saved_step = step if loaded is not None else -1
        if (pending_eval == step and self._eval_due(step) and history and history[-1]["step"] == step
                and "eval_success_ratio" not in history[-1] and not self.control.stop_requested()):
            # The checkpoint was written before its step's due evaluation (on request, or before a stop): evaluate
            # the same adapter now, so the history is the uninterrupted run's. A checkpoint request already waiting
            # is answered first, by the checkpoint resumed from (the learner's state is that one).
            if self.control.checkpoint_requested():
                self.control.checkpoint_done(latest)
            ratio = self._evaluate(learner, workers, step, on_request=lambda: answer_with(latest))
            if ratio is not None:
                history[-1] = {**history[-1], "eval_success_ratio": ratio}
                if self.control.unanswered():  # one that came in as the evaluation ended: the same answer
                    answer_with(latest)
        self.control.set_status(phase="training", step=step)
        stopped = False
        silent_said = False
        # every step so far (the resumed history's too) had the format collapse ratio: the start never wrote it
        never_formatted = all(h.get("parse_error_ratio", 0.0) >= FORMAT_COLLAPSE_RATIO for h in history)
        try:
            while step < algo.steps:
                if self.control.stop_requested():
                    if saved_step != step:
                        save(step)  # a stop that arrived after the end-of-step check still gets its checkpoint
                    stopped = True
                    break
                # sample: M mazes for this step, G episodes on each (the same maze within a group)
                t0 = time.perf_counter()
                mazes = sampler.mazes(step, algo.mazes_per_step)
                episodes = [m for m in mazes for _ in range(algo.group_size)]
                # rollout with the current adapter (version = steps trained so far)
                adapter_ref = learner.adapter_state.remote(packed=True)
                parts = _split(episodes, len(workers))
                futures = [w.rollout.remote(part, step_seed(algo.seed, step, i), adapter_ref, step)
                           for i, (w, part) in enumerate(zip(workers, parts)) if part]
                trajectories = [t for chunk in ray.get(futures) for t in chunk]
                rollout_seconds = time.perf_counter() - t0
                # reward -> advantage -> loss -> optimizer step (on the learner)
                update = ray.get(learner.update.remote(trajectories, algo.group_size, step + 1))
                step += 1
                record = _step_record(step, trajectories, update, rollout_seconds)
                history.append(record)
                never_formatted = never_formatted and record["parse_error_ratio"] >= FORMAT_COLLAPSE_RATIO
                if record["parse_error_ratio"] >= FORMAT_COLLAPSE_RATIO:
                    # Measured on the tiny model: lr 3e-3 took parse errors from 0% to 99.7% in two steps; once every
                    # reply is unparseable every group has equal rewards and GRPO cannot recover on its own. A policy
                    # that never had the format (a random or base model without SFT) gets other advice.
                    if never_formatted:
                        log.warning("step %d: %.0f%% of replies could not be parsed, as in every step so far: the "
                                    "starting point does not write the action format (environment.actionFormat %r); "
                                    "start GRPO from a supervised checkpoint trained on that format (model.sftAdapter; "
                                    "`daedalus run` trains one for a tiny model)", step,
                                    100 * record["parse_error_ratio"], self.job.spec.environment.action_format)
                    else:
                        log.warning("step %d: %.0f%% of replies could not be parsed: the action format has collapsed; "
                                    "resume from an earlier checkpoint with a lower algorithm.learningRate or a "
                                    "klCoef > 0", step, 100 * record["parse_error_ratio"])
                if (record["zero_variance_groups"] == algo.mazes_per_step and not algo.step_advantage_weight
                        and not silent_said):
                    # GRPO's advantage is zero in a group whose episodes got equal rewards: a step where every group
                    # is so has nothing to learn from (without a KL term, an adapter byte-identical to the last). Turn-
                    # level advantages (stepAdvantageWeight > 0) still train such groups. Said once per process.
                    silent_said = True
                    log.warning("step %d: in every group all %d episodes got the same reward (success %.0f%%): no "
                                "learning signal from the rewards; GRPO needs groups with both outcomes "
                                "(a stronger SFT start, larger algorithm.groupSize, or easier mazes). Said once; "
                                "the summary counts such steps", step, algo.group_size,
                                100 * record["success_ratio"])
                self.metrics.observe_step(StepStats(
                    step=step, success_ratio=record["success_ratio"], reward_mean=record["reward_mean"],
                    episode_turns=record["episode_turns"], rollout_tokens=record["rollout_tokens"],
                    zero_variance_groups=record["zero_variance_groups"], rollout_seconds=rollout_seconds,
                    learner_seconds=update.seconds, kl=update.kl, loss=update.loss, grad_norm=update.grad_norm))
                self.control.set_status(step=step, success_ratio=record["success_ratio"],
                                        reward_mean=record["reward_mean"])
                if self._eval_due(step):
                    if self.control.checkpoint_requested():
                        # The operator's checkpoint (before a node replacement) or stop (suspend, deletion) does not
                        # wait for the evaluation (minutes on a GPU model): committed and answered before it.
                        save(step, wait=True)
                    if not self.control.stop_requested():
                        ratio = self._evaluate(learner, workers, step, on_request=lambda: answer_during_eval(step))
                        if ratio is not None:  # None: a stop came in during it, after this step's checkpoint
                            record["eval_success_ratio"] = ratio
                if self.on_step:
                    self.on_step(record)
                # checkpoint on the interval, on request (operator before a node replacement), at the end, before a stop
                if (step % ck.interval_steps == 0 or step == algo.steps or self.control.checkpoint_requested()
                        or self.control.stop_requested()):
                    if saved_step == step:  # saved before the evaluation; a request may have come in since
                        answer_or_save(step, durable=step % ck.interval_steps == 0 or step == algo.steps
                                       or self.control.stop_requested())
                    else:
                        save(step)
            if not stopped and self.control.checkpoint_requested() and saved_step != step:
                save(step)  # a request that arrived after the last step
        except BaseException:
            checkpointer.close()  # what was queued still lands; the previous checkpoint stays intact
            raise
        latest = checkpointer.close()  # the last checkpoint must be on disk before exporting or exiting
        if not stopped and self.final_eval and step == algo.steps:
            # A stop during the final evaluation (the operator then ends the Ray job) abandons it; the adapter is
            # still exported below (a copy, milliseconds).
            final = latest if latest is not None and latest.step == step else None
            self.final_eval_success = self._evaluate(learner, workers, step, on_request=lambda: answer_with(final))
        adapter_dir = None
        if not stopped and latest is not None:
            adapter_dir = export_adapter(latest, self.run_dir / "exports" / "adapter")
            self.control.set_status(adapter_path=adapter_dir)
        if latest is not None and latest.step == step and self.control.checkpoint_requested():
            # asked for a checkpoint of a step that already has one (a stop right after a resume, a request after
            # the final save): that checkpoint is the answer, not the "stopped before it was written" error
            self.control.checkpoint_done(latest)
        self.control.set_status(phase="stopped" if stopped else "finished")
        return TrainResult(step, resumed_from, latest, adapter_dir, history, stopped, time.perf_counter() - started)

    def _eval_due(self, step: int) -> bool:
        """Whether a held-out evaluation follows step ``step`` (1-based): every ``algorithm.evalIntervalSteps``
        steps, but not after the last one (``final_eval`` covers it)."""
        algo = self.job.spec.algorithm
        return bool(algo.eval_interval_steps) and step % algo.eval_interval_steps == 0 and step < algo.steps

    def _evaluate(self, learner, workers, step: int,
                  on_request: Callable[[], bool] | None = None) -> float | None:
        """Greedy success ratio of the current adapter on the held-out mazes (``environment.evalMazes`` x
        ``evalCorners`` episodes), spread over the rollout workers; ``None`` when abandoned.

        While the workers evaluate (minutes for a GPU model), the learner is idle and the step's state is final, so a
        checkpoint or stop requested meanwhile need not wait: the loop checks every :data:`EVAL_POLL_SECONDS` for a
        request no checkpoint has answered yet (:meth:`ControlState.unanswered`) and calls ``on_request``, which
        answers it (writing a checkpoint if need be) and returns True to abandon the evaluation (a stop: the
        workers' tasks are left to the caller, which kills the actors) or False to go on.
        """
        import ray

        from daedalus_trainer.layouts import eval_mazes

        self.control.set_status(phase="evaluating")
        mazes = eval_mazes(self.job.spec.environment)
        adapter_ref = learner.adapter_state.remote(packed=True)
        parts = _split(mazes, len(workers))
        futures = [w.evaluate.remote(p, adapter_ref, step) for w, p in zip(workers, parts) if p]
        waiting = list(futures)
        while waiting:
            _, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=EVAL_POLL_SECONDS)
            # (once every result is in, a request is left to the step's end: the evaluation is not thrown away)
            if waiting and on_request is not None and self.control.unanswered() and on_request():
                self.control.set_status(phase="training")
                log.info("held-out evaluation at step %d abandoned for a stop (a resume runs it)", step)
                return None
        wins = [ok for chunk in ray.get(futures) for ok in chunk]
        ratio = sum(wins) / len(wins)
        self.metrics.observe_eval(ratio)
        self.control.set_status(phase="training")
        log.info("held-out greedy success at step %d: %.3f (%d episodes)", step, ratio, len(wins))
        return ratio


#: ``algorithm`` fields a GRPO run may change and still continue from its checkpoint (:func:`check_same_run`): its
#: length (a raised ``steps`` trains on; the cosine schedule then follows the new length), the cadence of its
#: held-out evaluations, and the rollout engine: both engines sample the same policy with the log-probs the learner
#: computes (vLLM only with ``topP`` 1, which the API enforces), so a checkpoint continues under either, as it does
#: under another worker count (``rolloutWorkers``); ``auto`` may resolve differently on another cluster anyway. The
#: resolved engine and the worker count are kept in ``TrainerState.extra`` (``rollout_engine``, ``rollout_workers``)
#: and a resume under another one is logged as not bit-for-bit.
RESUMABLE_ALGORITHM_FIELDS = ("steps", "evalIntervalSteps", "rolloutEngine", "rolloutWorkers")


def run_identity(job: Any, start_dir: str | None) -> dict[str, Any]:
    """What a GRPO run's trajectory depends on, flat as ``{"section.field": value}`` in the API's spelling: the job's
    ``model`` (but for the ``sftAdapter`` path: a volume mounted elsewhere is the same start), ``lora``,
    ``environment`` and ``algorithm`` sections (but for :data:`RESUMABLE_ALGORITHM_FIELDS`) and ``start``: the
    starting point's weight files (``*.safetensors``, ``*.bin`` in ``start_dir``; an adapter, megabytes, by sha256, a
    full model by size in bytes and modification time in ns, so a multi-GB model costs no read). Kept in every
    checkpoint's ``TrainerState.extra``."""
    from daedalus_trainer.checkpoint import weight_files
    from daedalus_trainer.policy import is_adapter_dir

    spec = job.spec
    flat: dict[str, Any] = {}
    for name in ("model", "lora", "environment", "algorithm"):
        for key, value in getattr(spec, name).model_dump(mode="json", by_alias=True).items():
            if not (name == "algorithm" and key in RESUMABLE_ALGORITHM_FIELDS or f"{name}.{key}" == "model.sftAdapter"):
                flat[f"{name}.{key}"] = value
    has_start = bool(start_dir) and Path(start_dir).is_dir()
    flat["start"] = weight_files(start_dir, by_content=is_adapter_dir(start_dir)) if has_start else []
    return flat


def check_same_run(saved: Mapping[str, Any] | None, now: Mapping[str, Any], where: Any) -> None:
    """Refuse to continue a GRPO checkpoint that a run with other settings or another starting point wrote (a job
    deleted and created again under the same name with another seed or environment, or a local run whose SFT start
    was trained again): continuing would train the old adapter on the new settings. Fields only one side has (from
    another version of Daedalus) are not compared; a checkpoint without an identity passes.

    Args:
        saved: the checkpoint's :func:`run_identity` (``TrainerState.extra["identity"]``), or ``None``.
        now: this run's.
        where: the checkpoint, for the message.

    Raises:
        daedalus_trainer.checkpoint.CheckpointError: naming each differing field with both values and the ways on.
    """
    from daedalus_trainer.checkpoint import CheckpointError, identity_differences

    diff = identity_differences(saved, now, {
        "start": "the starting point's weights differ (the SFT start was trained or replaced since)"})
    if diff:
        raise CheckpointError(f"checkpoint {where} was written by a run with other settings ({'; '.join(diff)}): "
                              "continuing it would mix the two runs. Restore those settings, or start over: locally "
                              "`--resume none` (the old checkpoints are moved aside); on a cluster a new job name, "
                              "or the job's checkpoints directory moved aside")


def check_adapter_matches(saved: Mapping[str, Any], expected: Mapping[str, Any], where: Any) -> None:
    """Refuse to resume a checkpoint whose LoRA adapter differs from the one this run trains.

    A different rank or target list would fail deep inside the learner; a different ``lora_alpha`` would load
    silently under another scale (PEFT multiplies the update by ``alpha / r``) and change the policy.

    Args:
        saved / expected: PEFT ``adapter_config.json`` dicts (``r``, ``lora_alpha``, ``target_modules``), compared
            through :func:`daedalus_trainer.policy.adapter_signature`.
        where: the checkpoint, for the message.

    Raises:
        daedalus_trainer.checkpoint.CheckpointError: naming each differing field and both values.
    """
    from daedalus_trainer.checkpoint import CheckpointError
    from daedalus_trainer.policy import adapter_signature

    a, b = adapter_signature(saved), adapter_signature(expected)
    diff = [f"{k}: checkpoint {a[k]!r}, this run {b[k]!r}" for k in a if a[k] != b[k]]
    if diff:
        raise CheckpointError(f"checkpoint {where} holds a different LoRA adapter than this job trains ("
                              + "; ".join(diff) + "): restore the job's lora section, resume from a checkpoint "
                              "of this adapter, or start over: locally `--resume none`; on a cluster a new job "
                              "name, or the job's checkpoints directory moved aside")


def _split(items: list, parts: int) -> list[list]:
    """Contiguous, near-equal split (deterministic: the same episodes go to the same worker after a resume)."""
    k, r = divmod(len(items), parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + k + (1 if i < r else 0)
        out.append(items[lo:hi])
        lo = hi
    return out


def _step_record(step: int, trajectories: list, update, rollout_seconds: float) -> dict[str, Any]:
    n = len(trajectories)
    tokens = sum(len(t.completion_ids) for tr in trajectories for t in tr.turns)
    return {
        "step": step,
        "reward_mean": sum(t.reward for t in trajectories) / n,
        "success_ratio": sum(bool(t.success) for t in trajectories) / n,
        "episode_turns": sum(t.num_turns for t in trajectories) / n,
        "parse_error_ratio": sum(t.parse_error for tr in trajectories for t in tr.turns)
        / max(1, sum(len(tr.turns) for tr in trajectories)),
        "rollout_tokens": tokens,
        "zero_variance_groups": update.zero_variance_groups,
        "loss": update.loss, "kl": update.kl, "grad_norm": update.grad_norm, "clip_fraction": update.clip_fraction,
        "skipped_update": update.skipped, "learning_rate": update.learning_rate,
        "rollout_seconds": rollout_seconds, "learner_seconds": update.seconds,
    }


@dataclass(frozen=True)
class ActorLayout:
    """Ray resource requests of the learner and the rollout actors (``ray.remote(...).options(**...)``)."""

    workers: int
    """Number of rollout actors."""
    learner: dict[str, float]
    """Options of the learner actor (``num_gpus``, ``num_cpus``)."""
    worker: dict[str, float]
    """Options of each rollout actor."""

    @property
    def gpus(self) -> float:
        """GPUs requested by all actors together."""
        return self.learner.get("num_gpus", 0) + self.workers * self.worker.get("num_gpus", 0)

    @property
    def cpus(self) -> float:
        """CPUs requested by all actors together."""
        return self.learner.get("num_cpus", 0) + self.workers * self.worker.get("num_cpus", 0)

    @property
    def shares_gpus(self) -> bool:
        """Whether some actor holds a fraction of a GPU (Ray ``num_gpus`` in (0, 1)), so that it may share that GPU
        with another actor: :meth:`Trainer._actors` then starts the actors one at a time (:func:`start_actors`)."""
        return any(0 < opts.get("num_gpus", 0) < 1 for opts in (self.learner, self.worker))


def check_layout_fits(layout: ActorLayout, resources: Mapping[str, float]) -> None:
    """Refuse a layout whose actors ask for more CPUs or GPUs than the Ray cluster holds (Ray would never schedule
    the last actor, and the first ``ray.get`` on it would wait forever). Totals are compared, not each node's: the
    GPU shares of :func:`actor_layout` pack whole GPUs, and the operator submits once every pod is Ready.

    Args:
        layout: the actors' requests (:func:`actor_layout`).
        resources: ``ray.cluster_resources()`` (``CPU``, ``GPU`` counts, summed over the nodes now in the cluster).

    Raises:
        ValueError: the total request exceeds what ``resources`` holds; the message names
            ``algorithm.rolloutWorkers`` and the counts. For example one CPU worker of ``cpu: "1"`` (the head has 0 Ray
            CPUs) with the automatic two workers: the learner and both need 1.5 CPUs.
    """
    have_cpus, have_gpus = float(resources.get("CPU", 0)), float(resources.get("GPU", 0))
    for kind, need, have in (("CPUs", layout.cpus, have_cpus), ("GPUs", layout.gpus, have_gpus)):
        if need > have + 1e-9:
            raise ValueError(
                f"the learner and {layout.workers} rollout workers need {need:g} {kind} but the Ray cluster has "
                f"{have:g}: set algorithm.rolloutWorkers lower (0 is automatic), or give the cluster more {kind}")


def start_actors(starts: Sequence[tuple[Any, Callable[[Any], Any]]], sequential: bool) -> list[Any]:
    """Create Ray actors and return their handles, in order.

    Args:
        starts: ``(create, ready)`` pairs: ``create()`` returns a new actor handle (``cls.options(...).remote(...)``),
            ``ready(handle)`` an ``ObjectRef`` of a cheap method call that completes once the actor's ``__init__``
            has (Ray runs an actor's calls after its constructor).
        sequential: create each actor only once the one before it is ready. On a shared GPU this keeps a vLLM
            engine's start-up memory profiling (``gpu_memory_utilization`` is measured from whole-device free memory
            before and after a profile run) from counting a neighbour's model loading as its own, which shrinks its
            KV cache or fails with "No available memory for the cache blocks", or from seeing a neighbour free memory,
            which fails vLLM's "Error in memory profiling" assertion (vllm-project/vllm issues 55827 and 56830).
            Otherwise all are created at once and not waited for (their failures surface at their first call).

    Raises:
        ray.exceptions.RayActorError: (``sequential``) an actor's constructor raised; the actors created before
            it are killed first.
    """
    import ray

    if not sequential:
        return [create() for create, _ in starts]
    handles: list[Any] = []
    try:
        for create, ready in starts:
            handles.append(create())
            ray.get(ready(handles[-1]))
    except BaseException:
        for handle in handles:
            ray.kill(handle)
        raise
    return handles


def actor_layout(gpus: int, workers: int | None = None, cpus: int | None = None) -> ActorLayout:
    """Place the learner and the rollout actors on ``gpus`` GPUs without asking for more than exist.

    - No GPU: ``workers`` actors (default ``min(2, cpus)``), every actor 0.5 CPU, so a default Ray task still fits on
      a 2-core machine.
    - One GPU: the learner and the rollout actors share it: the learner half of it, the workers (default 1) the other
      half between them.
    - ``gpus >= 2``: the learner gets a GPU of its own and the rollout actors (default ``gpus - 1``) share the rest,
      a whole GPU each when they fit, else ``1/k`` of one each with ``k = ceil(workers / (gpus - 1))`` (Ray packs a
      fractional request inside one GPU: a share above a half would hold a GPU alone). Asking for one actor per GPU
      *plus* the learner (what this replaced) needs ``gpus + 1`` GPUs: Ray never schedules the last actor and the
      first ``ray.get`` waits forever.

    Args:
        gpus: GPUs in the Ray cluster (``ray.cluster_resources()["GPU"]``).
        workers: rollout actors wanted (None: the default above).
        cpus: CPUs of this machine (default ``os.cpu_count()``), for the CPU default only.

    Raises:
        ValueError: ``workers`` < 1 or ``gpus`` < 0.
    """
    if gpus < 0:
        raise ValueError(f"gpus must be >= 0, got {gpus}")
    if workers is not None and workers < 1:
        raise ValueError(f"rollout workers must be >= 1, got {workers}")
    if gpus == 0:
        n = workers or max(1, min(2, cpus or os.cpu_count() or 1))
        return ActorLayout(n, {"num_cpus": 0.5}, {"num_cpus": 0.5})
    if gpus == 1:
        n = workers or 1
        return ActorLayout(n, {"num_gpus": 0.5, "num_cpus": 1}, {"num_gpus": 0.5 / n, "num_cpus": 1})
    n = workers or gpus - 1
    share = 1.0 / math.ceil(n / (gpus - 1))  # a fraction Ray can pack: 1/k of a GPU each, k workers per GPU
    return ActorLayout(n, {"num_gpus": 1, "num_cpus": 1}, {"num_gpus": share, "num_cpus": 1})


def _gpus_available() -> int:
    import ray

    try:
        return int(ray.cluster_resources().get("GPU", 0))
    except Exception:  # Ray not initialised
        return 0


def run_dir_for(job) -> Path:
    """Where a job's checkpoints and exports live on the shared volume: ``<checkpoint.path>/<namespace>/<name>``."""
    return Path(job.spec.checkpoint.path) / job.metadata.namespace / job.metadata.name


def local_ray_cpus(rollout_workers: int = 0, cpus: int | None = None) -> int:
    """Logical CPUs of the local Ray :func:`init_ray` starts: the machine's ``cpus`` (default ``os.cpu_count()``)
    clamped to 2-4, raised to ``rollout_workers + 1`` for an explicit ``algorithm.rolloutWorkers`` (each actor asks
    for at most 1 CPU: :func:`actor_layout`), so that the learner and every worker can be scheduled."""
    return max(2, min(4, cpus or os.cpu_count() or 2), rollout_workers + 1)


def init_ray(local: bool, rollout_workers: int = 0) -> None:
    """Attach to the running Ray cluster (inside a Ray job, ``RAY_ADDRESS`` is set) or start a small local one.

    Locally: ``num_cpus`` = :func:`local_ray_cpus` (Ray's CPUs are logical: more actors than cores share them), and
    no dashboard (~0.7 GB, ~4 s to start; docs/engineering-notes.md, "Local Ray"); actors take fractional CPUs so a
    default task can still be scheduled.
    """
    import ray

    if ray.is_initialized():
        return
    if not local and os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
    else:
        ray.init(num_cpus=local_ray_cpus(rollout_workers), include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})


def check_resumed_adapter(job, loaded) -> None:
    """Refuse, before SFT and Ray start, a ``--resume PATH`` checkpoint whose LoRA adapter is not the one ``job``
    trains: the SFT adapter's when ``model.sftAdapter`` is a PEFT adapter, else ``spec.lora``'s
    (:meth:`Trainer._expected_adapter`, which checks it again once the start is known).

    Raises:
        daedalus_trainer.checkpoint.CheckpointError: as :func:`check_adapter_matches`.
    """
    from daedalus_trainer.policy import is_adapter_dir, read_adapter_config

    sft_adapter = job.spec.model.sft_adapter
    expected = read_adapter_config(sft_adapter) if sft_adapter and is_adapter_dir(sft_adapter) else job.spec.lora
    check_adapter_matches(loaded.load_adapter_config(), expected, loaded.path)


def resume_checkpoint(job, root: str | Path, resume: str) -> LoadedCheckpoint | None:
    """The checkpoint ``--resume`` names for ``job`` (``latest`` | ``none`` | a PATH), read, verified and its LoRA
    adapter checked before SFT or Ray start, through the run's :class:`~daedalus_trainer.checkpoint.CheckpointManager`
    on ``root`` (which first puts back a checkpoint a killed re-save left aside). Hand it to :meth:`Trainer.train`,
    which then does not hash it again. None: nothing to resume (``none``, or ``latest`` with no checkpoint yet).

    Raises:
        daedalus_trainer.checkpoint.CheckpointError: as :meth:`CheckpointManager.resume` and
            :func:`check_resumed_adapter`.
    """
    from daedalus_trainer.checkpoint import CheckpointManager

    loaded = CheckpointManager(root, keep=job.spec.checkpoint.keep).resume(resume)
    if loaded is not None:
        check_resumed_adapter(job, loaded)
    return loaded


#: Exit status of ``daedalus train`` ended by a second SIGTERM (128 + the signal number, the shells' convention).
SIGTERM_EXIT = 128 + 15


class StopOnSignal:
    """While inside (a context manager), a signal asks the run to stop as ``POST /stop`` does
    (``control.request_checkpoint(stop=True)``): the step in progress ends (or, before the first step, the start-up:
    model, actors, resume), its checkpoint is written (at once during a held-out evaluation) and
    :meth:`Trainer.train` returns ``stopped``, so a resume loses no step. A signal during the last step lets the run
    finish (its adapter exported); :attr:`received` tells the caller. Replaces the signal's handler and restores it on
    leaving; a no-op outside the main thread (Python delivers signals there only). :func:`stop_on_sigterm` and
    :func:`stop_on_sigint` are its two uses.

    Args:
        control: the trainer's :class:`~daedalus_trainer.server.ControlState`.
        signum: the signal (``signal.SIGTERM``, ``signal.SIGINT``).
        again: raised by a second signal, which does not wait for the step to end (queued checkpoint writes still
            land; :meth:`Trainer.train` marks the run failed).
        ended: raised by a signal after the run ended (while an endpoint still serves its figures): nothing is left
            to save (raised inside :meth:`Trainer.train`, in the instant between its last status and its return,
            the run is reported failed).
        note: what the first signal logs after "<SIGNAME>: ".
    """

    def __init__(self, control: Any, signum: int, again: BaseException, ended: BaseException, note: str):
        self.control, self.signum, self.again, self.ended, self.note = control, signum, again, ended, note
        self.received = False
        """True once the signal has asked for the stop (the caller says why the run stopped)."""
        self._previous: Any = None
        self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        import signal

        name = signal.Signals(signum).name
        if self.received or self.control.stop_requested():
            log.warning("%s %s: exiting without waiting for the step to end", name,
                        "again" if self.received else "with a stop already pending")
            raise type(self.again)(*self.again.args)  # a fresh one each time: no traceback carried over
        try:
            self.control.request_checkpoint(stop=True)
        except RuntimeError:  # the run has ended (serving its last figures): its outcome stands, nothing to save
            log.info("%s after the run ended: exiting", name)
            raise type(self.ended)(*self.ended.args) from None
        self.received = True
        log.warning("%s: %s", name, self.note)

    def __enter__(self) -> "StopOnSignal":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous, self._installed = signal.signal(self.signum, self._handle), True
        return self

    def __exit__(self, *exc: Any) -> None:
        import signal

        if self._installed:
            signal.signal(self.signum, self._previous)
            self._installed = False


def stop_on_sigterm(control: Any, ended_exit: int = 0) -> StopOnSignal:
    """SIGTERM stops ``daedalus train`` (and ``daedalus run``'s GRPO) after a checkpoint of the step in progress
    (:class:`StopOnSignal`); ``daedalus train`` then exits 0 (the operator resumes it), ``daedalus run`` 143. Who
    sends it: ``ray job stop`` (Ray's job supervisor signals the entrypoint's process group, then kills it after
    ``RAY_JOB_STOP_WAIT_TIME_S``, 3 s by default, which covers a short step only; the operator stops a running
    trainer with ``POST /stop`` first), ``kill``, ``timeout``, a container runtime's stop. A second
    SIGTERM exits at once (``SystemExit`` with :data:`SIGTERM_EXIT`); one after the run ended (while
    ``DAEDALUS_METRICS_LINGER_SECONDS`` keeps the endpoint up) exits ``ended_exit``. Replaces Ray's driver handler
    (``ray.init`` installs one that exits at once) while inside.
    """
    import signal

    return StopOnSignal(control, signal.SIGTERM, again=SystemExit(SIGTERM_EXIT), ended=SystemExit(ended_exit),
                        note="the step in progress ends, its checkpoint is written, then the run stops "
                             "(a second SIGTERM exits at once)")


def stop_on_sigint(control: Any) -> StopOnSignal:
    """Ctrl-C (SIGINT) during ``daedalus run``'s GRPO: the step in progress ends and its checkpoint is written
    before the run stops (:class:`StopOnSignal`), so the same command resumes from that step; a second Ctrl-C
    interrupts at once (``KeyboardInterrupt``: the steps since the last checkpoint are lost). Ray's processes do not
    act on the terminal's Ctrl-C (each worker runs in a process group of its own, measured with Ray 2.60; Ray's
    daemons block SIGINT), so the step in progress can end.
    """
    import signal

    return StopOnSignal(control, signal.SIGINT, again=KeyboardInterrupt(), ended=KeyboardInterrupt(),
                        note="the step in progress ends and its checkpoint is written, then the run stops "
                             "(press Ctrl-C again to interrupt at once, losing the steps since the last checkpoint)")


def main_train(config: str, resume: str = "latest", out_dir: str | None = None) -> int:
    """`daedalus train`: the Ray job's entrypoint on a cluster (the operator submits
    ``python -m daedalus_trainer train --config /etc/daedalus/config.json --resume latest``).

    Serves metrics and control on ``DAEDALUS_METRICS_PORT`` (default 9400) on all interfaces, reads the control token
    from ``DAEDALUS_CONTROL_TOKEN`` / ``DAEDALUS_CONTROL_TOKEN_FILE`` and the attempt from ``DAEDALUS_ATTEMPT``;
    ``DAEDALUS_METRICS_LINGER_SECONDS`` keeps the endpoint up that long after the last step (a final scrape).
    SIGTERM stops the run after a checkpoint of the step in progress (:func:`stop_on_sigterm`).
    Returns 0 when the run finished or was stopped on request (the operator resubmits with resume), raises otherwise.

    Raises:
        FileNotFoundError: ``config`` does not exist.
        daedalus_trainer.config.SpecError: ``config`` is malformed or the job is invalid.
        FileNotFoundError, daedalus_trainer.policy.ModelLoadError: ``model.sftAdapter`` or ``model.path`` is
            missing or its weights are cut short (:func:`~daedalus_trainer.policy.check_model_paths`), before Ray
            starts.
        daedalus_trainer.usage.UsageError: ``DAEDALUS_ATTEMPT`` is not a whole number >= 0,
            ``DAEDALUS_METRICS_PORT`` not a port number or taken, ``DAEDALUS_METRICS_LINGER_SECONDS`` not a number
            >= 0, or the run directory cannot be created (all before Ray starts).
        CheckpointError: ``resume`` is a PATH that holds no checkpoint, one that fails verification, or one of
            another LoRA adapter (:func:`check_resumed_adapter`); checked before Ray starts and anything is created.
        CheckpointError, LayoutError, ray.exceptions.RayError: as :meth:`Trainer.train` (which sets the control
            phase to ``failed``, with the reason, first).
    """
    from daedalus_trainer.config import load_job
    from daedalus_trainer.server import TrainerServer

    from daedalus_trainer.usage import check_port_free, env_number, make_dir, port_number

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    job = load_job(config)
    # Everything that can be wrong with the environment fails here, in a second, not after Ray and the model start.
    attempt = int(env_number("DAEDALUS_ATTEMPT", 1, integer=True, minimum=0))
    port = port_number(os.environ.get("DAEDALUS_METRICS_PORT", "9400"), "DAEDALUS_METRICS_PORT")
    linger = env_number("DAEDALUS_METRICS_LINGER_SECONDS", 0.0, minimum=0.0)
    host = os.environ.get("DAEDALUS_METRICS_HOST", "0.0.0.0")
    check_port_free(host, port, "DAEDALUS_METRICS_PORT")
    from daedalus_trainer.policy import check_model_paths

    check_model_paths(job.spec.model)  # a missing or cut-short start or base model: one line now, not an actor's death
    if job.spec.model.tiny and not job.spec.model.sft_adapter:
        # `daedalus run` trains the SFT start itself; `train` (what a cluster runs) does not: a random-weight policy
        # writes no action, every group is all failures and GRPO has nothing to learn from.
        log.warning("model.tiny without model.sftAdapter: GRPO starts from the tiny model's random weights, which write "
                    "no valid action; give model.sftAdapter (`daedalus sft JOB.yaml` trains one) or use `daedalus run`, "
                    "which trains it first")
    target = Path(out_dir) if out_dir else run_dir_for(job)
    start: str | LoadedCheckpoint = resume
    if resume not in ("latest", "none"):  # a checkpoint PATH: verified now, not after Ray and the model start
        start = resume_checkpoint(job, target / "checkpoints", resume) or resume  # a PATH always loads or raises
    run_dir = make_dir(target, "--out" if out_dir else "checkpoint.path")
    init_ray(local=False, rollout_workers=job.spec.algorithm.rollout_workers)
    trainer = Trainer(job, run_dir)
    trainer.control.set_status(attempt=attempt)
    with TrainerServer(trainer.metrics, trainer.control, host=host, port=port), stop_on_sigterm(trainer.control):
        result = trainer.train(resume=start)  # on any exception it has set the phase to failed, with the reason
        if result.stopped:
            # The POST /stop caller is answered from a server thread once the checkpoint is committed: give it the
            # moment it needs to write the response before the process exits.
            time.sleep(1.0)
        # Keep serving the final figures for a last Prometheus scrape before the process (and the pod's port) goes.
        if linger > 0:
            log.info("serving final metrics for %.0f s", linger)
            time.sleep(linger)
    log.info("training %s at step %d (%.0f s)", "stopped" if result.stopped else "finished", result.steps_done,
             result.wall_seconds)
    return 0
