"""The two roles of a GRPO step, as plain classes that Ray turns into actors.

- :class:`RolloutWorker` owns a rollout engine and environments and returns plain trajectory records
  (:class:`~daedalus_trainer.rollout.episode.Trajectory`); it holds no learning logic. Its engine is transformers
  generation or vLLM, as ``algorithm.rolloutEngine`` and the worker's machine decide (:func:`resolve_rollout_engine`).
- :class:`Learner` owns the trainable policy (LoRA on the frozen base) and the AdamW optimizer; it turns trajectories
  into one optimizer step with :func:`~daedalus_trainer.grpo.group_advantages` and
  :func:`~daedalus_trainer.grpo.grpo_loss`.

After each step only the LoRA adapter (megabytes, never the base weights) travels from the learner to the engines,
through Ray's object store, tagged with a version (the step count) so an engine never samples with stale weights
unknowingly. Both classes also work without Ray (tests construct them directly).
"""

from __future__ import annotations

import importlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from daedalus_trainer.checkpoint import pack_tensors, unpack_tensors
from daedalus_trainer.config import RLTrainingJob


log = logging.getLogger("daedalus.actors")

#: Fraction of a rollout worker's GPU share that vLLM's ``gpu_memory_utilization`` takes (0.9 x the actor's Ray
#: ``num_gpus``). vLLM pre-allocates that fraction of the whole GPU's memory for weights, activations and KV cache,
#: while memory outside its accounting (the CUDA context, NCCL and allocator fragmentation, ~0.5-1 GiB a process)
#: comes on top; with the learner on the same GPU (:func:`daedalus_trainer.grpo.actor_layout` gives it half of a
#: single GPU) taking the whole share would leave the two processes nothing for that overhead. vLLM's own default is
#: the same 0.9 of a GPU it has to itself. Not measured here (no GPU).
VLLM_SHARE_FRACTION = 0.9
#: The values of ``algorithm.rolloutEngine`` and the engines they resolve to.
ROLLOUT_ENGINES = ("auto", "transformers", "vllm")


class RolloutEngineUnavailable(RuntimeError):
    """``algorithm.rolloutEngine: vllm`` on a rollout worker that cannot run vLLM; the message says why (no CUDA GPU
    visible, no GPU share for the actor, vLLM not importable) and how to go on."""


@dataclass(frozen=True)
class EngineProbe:
    """What a rollout worker's process offers an engine.

    Attributes:
        cuda: a CUDA GPU is visible (``torch.cuda.is_available()``; in a Ray actor, the GPUs Ray assigned it).
        vllm_error: why ``import vllm`` failed (``"ModuleNotFoundError: No module named 'vllm'"``), or None when it
            imports.
    """

    cuda: bool
    vllm_error: str | None

    @classmethod
    def here(cls) -> "EngineProbe":
        """Probe this process. ``import vllm`` is tried only where a CUDA GPU is visible (elsewhere vLLM is not
        used whatever it would answer, and importing it costs seconds)."""
        cuda = torch.cuda.is_available()
        return cls(cuda, vllm_import_error() if cuda else "not tried: no CUDA GPU")


def vllm_import_error() -> str | None:
    """None when ``import vllm`` succeeds in this process, else the error as ``"<type>: <message>"`` (vLLM missing,
    or a build that fails to load, e.g. its CUDA libraries)."""
    try:
        importlib.import_module("vllm")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def resolve_rollout_engine(requested: str, gpu_share: float, probe: EngineProbe, top_p: float = 1.0
                           ) -> tuple[str, str]:
    """The engine a rollout worker uses, and why.

    ``auto`` is ``vllm`` when a CUDA GPU is visible, the actor holds a share of it (``gpu_share`` > 0: Ray's
    ``num_gpus``), vLLM imports and ``top_p`` is 1 (vLLM's log-probs with ``top_p < 1`` are not the policy's,
    :func:`daedalus_trainer.rollout.vllm_engine.check_sampling`); else ``transformers``. ``transformers`` is always
    itself. ``vllm`` is ``vllm`` or an error.

    Args:
        requested: ``algorithm.rolloutEngine``: ``auto``, ``transformers`` or ``vllm``.
        gpu_share: the actor's GPUs (Ray ``num_gpus``, a fraction of one GPU when it shares it).
        probe: what the worker's process offers (:meth:`EngineProbe.here`).
        top_p: ``algorithm.topP`` (the API already refuses ``vllm`` with ``topP`` < 1).

    Returns:
        ``(engine, reason)``: ``"transformers"`` or ``"vllm"``, and a short reason for the log.

    Raises:
        RolloutEngineUnavailable: ``vllm`` requested where it cannot run; every missing condition is named.
        ValueError: ``requested`` is none of :data:`ROLLOUT_ENGINES`.
    """
    if requested not in ROLLOUT_ENGINES:
        raise ValueError(f"unknown rollout engine {requested!r}; use one of {', '.join(ROLLOUT_ENGINES)}")
    if requested == "transformers":
        return "transformers", "algorithm.rolloutEngine is transformers"
    missing = []
    if not probe.cuda:
        missing.append("no CUDA GPU is visible to the rollout worker")
    if not gpu_share > 0:
        missing.append("the rollout worker holds no GPU share (Ray num_gpus 0: the cluster has no GPU for it)")
    if probe.cuda and probe.vllm_error is not None:
        missing.append(f"vLLM is not installed or does not import ({probe.vllm_error}; the trainer image's gpu "
                       "extra installs it)")
    if requested == "vllm":
        if missing:
            raise RolloutEngineUnavailable(
                "algorithm.rolloutEngine is vllm but this rollout worker cannot run vLLM: " + "; ".join(missing)
                + ". Run on GPU workers with the trainer image, or set rolloutEngine to auto or transformers")
        return "vllm", "algorithm.rolloutEngine is vllm"
    if missing:
        return "transformers", "auto: " + "; ".join(missing)
    if top_p != 1:
        return "transformers", f"auto: algorithm.topP {top_p:g} < 1, which vLLM's log-probs do not support"
    return "vllm", f"auto: CUDA GPU visible, GPU share {gpu_share:g}, vLLM imports"


def _job(job: RLTrainingJob | dict) -> RLTrainingJob:
    return job if isinstance(job, RLTrainingJob) else RLTrainingJob.model_validate(job)


def _start_model_spec(job: RLTrainingJob, start_dir: str | None):
    """The model spec with the SFT starting point resolved (a full model dir or a PEFT adapter dir)."""
    spec = job.spec.model
    if start_dir:
        spec = spec.model_copy(update={"sft_adapter": str(start_dir)})
    return spec


def load_training_policy(job: RLTrainingJob, start_dir: str | None, work_dir: str | Path, seed: int):
    """The policy GRPO trains: the starting point plus a LoRA adapter (a fresh one, initialised from ``seed``, unless
    the starting point is itself an adapter, which is then trained further).

    Raises:
        FileNotFoundError / ValueError: from :func:`daedalus_trainer.policy.load_policy`.
    """
    from daedalus_trainer.policy import load_policy

    torch.manual_seed(seed)
    return load_policy(_start_model_spec(job, start_dir), job.spec.lora, work_dir=work_dir, device=None)


class RolloutWorker:
    """Plays episodes with the latest adapter.

    Args:
        job: the RLTrainingJob (model or dict).
        start_dir: SFT starting point (full model or PEFT adapter directory), or None for the base model.
        work_dir: where the tiny base model lives / is built.
        max_batch: conversations per generate call (transformers engine).
        gpu_share: the GPUs Ray gave this actor (its ``num_gpus``; a fraction when it shares one GPU); 0 on CPU.
        probe: what this process offers an engine; default :meth:`EngineProbe.here` (tests pass their own).

    The engine (:attr:`rollout_engine`) follows ``algorithm.rolloutEngine`` (:func:`resolve_rollout_engine`) and is
    logged. Transformers: the training policy loaded here (:func:`load_training_policy`), as before ``rolloutEngine``
    existed. vLLM: the base checkpoint of :func:`daedalus_trainer.policy.resolve_start` served by
    :class:`~daedalus_trainer.rollout.vllm_engine.VLLMEngine` with ``gpu_memory_utilization`` =
    :data:`VLLM_SHARE_FRACTION` x ``gpu_share``, the published adapters written with the start adapter's
    ``adapter_config.json`` (a PEFT ``model.sftAdapter``) or that of a fresh ``spec.lora`` adapter.

    Raises:
        RolloutEngineUnavailable: ``rolloutEngine: vllm`` where vLLM cannot run (the actor's creation fails with it).
    """

    def __init__(self, job: RLTrainingJob | dict, start_dir: str | None, work_dir: str, max_batch: int = 64,
                 gpu_share: float = 0.0, probe: EngineProbe | None = None):
        from daedalus_trainer.rollout.engine import TransformersEngine

        torch.set_num_threads(1)
        self.job = _job(job)
        algo = self.job.spec.algorithm
        engine, reason = resolve_rollout_engine(algo.rollout_engine, gpu_share, probe or EngineProbe.here(),
                                                algo.top_p)
        #: ``"transformers"`` or ``"vllm"``: the engine this worker samples with.
        self.rollout_engine = engine
        log.info("rollout worker: %s engine (%s)", engine, reason)
        if engine == "vllm":
            self.engine = self._vllm_engine(start_dir, work_dir, gpu_share)
        else:
            policy = load_training_policy(self.job, start_dir, work_dir, seed=algo.seed)
            self.engine = TransformersEngine(policy, max_batch=max_batch)
        self.loaded_version = -1

    def _vllm_engine(self, start_dir: str | None, work_dir: str, gpu_share: float):
        """The :class:`~daedalus_trainer.rollout.vllm_engine.VLLMEngine` of this job (see the class docstring)."""
        from daedalus_trainer.policy import adapter_config_dict, lora_config, read_adapter_config, resolve_start
        from daedalus_trainer.rollout.vllm_engine import VLLMEngine

        spec = self.job.spec
        start = resolve_start(_start_model_spec(self.job, start_dir), work_dir)
        if start.adapter_dir is not None:  # GRPO trains the SFT adapter further: its config is the published one's
            config = read_adapter_config(start.adapter_dir)
        else:
            config = adapter_config_dict(lora_config(spec.lora, base_model_name_or_path=str(start.base_dir)))
        return VLLMEngine(start.base_dir, history_turns=spec.environment.history_turns, adapter_config=config,
                          dtype=spec.model.dtype, gpu_memory_utilization=VLLM_SHARE_FRACTION * gpu_share,
                          seed=spec.algorithm.seed)

    def engine_name(self) -> str:
        """:attr:`rollout_engine` (a Ray actor's attributes are reached through methods)."""
        return self.rollout_engine

    def rollout(self, mazes: Sequence[Any], seed: int, adapter: dict[str, Any], version: int) -> list[Any]:
        """One episode per maze with adapter ``version`` (loaded first if new; tensors or
        :class:`~daedalus_trainer.checkpoint.PackedTensor` s), sampling seeded by ``seed``.

        Returns:
            list of :class:`~daedalus_trainer.rollout.episode.Trajectory`, in the order of ``mazes``.
        """
        from daedalus_trainer.rollout.engine import SamplingParams
        from daedalus_trainer.rollout.episode import run_episodes

        if version != self.loaded_version:
            self.engine.load_adapter(unpack_tensors(adapter), version)
            self.loaded_version = version
        algo = self.job.spec.algorithm
        sampling = SamplingParams(algo.temperature, algo.top_p, algo.max_tokens_per_turn)
        with torch.no_grad():
            return run_episodes(self.engine, list(mazes), self.job.spec.environment, sampling, seed=seed)


    def evaluate(self, mazes: Sequence[Any], adapter: dict[str, Any], version: int) -> list[bool]:
        """Greedy episodes on ``mazes`` with adapter ``version``; returns success per maze (held-out evaluation)."""
        from daedalus_trainer.rollout.engine import SamplingParams
        from daedalus_trainer.rollout.episode import run_episodes

        if version != self.loaded_version:
            self.engine.load_adapter(unpack_tensors(adapter), version)
            self.loaded_version = version
        greedy = SamplingParams(0.0, 1.0, self.job.spec.algorithm.max_tokens_per_turn)
        with torch.no_grad():
            return [bool(t.success) for t in run_episodes(self.engine, list(mazes), self.job.spec.environment, greedy)]


@dataclass
class UpdateStats:
    """What one learner update reports (floats; ``None`` when the update was skipped)."""

    loss: float | None
    """Mean loss over the mini-batch passes that ran (mini-batches with signal x ``iterationsPerStep``)."""
    kl: float | None
    """Mean k3 KL estimate to the reference per assistant token trained on; ``None`` without a KL term
    (``klCoef`` 0)."""
    grad_norm: float | None
    """Mean over the optimizer updates of the total gradient L2 norm before clipping (what ``clip_grad_norm_``
    returns); NaN when every update was skipped for a non-finite gradient."""
    clip_fraction: float | None
    """Fraction of the assistant tokens trained on whose importance ratio was clipped (over all passes)."""
    tokens: int
    """Assistant (sampled) tokens of the episodes trained on, counted once (not per pass)."""
    sequences: int
    """Turn sequences trained on (one per turn of each episode trained on), counted once."""
    zero_variance_groups: int
    """Groups whose episodes all got the same reward (no group-relative signal)."""
    skipped: bool
    """True when no optimizer step was made."""
    seconds: float
    """Wall-clock seconds of the update."""
    updates: int = 1
    """Optimizer updates made (``iterationsPerStep`` x ``miniBatches``, minus mini-batches without signal and any
    update skipped for a non-finite gradient)."""
    learning_rate: float | None = None
    """The AdamW learning rate of this step (:func:`daedalus_trainer.grpo.learning_rate_at`)."""


class Learner:
    """Trains the LoRA adapter with GRPO.

    Args:
        job: the RLTrainingJob (model or dict).
        start_dir / work_dir: as :class:`RolloutWorker`.
        micro_batch: turn sequences per forward/backward (gradients are accumulated; the result does not depend on
            it up to float rounding).
    """

    def __init__(self, job: RLTrainingJob | dict, start_dir: str | None, work_dir: str, micro_batch: int = 32):
        torch.set_num_threads(1)
        self.job = _job(job)
        algo = self.job.spec.algorithm
        self.policy = load_training_policy(self.job, start_dir, work_dir, seed=algo.seed)
        from daedalus_trainer.policy import is_adapter_dir

        if algo.kl_coef > 0 and is_adapter_dir(start_dir):
            self.policy.add_reference_adapter(start_dir)  # the KL is to the SFT adapter, not to the base model
        self.params = self.policy.trainable_parameters()
        self.optimizer = torch.optim.AdamW(self.params, lr=algo.learning_rate, weight_decay=algo.weight_decay)
        self.micro_batch = micro_batch

    # -- adapter and checkpoint state ------------------------------------------------------------------------------
    def adapter_state(self, packed: bool = False) -> dict[str, Any]:
        """LoRA weights (CPU tensors, PEFT key names): what the engines load. With ``packed``, as
        :class:`~daedalus_trainer.checkpoint.PackedTensor` byte views: what a Ray call should ask for (one copy into
        the object store, none out of it; :class:`RolloutWorker` unpacks), the adapter being published every step.
        Packed, the views are of the live parameters (no copy here: Ray's copy as the call returns is the only one, and
        this actor runs no update before that); unpacked, the tensors are copies the caller may keep."""
        if packed:
            return pack_tensors(self.policy.adapter_state(copy=False))
        return self.policy.adapter_state()

    def adapter_config(self) -> dict[str, Any]:
        """The PEFT ``adapter_config.json`` content of the adapter (:func:`~daedalus_trainer.policy.
        adapter_config_dict`)."""
        from daedalus_trainer.policy import adapter_config_dict

        return adapter_config_dict(self.policy.model.peft_config["default"])

    def checkpoint_state(self, packed: bool = False) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """``(adapter tensors, adapter config, optimizer state_dict)`` for :class:`~daedalus_trainer.checkpoint.
        CheckpointManager`. With ``packed`` every tensor is a :class:`~daedalus_trainer.checkpoint.PackedTensor`
        (a byte view; the adapter tensors are the copies :meth:`adapter_state` makes, the optimizer moments are not
        copied here): what a Ray call should ask for, because Ray then copies the state into its
        object store in one pass when this call returns (before the learner's next task can change it) and a
        ``ray.get`` maps it without copying (:func:`~daedalus_trainer.checkpoint.unpack_tensors` restores tensors)."""
        state = (self.adapter_state(), self.adapter_config(), self.optimizer.state_dict())
        return (pack_tensors(state[0]), state[1], pack_tensors(state[2])) if packed else state

    def restore(self, adapter: dict[str, torch.Tensor], optimizer_state: dict[str, Any]) -> None:
        """Load adapter weights and optimizer state from a checkpoint.

        Args:
            adapter: the adapter state dict (PEFT key names, shapes as :meth:`Policy.adapter_state
                <daedalus_trainer.policy.Policy.adapter_state>`: ``lora_A`` ``[r, in_features]``, ``lora_B``
                ``[out_features, r]``).
            optimizer_state: ``optimizer.state_dict()`` of the same parameters.

        Raises:
            ValueError: the adapter's keys or tensor shapes do not match the attached one's (other targets,
                another rank; nothing is loaded), or ``optimizer_state`` has other parameter groups or group sizes
                (torch's ``Optimizer.load_state_dict``).
        """
        self.policy.load_adapter(adapter)
        self.optimizer.load_state_dict(optimizer_state)

    def save_adapter(self, out_dir: str) -> str:
        """Write the adapter in PEFT format to ``out_dir``."""
        return str(self.policy.save_adapter(out_dir))

    # -- the GRPO update -------------------------------------------------------------------------------------------
    def update(self, trajectories: Sequence[Any], group_size: int, step: int | None = None) -> UpdateStats:
        """One GRPO step on ``M * G`` episodes laid out group by group (episode ``e`` is in group ``e // G``).

        ``step`` (1-based) sets the learning rate from ``algorithm.lrSchedule``
        (:func:`daedalus_trainer.grpo.learning_rate_at`); ``None`` keeps the optimizer's current one.

        Rewards -> group-relative advantages -> clipped policy loss on the assistant tokens of every turn (the
        episode's advantage broadcast to all of them, plus ``stepAdvantageWeight`` times GiGPO's step-level advantage
        of the turn, :func:`daedalus_trainer.grpo.step_advantages`) -> gradient clipping -> AdamW, once per
        mini-batch (``miniBatches`` splits the groups, in order, into that many mini-batches of whole groups; the loss
        of each is its own mean), ``iterationsPerStep`` passes over the same rollouts (the behaviour log-probs stay
        those recorded at sampling time). An episode is trained on if its group's rewards differ, any of its turns
        has a non-zero step-level advantage, or a KL term is on; the others carry no signal (plain GRPO: the groups
        whose rewards are all equal). If no episode is left, the step is skipped.

        Raises:
            ValueError: ``len(trajectories)`` is not a multiple of ``group_size``, or its groups do not split into
                ``miniBatches`` mini-batches; with ``stepAdvantageWeight`` > 0, an episode's reward is not the sum
                of its turns' rewards (the step returns are computed from the turns', the episode advantage from the
                episode's).
        """
        from daedalus_trainer.grpo import group_advantages, grpo_loss, learning_rate_at, step_advantages

        started = time.perf_counter()
        algo = self.job.spec.algorithm
        if step is None:
            lr = float(self.optimizer.param_groups[0]["lr"])
        else:
            lr = learning_rate_at(algo, step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        n = len(trajectories)
        if group_size < 1 or n % group_size:
            raise ValueError(f"{n} trajectories do not form groups of {group_size}")
        mini = int(algo.mini_batches)
        n_groups = n // group_size
        if n_groups % mini:
            raise ValueError(f"{n_groups} groups do not split into {mini} mini-batches (algorithm.miniBatches must "
                             "divide algorithm.mazesPerStep)")
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32).view(-1, group_size)
        adv, zero_var = group_advantages(rewards, algo.advantage_norm)
        adv = adv.flatten()
        # per turn: the episode's advantage, plus GiGPO's step-level advantage when its weight is on
        turn_adv = [[float(adv[e])] * len(trajectories[e].turns) for e in range(n)]
        if algo.step_advantage_weight > 0:
            turn_rewards = [[turn.reward for turn in t.turns] for t in trajectories]
            for e, (t, r) in enumerate(zip(trajectories, turn_rewards)):
                if abs(sum(r) - t.reward) > 1e-6:
                    raise ValueError(f"episode {e}: reward {t.reward} is not the sum of its turns' rewards {r}; "
                                     "step-level advantages need both to agree")
            step_adv = step_advantages([[turn.state for turn in t.turns] for t in trajectories], turn_rewards,
                                       group_size, algo.step_discount, algo.advantage_norm)
            w = float(algo.step_advantage_weight)
            turn_adv = [[a + w * b for a, b in zip(ta, sa)] for ta, sa in zip(turn_adv, step_adv)]
        use_kl = algo.kl_coef > 0
        episodes = [e for e in range(n)
                    if use_kl or not bool(zero_var[e // group_size]) or any(a != 0.0 for a in turn_adv[e])]
        n_zero = int(zero_var.sum())
        if not episodes:
            return UpdateStats(None, None, None, None, 0, 0, n_zero, True, time.perf_counter() - started, updates=0,
                               learning_rate=lr)

        mb_size = n // mini  # episodes per mini-batch, whole groups
        # token-mean divides by every assistant token of the mini-batch's rollouts, zero-variance groups included
        # (they add nothing to the policy-gradient sum): the same scale whether or not a KL term makes them part of
        # the batch
        mb_tokens = [sum(len(turn.completion_ids) for t in trajectories[m * mb_size:(m + 1) * mb_size]
                         for turn in t.turns) for m in range(mini)]
        total_tokens = sum(len(turn.completion_ids) for e in episodes for turn in trajectories[e].turns)

        # Micro-batches of whole episodes (an episode's turns stay together, which the per-episode aggregations
        # need), each within one mini-batch. Collated once: the batches, behaviour log-probs and (with a KL term)
        # reference log-probs are the same for every iteration over this rollout batch.
        device = self.policy.device
        prepared: list[list[tuple]] = [[] for _ in range(mini)]
        for m in range(mini):
            chunks: list[list[int]] = [[]]
            rows_in_chunk = 0
            for e in (e for e in episodes if e // mb_size == m):
                rows = len(trajectories[e].turns)
                if chunks[-1] and rows_in_chunk + rows > self.micro_batch:
                    chunks.append([])
                    rows_in_chunk = 0
                chunks[-1].append(e)
                rows_in_chunk += rows
            for chunk in (c for c in chunks if c):
                seqs, old_rows, row_adv, row_ep = [], [], [], []
                for e in chunk:
                    for turn, a in zip(trajectories[e].turns, turn_adv[e]):
                        seqs.append(turn.sequence())
                        old_rows.append(turn.logprobs)
                        row_adv.append(a)
                        row_ep.append(e - m * mb_size)  # the episode's index within its mini-batch
                batch = self.policy.collate(seqs)
                old = torch.zeros(batch.assistant_mask.shape, dtype=torch.float32)
                for i, s in enumerate(seqs):
                    start = len(s.prompt_ids)
                    old[i, start : start + len(s.completion_ids)] = torch.tensor(old_rows[i], dtype=old.dtype)
                ref = None
                if use_kl:
                    with torch.no_grad():
                        ref = self.policy.reference_logprobs(batch, algo.temperature)
                prepared[m].append((batch, old.to(device), torch.tensor(row_adv, device=device),
                                    torch.tensor(row_ep, dtype=torch.long, device=device), ref, len(seqs)))

        iterations = int(algo.iterations_per_step)
        kl_sum = clip_sum = loss_sum = norm_sum = 0.0
        updates = losses = 0
        # Dropout stays off (eval mode): the engine sampled with it off, so on-policy the ratio is exactly 1 and a
        # resumed run repeats the same update; ``lora.dropout`` acts in SFT only.
        self.policy.model.eval()
        for _ in range(iterations):
            for m in range(mini):
                if not prepared[m]:
                    continue  # every group of this mini-batch has equal rewards: no signal, no optimizer step
                self.optimizer.zero_grad(set_to_none=True)
                mb_loss = 0.0
                for batch, old, row_adv, row_ep, ref, _n in prepared[m]:
                    logprobs = self.policy.response_logprobs(batch, algo.temperature)  # [B, T]
                    chunk_tokens = int(batch.assistant_mask.sum())
                    loss, st = grpo_loss(
                        logprobs, old, row_adv, batch.assistant_mask, row_ep,
                        clip_ratio_low=algo.clip_ratio_low, clip_ratio_high=algo.clip_ratio_high,
                        ref_logprobs=ref, kl_coef=algo.kl_coef, aggregation=algo.loss_aggregation.value,
                        num_episodes=mb_size,
                    )
                    if algo.loss_aggregation.value == "token-mean":
                        loss = loss * (chunk_tokens / max(mb_tokens[m], 1))  # the mean over all tokens, accumulated
                    loss.backward()
                    mb_loss += float(loss.detach())
                    kl_sum += st.kl * chunk_tokens
                    clip_sum += st.clip_fraction * chunk_tokens
                loss_sum += mb_loss
                losses += 1
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, algo.max_grad_norm))
                if math.isfinite(grad_norm):
                    self.optimizer.step()
                    updates += 1
                    norm_sum += grad_norm
        self.optimizer.zero_grad(set_to_none=True)
        sequences = sum(p[-1] for mb in prepared for p in mb)
        per_token = max(total_tokens, 1) * iterations
        return UpdateStats(
            # Means over the optimizer updates' losses and the tokens. Without a KL term no reference forward runs:
            # report no KL rather than 0.
            loss=loss_sum / max(losses, 1), kl=kl_sum / per_token if use_kl else None,
            grad_norm=norm_sum / updates if updates else float("nan"),
            clip_fraction=clip_sum / per_token, tokens=total_tokens, sequences=sequences,
            zero_variance_groups=n_zero, skipped=updates == 0, seconds=time.perf_counter() - started,
            updates=updates, learning_rate=lr,
        )
