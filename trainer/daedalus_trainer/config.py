"""The `RLTrainingJob` API: one pydantic model that is the source of truth.

The CRD's `openAPIV3Schema` (defaults, enums, ranges, descriptions and CEL `x-kubernetes-validations`) is generated
from these classes by :mod:`daedalus_trainer.crd`; the operator and the trainer read the same models. Attribute
docstrings become field descriptions (``use_attribute_docstrings``), so they are the user's manual: keep them exact.

YAML uses camelCase (``groupSize``); Python uses snake_case (``group_size``). This module imports no torch and is safe
for the operator image.

Cross-field rules live twice on purpose: as pydantic validators (``daedalus validate``, the trainer, the operator) and as
CEL rules in the CRD (the API server rejects an invalid object at ``kubectl apply`` time). ``CEL_RULES`` below is the
single list both are derived from, and a test evaluates every rule with a CEL interpreter against the examples.
"""

from __future__ import annotations

import difflib
import enum
import functools
import io
import json
import logging
import re
import reprlib
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator,
                      model_validator)
from pydantic.alias_generators import to_camel

GROUP = "daedalus.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLTrainingJob"
PLURAL = "rltrainingjobs"
SINGULAR = "rltrainingjob"
SHORT_NAMES = ["rltj"]

#: Module names that live in Qwen3-VL's vision tower (``model.visual.*``: ``attn.qkv``, ``attn.proj``,
#: ``mlp.linear_fc1/2``, the patch merger). vLLM ignores LoRA on the vision tower for Qwen3-VL, so training it would make
#: rollout and training weights differ; such targets are rejected.
VISION_MODULE_MARKERS = ("visual", "qkv", "attn.proj", "linear_fc1", "linear_fc2", "merger", "patch_embed")
#: The linear projections of a Qwen3-VL language-model decoder layer (``model.language_model.layers.N``:
#: ``self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj``), the only names ``lora.targetModules`` accepts. peft
#: matches each name against the end of a module's dotted name (``policy.check_lora_targets``), and these seven match
#: every such projection of every layer and nothing in the vision tower. Any other name matches nothing (a typo, which
#: peft reports only once the model is loaded on the cluster), the vision tower (see above), or a module outside the
#: decoder layers' projections (the LM head, the embeddings) that this trainer and its vLLM rollouts were never used
#: with; so it is refused up front, by the CRD's `enum` as by the Python validator.
LANGUAGE_MODEL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The default targets: all seven language-model projections.
DEFAULT_LORA_TARGETS = list(LANGUAGE_MODEL_PROJECTIONS)


#: Largest seed a spec may carry: 2**31 - 1, so that every seed derived from it (``evalSeed * 1_000_003 + turn``, a
#: per-step ``torch.manual_seed``) fits the 64-bit integers torch and numpy take.
SEED_MAX = 2**31 - 1


class _Model(BaseModel):
    """Base: camelCase aliases, unknown fields rejected, attribute docstrings as descriptions, finite floats only
    (``.inf`` and ``.nan`` in YAML are refused with the field's path: an infinite ``lora.alpha`` would make every
    weight NaN from the first step)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=False,
        allow_inf_nan=False,
    )


def _is_vision_target(name: str) -> bool:
    """True when a LoRA target module name would match a module of the vision tower."""
    return name == "proj" or any(marker in name for marker in VISION_MODULE_MARKERS)


# --------------------------------------------------------------------------------------------------------------- spec
class ModelSpec(_Model):
    """The base vision-language model and the supervised starting point."""

    name: str = "Qwen/Qwen3-VL-8B-Instruct"
    """Model identifier, for humans and for serving (the served model name). Never downloaded at run time."""
    path: str | None = Field(None, min_length=1)
    """Local or shared-volume (FSx) directory holding the Hugging Face checkpoint. Required unless `tiny`."""
    sft_adapter: str | None = Field(None, min_length=1)
    """Directory of the starting point produced by supervised fine-tuning: a PEFT LoRA adapter or a full model
    directory. When absent and `tiny` is set, `daedalus run` trains one first (`sft` section)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Parameter dtype. CPU runs use float32 whatever this says."""
    tiny: bool = False
    """Build the tiny offline Qwen3-VL architecture (random init, ~0.8 M parameters, local tokenizer) instead of
    loading `path`: CPU runs and tests, no downloads."""


class LoraSpec(_Model):
    """LoRA adapter trained by GRPO (Hu et al. 2021, arXiv:2106.09685)."""

    rank: int = Field(16, ge=1, le=512, strict=True)
    """LoRA rank r."""
    alpha: float = Field(32.0, gt=0)
    """LoRA scaling numerator; the update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA input, in SFT only: GRPO's learner scores tokens with dropout off, as the rollout engine
    sampled them (on-policy the importance ratio is then exactly 1, and a resumed run repeats the same update)."""
    # Bounded (at most 64 names of at most 128 characters): the API server prices a CEL rule by the largest input
    # the schema allows, and the vision-target rule below runs `contains` on every name; unbounded, its estimated
    # cost exceeds the per-rule budget and the API server refuses the whole CRD.
    target_modules: list[Annotated[str, Field(min_length=1, max_length=128,
                                              json_schema_extra={"enum": list(LANGUAGE_MODEL_PROJECTIONS)})]] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS), min_length=1, max_length=64)
    """Language-model projections to adapt, each applied in every decoder layer: q_proj, k_proj, v_proj, o_proj
    (attention), gate_proj, up_proj, down_proj (MLP). Other names are rejected: vision-tower modules because vLLM
    ignores LoRA on Qwen3-VL's vision tower (rollout and training policies would differ), anything else because it
    names no language-model projection (a typo would otherwise fail only once the model is loaded)."""

    @field_validator("target_modules")
    @classmethod
    def _language_model_projections(cls, v: list[str]) -> list[str]:
        problems = []
        vision = [m for m in v if _is_vision_target(m)]
        if vision:
            problems.append(
                f"vision-tower LoRA targets {vision} are not allowed (vLLM ignores vision LoRA for Qwen3-VL); "
                f"use language-model projections such as {DEFAULT_LORA_TARGETS}"
            )
        unknown = [m for m in v if m not in LANGUAGE_MODEL_PROJECTIONS and m not in vision]
        if unknown:
            names = ", ".join(repr(m) for m in unknown)
            verb = "is not a language-model projection" if len(unknown) == 1 else "are not language-model projections"
            close = {m: difflib.get_close_matches(m, LANGUAGE_MODEL_PROJECTIONS, n=1, cutoff=0.6) for m in unknown}
            hints = [f"{c[0]!r}" + (f" for {m!r}" if len(unknown) > 1 else "") for m, c in close.items() if c]
            problems.append(f"{names} {verb} of Qwen3-VL ({', '.join(LANGUAGE_MODEL_PROJECTIONS)})"
                            + (f"; did you mean {', '.join(hints)}?" if hints else ""))
        if problems:
            raise ValueError("; ".join(problems))
        return v


class LossAggregation(str, enum.Enum):
    """How per-token losses become one scalar (see :func:`daedalus_trainer.grpo.grpo_loss`)."""

    TOKEN_MEAN = "token-mean"  # DAPO (Yu et al. 2025, arXiv:2503.14476)
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"  # Dr. GRPO (Liu et al. 2025, arXiv:2503.20783)
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"  # original GRPO (Shao et al. 2024, arXiv:2402.03300)


class AlgorithmSpec(_Model):
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300) on multi-turn episodes."""

    group_size: int = Field(8, ge=2, le=256, strict=True)
    """Episodes per maze (G). Advantages are computed within each group of episodes on the same maze."""
    mazes_per_step: int = Field(8, ge=1, le=4096, strict=True)
    """Mazes sampled per optimizer step; a step trains on mazesPerStep x groupSize episodes."""
    learning_rate: float = Field(1e-5, gt=0, le=1.0)
    """AdamW learning rate for the LoRA parameters."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping threshold (global L2 norm)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Coefficient of the KL penalty to the reference policy, the SFT start (a full SFT model: the trained adapter
    disabled; a PEFT `model.sftAdapter`: a frozen copy of it), k3 estimator (Schulman 2020). 0 disables it and skips
    the reference forward."""
    clip_ratio_low: float = Field(0.2, gt=0, lt=1)
    """PPO clip: the ratio is clipped below at 1 - clipRatioLow."""
    clip_ratio_high: float = Field(0.28, gt=0)
    """PPO clip: the ratio is clipped above at 1 + clipRatioHigh (DAPO's clip-higher uses 0.28)."""
    temperature: float = Field(1.0, gt=0, le=10)
    """Sampling temperature of rollouts."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold of rollouts."""
    max_tokens_per_turn: int = Field(24, ge=1, le=8192, strict=True)
    """Maximum generated tokens per turn; a turn cut off there is parsed as it stands."""
    loss_aggregation: LossAggregation = LossAggregation.TOKEN_MEAN
    """`token-mean` (DAPO), `seq-mean-token-sum` (Dr. GRPO) or `seq-mean-token-mean` (original GRPO)."""
    advantage_norm: Literal["group-std", "none"] = "group-std"
    """`group-std`: (r - mean) / (std + eps) within each group (GRPO); `none`: r - mean (Dr. GRPO)."""
    step_advantage_weight: float = Field(0.0, ge=0.0, le=100.0)
    """Weight w of the step-level advantage added to every turn's episode advantage (GiGPO, Feng et al. 2025,
    arXiv:2505.10978, which uses 1): turns of one group taken in the same environment state (the agent's cell)
    form a step group, and each turn's discounted return is compared within it. 0 (default) is plain GRPO, the
    episode's advantage on every turn."""
    step_discount: float = Field(0.95, gt=0.0, le=1.0)
    """Discount gamma of the step-level returns (`stepAdvantageWeight` > 0): a turn `k` turns before the reward
    returns `gamma ** k` of it, so from one cell the shorter way to the goal scores higher (GiGPO uses 0.95)."""
    iterations_per_step: int = Field(1, ge=1, le=64, strict=True)
    """Policy updates per batch of rollouts (mu of DeepSeekMath's Algorithm 1; TRL's `num_iterations`). Above 1 the
    later updates are off-policy and the clipped ratio bounds how far each moves; rollouts cost most of a step, so
    reusing them is cheap."""
    mini_batches: int = Field(1, ge=1, le=4096, strict=True)
    """Optimizer updates per pass over a batch of rollouts: the batch's groups are split, in order, into this many
    mini-batches of whole groups and each makes one AdamW step (PPO's minibatches, Schulman et al. 2017,
    arXiv:1707.06347; verl's `ppo_mini_batch_size`). Must divide `mazesPerStep`. Above 1 the later mini-batches
    are off-policy, as with `iterationsPerStep`, for no extra forward passes; a mini-batch whose groups all have
    equal rewards makes no step."""
    steps: int = Field(100, ge=1, le=10_000_000, strict=True)
    """Number of GRPO steps (batches of rollouts; each makes `iterationsPerStep` x `miniBatches` optimizer
    updates)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """`constant`: `learningRate` at every step; `cosine`: half a cosine from `learningRate` at step 1 down to 0
    after step `steps` (Loshchilov & Hutter 2017, SGDR, without restarts). A function of the step alone, so a
    resumed run continues the same schedule."""
    seed: int = Field(0, ge=0, le=SEED_MAX, strict=True)
    """Seed of maze sampling, rollouts and initialisation; a resumed run continues the same streams."""
    eval_interval_steps: int = Field(0, ge=0, strict=True)
    """Greedy evaluation on the held-out mazes every N steps (metric `daedalus_eval_success_ratio`); 0: only after
    the last step."""
    rollout_engine: Literal["auto", "transformers", "vllm"] = "auto"
    """Inference engine of the rollout workers. `auto`: vLLM where the worker sees a CUDA GPU, holds a share of it
    and can import vLLM, and `topP` is 1; transformers generation otherwise (always on CPU). `transformers`: always
    transformers. `vllm`: always vLLM; a worker without a GPU or without vLLM fails at start with the reason, and
    `topP` must be 1 (vLLM reports the log-probs of the top-p truncated distribution, not the policy's that the
    learner's importance ratio compares them with). Each worker logs the engine it uses; checkpoints record it.
    The vLLM path has not yet run on a real GPU."""
    rollout_workers: int = Field(0, ge=0, le=1024, strict=True)
    """Rollout actors (each samples its share of a step's episodes and of the held-out evaluation); 0: automatic.
    Automatic: on CPU 2 (1 on a 1-CPU machine), each actor half a CPU, like the learner; with one GPU in the Ray
    cluster 1, sharing that GPU with the learner; with n >= 2 GPUs n - 1, the learner holding the other (more
    workers than GPUs share them, 1/k of a GPU each). On a cluster, a count whose actors ask for more CPUs or GPUs
    than the Ray cluster has in all fails before any actor starts (Ray would never schedule the last one); a local
    run gives its Ray enough CPUs. May change on resume: a run resumed under another count samples other tokens
    (each worker draws its batch under its own seed), so it continues, logged as not bit-for-bit."""

    @field_validator("loss_aggregation", mode="before")
    @classmethod
    def _aggregation_by_value(cls, v: Any) -> Any:
        # Manifests name the mode by its string; strict parsing (parse_job) accepts only members otherwise.
        if isinstance(v, str) and not isinstance(v, LossAggregation):
            try:
                return LossAggregation(v)
            except ValueError:
                modes = ", ".join(repr(m.value) for m in LossAggregation)
                raise ValueError(f"must be one of {modes}; got {v!r}") from None
        return v


class EnvironmentSpec(_Model):
    """Multi-turn visual maze in the style of VisGym Maze2D."""

    name: Literal["maze2d"] = "maze2d"
    """Environment name."""
    size: int = Field(9, ge=5, le=63, strict=True)
    """Grid side in cells, outer walls included; must be odd (7 and 9 are easy, 11 hard)."""
    max_turns: int = Field(0, ge=0, le=10_000, strict=True)
    """Turn limit of an episode; 0 means twice the optimal number of actions of each maze."""
    observation: Literal["image", "ascii", "image+ascii"] = "image"
    """What the model sees each turn."""
    history_turns: int = Field(1, ge=1, le=64, strict=True)
    """How many recent turns (image + feedback) stay in the model's context, the current one included."""
    action_format: Literal["function", "tuple", "tag"] = "function"
    """Action syntax: `move("up")`, `('move', 1)` (VisGym numbering: 0 right, 1 up, 2 left, 3 down) or
    `<action>up</action>`; `stop` in the same style."""
    success_on: Literal["stop-on-goal", "arrival"] = "stop-on-goal"
    """`stop-on-goal`: success only when the agent says stop on the goal (VisGym); `arrival`: on entering it."""
    cell_pixels: int = Field(25, ge=4, le=128, strict=True)
    """Rendered cell size in pixels (VisGym uses 25; the tiny model learns with 16: one ViT patch per cell)."""
    eval_mazes: int = Field(64, ge=1, le=100_000, strict=True)
    """Size of the held-out evaluation set; its layouts are excluded from every training sampler."""
    eval_seed: int = Field(1234, ge=0, le=SEED_MAX, strict=True)
    """Seed of the held-out evaluation set."""
    eval_corners: int = Field(1, ge=1, le=4, strict=True)
    """Start/goal corner pairs each held-out layout is played from: 1 = the pair drawn with the maze; up to 4 =
    that pair and the next of VisGym's four opposite-corner pairs. `evalMazes x evalCorners` episodes per
    evaluation, on the same layouts: a tighter interval for the same held-out set (the intervals then resample
    layouts, not episodes, since corner pairs of one layout are not independent). The check on training layouts
    keeps one pair per maze."""

    @field_validator("size")
    @classmethod
    def _odd(cls, v: int) -> int:
        if v % 2 != 1:
            raise ValueError(f"must be odd (outer walls included), e.g. 7, 9 or 11; got {v}")
        return v


class SFTSpec(_Model):
    """Supervised fine-tuning on solver demonstrations (and, with `onPolicyFraction`, on the policy's own states
    labelled by the solver: DAgger), run by `daedalus sft` or by `daedalus run` when `model.sftAdapter` is absent and
    the model is tiny."""

    steps: int = Field(3000, ge=0, le=10_000_000, strict=True)
    """Maximum optimizer steps."""
    max_seconds: float = Field(0.0, ge=0)
    """Wall-clock budget in seconds (the run stops at whichever of steps / maxSeconds comes first; 0, the default,
    is no limit: a laptop demo such as examples/local-tiny.yaml sets one so that a slow machine still finishes)."""
    batch_size: int = Field(32, ge=1, le=4096, strict=True)
    """Demonstration turns per optimizer step."""
    learning_rate: float = Field(1e-3, gt=0, le=1.0)
    """AdamW learning rate (full fine-tune of the tiny model; LoRA for real models)."""
    seed: int = Field(0, ge=0, le=SEED_MAX, strict=True)
    """Seed of demonstration sampling."""
    eval_every: int = Field(0, ge=0, strict=True)
    """Evaluate on the held-out set every N steps (0: only at the end)."""
    on_policy_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Share of each batch taken from the policy's own greedy episodes on training mazes, every visited state
    labelled by the solver (DAgger, Ross et al. 2011); 0 = solver demonstrations only. Measured on the tiny model:
    0.5 reached 72% held-out greedy success in 1000 steps from the random model, against 47% for demonstrations
    only (docs/grpo-experiments.md)."""
    on_policy_every: int = Field(50, ge=1, le=1_000_000, strict=True)
    """Steps between refreshes of the on-policy pool (each refresh plays 32 greedy episodes with the current
    policy)."""


class CheckpointSpec(_Model):
    """Checkpoints on shared storage (FSx for Lustre on HyperPod)."""

    volume: str | None = None
    """PersistentVolumeClaim (e.g. the FSx for Lustre claim) mounted on every Ray pod at the deepest directory that
    `path` shares with the absolute `model.path` and `model.sftAdapter` (`/fsx/models/...` and
    `/fsx/daedalus/checkpoints` mount it at `/fsx`), so one claim can hold base model, SFT adapter and checkpoints;
    at `path` itself when they share nothing but `/`."""
    path: str = Field("/checkpoints", min_length=1)
    """Directory of checkpoints; the trainer writes under `<path>/<namespace>/<job name>/`."""
    interval_steps: int = Field(10, ge=1, strict=True)
    """Checkpoint every N GRPO steps (and on demand, e.g. before a HyperPod node replacement)."""
    keep: int = Field(3, ge=1, le=1000, strict=True)
    """How many recent checkpoints to keep."""


class Toleration(_Model):
    """A Kubernetes pod toleration (core/v1 Toleration)."""

    key: str | None = None
    """Taint key."""
    operator: Literal["Exists", "Equal"] | None = None
    """Toleration operator."""
    value: str | None = None
    """Taint value."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect."""
    toleration_seconds: int | None = Field(None, strict=True)
    """For NoExecute: how long the pod stays bound after the taint appears."""


#: A Kubernetes resource quantity ("4", "500m", "16Gi", "1e3"): the regular expression of apimachinery's
#: ``resource.Quantity`` (k8s.io/apimachinery/pkg/api/resource), as KubeRay's CRD and ``kubectl explain`` give it.
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+"
                    r"(\.[0-9]*)?)|(\.[0-9]+))))?$")
#: A quantity greater than zero: :data:`QUANTITY_PATTERN` without the minus sign and with a non-zero digit in the
#: number ("0", "0.0", "-2" are refused; "500m", "0.5", "1e3" pass). The pod resources of the RayCluster (cpu, memory,
#: /dev/shm) must be positive: the API server refuses negative resource quantities (core/v1 ResourceRequirements
#: validation) and a Ray pod with no cpu or memory cannot run. A regular expression rather than a CEL rule so the
#: CRD keeps working without the CEL quantity library.
POSITIVE_QUANTITY_PATTERN = (r"^\+?(([0-9]*[1-9][0-9]*(\.[0-9]*)?)|([0-9]*\.[0-9]*[1-9][0-9]*))(([KMGTPE]i)|"
                             r"[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")


def _whole_number_quantity(value: Any) -> Any:
    """An unquoted whole number (``cpu: 8``) as the quantity ``"8"``: Kubernetes reads resource quantities as
    IntOrString (core/v1 ResourceList; KubeRay's CRD marks them ``x-kubernetes-int-or-string``), so ``kubectl apply``
    takes both spellings. Booleans and fractions are left to the string check (``0.5`` must be quoted, or ``500m``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


#: A positive resource quantity of a Ray pod: a string matching :data:`POSITIVE_QUANTITY_PATTERN`, or a whole number
#: greater than zero (read as its decimal string). In the CRD: ``x-kubernetes-int-or-string`` with the pattern for
#: strings and ``minimum: 1`` for integers (the pattern does not apply to them; :mod:`daedalus_trainer.crd`).
PositiveQuantity = Annotated[
    str, Field(pattern=POSITIVE_QUANTITY_PATTERN, json_schema_extra={"x-kubernetes-int-or-string": True, "minimum": 1}),
    BeforeValidator(_whole_number_quantity)]
#: A Kubernetes object name that must be a DNS label (RFC 1123), as a worker group name or a namespace.
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: A job's `metadata.name`: a DNS label that starts with a letter (RFC 1035), because it begins the names of the job's
#: RayCluster and RayService, which KubeRay requires to be DNS-1035 labels (ray-operator utils/validation.go,
#: ValidateRayClusterMetadata / ValidateRayServiceMetadata: a name such as "2024-maze-ray" is never reconciled).
JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
#: The same rule for the API server, at the CRD's root (where `self.metadata.name` is visible to CEL).
JOB_NAME_CEL = "self.metadata.name.matches('^[a-z]')"
JOB_NAME_MESSAGE = ("metadata.name must start with a lowercase letter: it begins the name of the job's RayCluster, "
                    "which KubeRay requires to be a DNS-1035 label")


class HeadSpec(_Model):
    """Ray head group: the driver, the trainer's HTTP endpoint; no GPUs and `num-cpus: 0` (no tasks scheduled)."""

    cpu: PositiveQuantity = "4"
    """CPU request and limit of the head pod (a positive quantity: 4, "4", "500m")."""
    memory: PositiveQuantity = "16Gi"
    """Memory request and limit of the head pod (a positive quantity: "16Gi")."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node selector labels of the head pod (also the serving RayService's head), e.g. a CPU node group's."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Tolerations of the head pod (also the serving RayService's head): needed where every node is tainted, as in
    GPU-only HyperPod clusters, or the head stays Pending."""


class WorkerGroupSpec(_Model):
    """One KubeRay worker group."""

    name: str = Field("gpu", pattern=DNS_LABEL_PATTERN, max_length=40)
    """Worker group name (DNS label)."""
    replicas: int = Field(1, ge=0, le=1000, strict=True)
    """Number of worker pods."""
    gpus_per_worker: int = Field(8, ge=0, le=16, strict=True)
    """`nvidia.com/gpu` per worker pod."""
    cpu: PositiveQuantity = "32"
    """CPU request and limit per worker pod (a positive quantity: 32, "32", "500m")."""
    memory: PositiveQuantity = "256Gi"
    """Memory request and limit per worker pod (a positive quantity: "256Gi")."""
    shm_size: PositiveQuantity = "64Gi"
    """Size of the in-memory `/dev/shm` volume (NCCL, Ray object store; a positive quantity: "64Gi")."""
    instance_type: str | None = None
    """Pin to an instance type (label `node.kubernetes.io/instance-type`), e.g. ml.p5.48xlarge."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Extra node selector labels."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Pod tolerations."""
    efa: int = Field(0, ge=0, le=32, strict=True)
    """`vpc.amazonaws.com/efa` devices per worker pod (0 = no EFA)."""


class ClusterSpec(_Model):
    """The KubeRay RayCluster the operator creates for the job. Ignored by `daedalus run` (local mode)."""

    image: str = "ghcr.io/daedalus-rl/daedalus-trainer:0.1.0"
    """Trainer image (Dockerfile.trainer) for head and workers."""
    ray_version: str = "2.60.0"
    """Ray version inside the image (KubeRay `rayVersion`)."""
    service_account_name: str | None = None
    """ServiceAccount of the Ray pods."""
    pod_security: Literal["restricted", "baseline"] = "restricted"
    """The Pod Security Standards level (kubernetes.io/docs/concepts/security/pod-security-standards) the Ray pods of
    the job (training RayCluster and serving RayService) are built to meet. `restricted`: `runAsNonRoot` and the
    `RuntimeDefault` seccomp profile on the pods, no privilege escalation and every capability dropped in each
    container; the image must name a numeric non-root user (the trainer image's is 10001), or the kubelet refuses to
    start it. `baseline`: no securityContext, for an image that runs as root or names its user by name; such pods are
    refused in a namespace that enforces `restricted`."""
    head: HeadSpec = Field(default_factory=HeadSpec)
    """Head group resources."""
    worker_groups: list[WorkerGroupSpec] = Field(default_factory=lambda: [WorkerGroupSpec()], max_length=16)
    """Worker groups; at least one must have GPUs unless `model.tiny`."""


class ResilienceSpec(_Model):
    """How the operator keeps the job alive."""

    max_restarts: int = Field(10, ge=0, le=1000, strict=True)
    """Resubmissions after unplanned failures (infrastructure and application failures together) allowed before the
    job is Failed (RestartLimitExceeded). Planned ones, after HyperPod marked a node for replacement or reboot, do not
    count (`status.plannedRestarts`)."""
    restart_backoff_seconds: int = Field(15, ge=0, le=3600, strict=True)
    """Base of the exponential backoff between restarts (doubles per consecutive failure, capped at 10 minutes)."""
    hyper_pod: bool = True
    """Watch the SageMaker HyperPod node-health label and keep pods off nodes it marks `Unschedulable*`. An edit
    changes the watching at once; the required node affinity is part of the RayCluster's pod templates, set when the
    RayCluster is created (never patched; pods KubeRay recreates keep it): it follows the edit with the next
    RayCluster, e.g. after suspend and resume."""
    checkpoint_on_node_warning: bool = True
    """When HyperPod marks a node for replacement or reboot, checkpoint before stopping (zero lost steps)."""
    checkpoint_on_drain: bool = True
    """Treat a node under the job's pods that is being emptied (cordoned by `kubectl cordon`/`kubectl drain`; tainted
    for removal by Karpenter, the cluster autoscaler or an EKS managed node group update; being deleted) like a
    HyperPod announcement: checkpoint, stop, and bring the pods up elsewhere (a planned restart, reason NodeDrain).
    The operator also keeps a PodDisruptionBudget (`minAvailable`: all of them; pods not Ready always evictable) over the
    job's Ray pods, so a drain's evictions wait until the checkpoint is written and the operator has moved the pods
    itself. `false`: no PodDisruptionBudget, and training goes on on a cordoned node until a drain evicts its pods
    (an unplanned restart from the latest checkpoint). Editable while the job runs."""
    checkpoint_timeout_seconds: int = Field(300, ge=1, le=86_400, strict=True)
    """How long to wait for a requested checkpoint before stopping anyway."""
    progress_deadline_seconds: int = Field(1800, ge=30, le=604_800, strict=True)
    """No step advance for this long while Running counts as hung: checkpoint if possible, restart."""


class ServingSpec(_Model):
    """Serve the exported LoRA adapter after the job succeeds."""

    enabled: bool = False
    """When the job succeeds, create a KubeRay RayService (Ray Serve LLM) that serves the exported adapter. Needs
    the annotation `daedalus.dev/serving-lora-uri` on the job: the object-store URI (s3://, gs://, abfss://,
    azure://) the adapter is mirrored to, since Ray Serve LLM loads LoRA adapters from object storage only; without
    it the job succeeds with a ServingNotConfigured warning event and nothing is served."""
    replicas: int = Field(1, ge=1, le=100, strict=True)
    """Serving replicas."""
    image: str | None = None
    """Serving image (defaults to the cluster image). It needs Ray Serve LLM at the cluster's Ray version
    (`ray[serve,llm]`; Ray 2.60's `llm` extra pins vLLM 0.29.0), which Dockerfile.trainer's image (vLLM 0.33.0 for
    rollouts, no `llm` extra) does not have: set it to a serving image."""
    gpus_per_replica: int = Field(1, ge=0, le=16, strict=True)
    """GPUs per serving replica."""


class RLTrainingJobSpec(_Model):
    """Desired state of an RLTrainingJob."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    """Base model and SFT starting point."""
    lora: LoraSpec = Field(default_factory=LoraSpec)
    """LoRA adapter."""
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    """GRPO hyper-parameters."""
    environment: EnvironmentSpec = Field(default_factory=EnvironmentSpec)
    """Maze environment."""
    sft: SFTSpec = Field(default_factory=SFTSpec)
    """Supervised warm start (tiny/local runs)."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """Checkpoint storage and cadence."""
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    """RayCluster shape."""
    resilience: ResilienceSpec = Field(default_factory=ResilienceSpec)
    """Failure handling."""
    serving: ServingSpec = Field(default_factory=ServingSpec)
    """Adapter serving."""
    suspend: bool = False
    """Checkpoint, stop the Ray job and delete the RayCluster; set back to false to resume."""

    @model_validator(mode="after")
    def _cross_field(self) -> "RLTrainingJobSpec":
        failed = [rule for rule in CEL_RULES if not rule.python(self)]
        if failed:
            # One line per rule, "<field path>: <message>"; parse_job splits them back into separate errors.
            raise ValueError("\n".join(f"{r.error_path}: {r.message}" for r in failed))
        return self


# ------------------------------------------------------------------------------------------------------------- status
class Phase(str, enum.Enum):
    """Coarse lifecycle for humans and printer columns; conditions carry the machine-readable detail."""

    PENDING = "Pending"
    PROVISIONING = "Provisioning"
    RUNNING = "Running"
    CHECKPOINTING = "Checkpointing"
    RECOVERING = "Recovering"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


#: An RFC 3339 time in the status (``2026-01-02T03:04:05Z``, as ``metav1.Time`` is written). Read as a plain string, so
#: a status is never refused when it is read back, but the CRD gives it ``format: date-time``, as Kubernetes does for
#: ``metav1.Time``: the API server refuses a value that is not a time when it is written (by hand: ``kubectl edit
#: --subresource=status``), so the operator never meets one it cannot parse.
Timestamp = Annotated[str, WithJsonSchema({"type": "string", "format": "date-time"})]


class Condition(_Model):
    """A `metav1.Condition` (k8s.io/apimachinery/pkg/apis/meta/v1)."""

    type: str
    """Condition type: Ready, Reconciling, Stalled, Succeeded, Failed, Suspended."""
    status: Literal["True", "False", "Unknown"]
    """Condition status."""
    reason: str = "Unknown"
    """CamelCase reason."""
    message: str = ""
    """Human-readable detail."""
    last_transition_time: Timestamp | None = None
    """RFC 3339 time of the last status flip."""
    observed_generation: int | None = None
    """`.metadata.generation` the condition was computed from."""


class CheckpointRef(_Model):
    """A checkpoint written by the trainer."""

    step: int = 0
    """GRPO step the checkpoint holds."""
    path: str = ""
    """Directory of the checkpoint on the shared volume."""
    time: Timestamp | None = None
    """RFC 3339 time it was written."""


class FailureInfo(_Model):
    """The last failure the operator handled."""

    reason: str = ""
    """CamelCase reason (NodeReplacement, NodeReboot, NodeLost, HeadLost, WorkerLost, ApplicationError, Hung, ...)."""
    node: str | None = None
    """Node involved, if any."""
    message: str = ""
    """Detail (Ray job message, node condition, ...)."""
    time: Timestamp | None = None
    """RFC 3339 time of detection."""


class JobMetrics(_Model):
    """Latest trainer figures, copied from the trainer's /status."""

    success_rate: float | None = None
    """Training success ratio of the latest step (0-1)."""
    reward_mean: float | None = None
    """Mean episode reward of the latest step."""
    steps_per_hour: float | None = None
    """Recent throughput in steps per hour."""
    eval_success_rate: float | None = None
    """Held-out greedy success ratio of the latest evaluation (0-1)."""


class RecoveryInfo(_Model):
    """A recovery in progress, written by the operator; cleared once the resubmitted attempt completes a step beyond
    the step it resumed from (then summarised in `lastRecovery`)."""

    reason: str = ""
    """CamelCase reason (NodeReplacement, NodeReboot, WorkerLost, HeadLost, JobFailed, Hung, Suspend, ...)."""
    node: str | None = None
    """Node that triggered it, if any."""
    message: str = ""
    """Detail."""
    detected_at: Timestamp | None = None
    """RFC 3339 time the operator detected the cause."""
    step_at_detection: int = 0
    """Latest completed step the trainer had reported at detection."""
    checkpoint_requested_at: Timestamp | None = None
    """RFC 3339 time a checkpoint was requested from the trainer (announced failures, hangs, suspend)."""
    checkpoint_target_step: int | None = None
    """The requested checkpoint is done once the latest checkpoint holds at least this step."""
    stop_requested_at: Timestamp | None = None
    """RFC 3339 time the Ray job was asked to stop."""
    unconfirmed_since: Timestamp | None = None
    """RFC 3339 time from which the operator has had no evidence that the replaced attempt ended (its dashboard
    unanswering); the RayCluster is recreated once this lasts longer than the unreachable grace."""
    not_before: Timestamp | None = None
    """Restart backoff: no resubmission before this RFC 3339 time."""
    resubmitted_at: Timestamp | None = None
    """RFC 3339 time the next attempt was submitted."""
    resume_step: int | None = None
    """Step of the latest checkpoint when the next attempt was submitted (where it resumes)."""


class RecoveryRecord(_Model):
    """Summary of the last completed recovery."""

    reason: str = ""
    """CamelCase reason of the recovery."""
    detected_at: Timestamp | None = None
    """RFC 3339 time the cause was detected."""
    recovered_at: Timestamp | None = None
    """RFC 3339 time the resumed attempt first reported a step beyond its resume step."""
    seconds: float = 0.0
    """recoveredAt - detectedAt, in seconds."""
    step_at_detection: int = 0
    """Latest completed step at detection."""
    resumed_from_step: int = 0
    """Checkpoint step the new attempt resumed from."""
    lost_steps: int = 0
    """stepAtDetection - resumedFromStep (0 when a checkpoint was taken before stopping)."""


class RLTrainingJobStatus(_Model):
    """Observed state of an RLTrainingJob, written by the operator."""

    model_config = ConfigDict(extra="allow")

    phase: Phase | None = None
    """Lifecycle phase."""
    conditions: list[Condition] = Field(default_factory=list)
    """metav1.Condition list (kstatus: Ready, Reconciling, Stalled; plus Succeeded, Failed, Suspended)."""
    observed_generation: int | None = None
    """Generation of the spec the status reflects."""
    ray_cluster_name: str | None = None
    """Name of the RayCluster child (recorded before it is created)."""
    attempt: int = 0
    """Current submission attempt (1-based once submitted)."""
    submission_id: str | None = None
    """Ray job submission id of the current attempt (`<job>-<uid8>-a<attempt>`)."""
    current_step: int = 0
    """Latest completed GRPO step reported by the trainer."""
    total_steps: int | None = None
    """`spec.algorithm.steps`."""
    latest_checkpoint: CheckpointRef | None = None
    """Newest verified checkpoint."""
    restarts: int = 0
    """Resubmissions so far, planned ones included."""
    planned_restarts: int = 0
    """Of `restarts`, those after HyperPod marked a node for replacement or reboot; `restarts - plannedRestarts`
    counts against `spec.resilience.maxRestarts`."""
    last_failure: FailureInfo | None = None
    """Last failure handled."""
    metrics: JobMetrics | None = None
    """Latest trainer figures."""
    start_time: Timestamp | None = None
    """RFC 3339 time the first attempt was submitted."""
    completion_time: Timestamp | None = None
    """RFC 3339 time the job succeeded or failed."""
    dashboard_url: str | None = None
    """Ray dashboard URL of the RayCluster."""
    adapter_path: str | None = None
    """Exported PEFT LoRA adapter (servable by vLLM)."""
    submission_confirmed: bool = False
    """True once the Ray job `submissionId` was seen on the head (a missing job is then lost, not unsubmitted)."""
    attempt_start_time: Timestamp | None = None
    """RFC 3339 time the current attempt was submitted (pods created later replaced a lost one)."""
    last_progress_time: Timestamp | None = None
    """RFC 3339 time the reported step last advanced (progressDeadlineSeconds is measured from here)."""
    consecutive_failures: int = 0
    """Unplanned failures since the last attempt that made progress (restart backoff exponent)."""
    unreachable_since: Timestamp | None = None
    """RFC 3339 time the Ray dashboard first failed to answer during the current attempt."""
    recovery: RecoveryInfo | None = None
    """The recovery in progress, if any."""
    last_recovery: RecoveryRecord | None = None
    """The last completed recovery."""
    serving_name: str | None = None
    """Name of the RayService serving the adapter (spec.serving.enabled)."""


#: The name part of a label or annotation key, and a non-empty label value: at most 63 characters, letters, digits,
#: '-', '_' and '.', beginning and ending with a letter or digit (Kubernetes "Labels and Selectors", syntax and
#: character set: https://kubernetes.io/docs/concepts/overview/working-with-objects/labels/#syntax-and-character-set).
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
#: The optional prefix of a key (before '/'): a DNS subdomain, dot-separated DNS labels, at most 253 characters.
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
#: The API server's limit on the total size of an object's annotations, keys and values (256 KiB; annotation keys
#: follow label-key syntax: https://kubernetes.io/docs/concepts/overview/working-with-objects/annotations/).
ANNOTATIONS_MAX_BYTES = 256 * 1024
_KEY_RULE = ("an optional DNS-subdomain prefix and '/', then a name of at most 63 characters: letters, digits, "
             "'-', '_' and '.', beginning and ending with a letter or digit")
_VALUE_RULE = ("at most 63 characters: letters, digits, '-', '_' and '.', beginning and ending with a letter or digit, "
               "or empty")


def _key_problem(key: Any) -> str | None:
    """Why ``key`` is not a valid label or annotation key (a Kubernetes qualified name), else None."""
    if not isinstance(key, str):
        return f"keys are strings; got the {_kind_of(key)} {key!r}" + (" (quote it)" if key is not None else "")
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return f"{key!r} is not a valid key: its prefix {prefix!r} must be a lowercase DNS subdomain ({_KEY_RULE})"
    if len(name) > 63 or not _LABEL_NAME.match(name):
        return f"{key!r} is not a valid key ({_KEY_RULE})"
    return None


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxlist, _SHORT_REPR.maxdict, _SHORT_REPR.maxtuple, _SHORT_REPR.maxset = 2, 4, 4, 4, 4
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = _SHORT_REPR.maxlong = 200


def _shown(value: Any) -> str:
    """``repr(value)`` for an error message; a list or mapping is cut to its first 4 items and 2 levels (``[...]``,
    ``...``), reading only what is shown, so a large value, or YAML aliases nested into a billion strings, cannot
    make the message megabytes long (or its formatting hang). Strings are shown whole; a boolean or null as YAML
    writes it (``true``, ``false``, ``null``), not as Python does."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return repr(value) if isinstance(value, str) else _SHORT_REPR.repr(value)


def _kind_of(value: Any) -> str:
    return {bool: "boolean", int: "number", float: "number"}.get(type(value), type(value).__name__)


def _string_value_problem(key: Any, value: Any) -> str | None:
    if value is None:
        return f"the value of {key!r} is empty: write \"\" for an empty string"
    if not isinstance(value, str):
        quote = " (quote it)" if isinstance(value, (bool, int, float)) else ""
        return f"the value of {key!r} must be a string; got the {_kind_of(value)} {_shown(value)}{quote}"
    return None


class ObjectMeta(_Model):
    """The part of metav1.ObjectMeta the trainer and `daedalus validate` read, checked as the API server checks it
    (Kubernetes API conventions, "Metadata"; names and namespaces: "Object Names and IDs",
    https://kubernetes.io/docs/concepts/overview/working-with-objects/names/). Other metadata fields (uid,
    resourceVersion, ... in an object read back from the API server) are kept unchecked."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=JOB_NAME_PATTERN, max_length=63)
    """Job name, required: a DNS label that starts with a letter (RFC 1035, at most 63 characters), because it names
    the job's RayCluster (which KubeRay requires to be a DNS-1035 label), pods and label values; local runs keep their files under it (`runs/<name>/`), so a default name would make two
    unnamed jobs share (and resume) each other's files."""
    namespace: str = Field("default", pattern=DNS_LABEL_PATTERN, max_length=63)
    """Namespace: an RFC 1123 DNS label (at most 63 characters), as Kubernetes requires of namespace names. Local
    runs also write under `<checkpoint.path>/<namespace>/<name>/`, which this keeps inside `checkpoint.path` (no
    `..` or `/`)."""
    labels: dict[Any, Any] | None = None
    """Labels: string keys and values in Kubernetes label syntax (see :data:`_LABEL_NAME`)."""
    annotations: dict[Any, Any] | None = None
    """Annotations: keys in label-key syntax, string values, at most 256 KiB in all."""

    @field_validator("labels")
    @classmethod
    def _label_syntax(cls, v: dict[Any, Any] | None) -> dict[Any, Any] | None:
        problems = []
        for key, value in (v or {}).items():
            problem = _key_problem(key) or _string_value_problem(key, value)
            if problem is None and (len(value) > 63 or (value and not _LABEL_NAME.match(value))):
                problem = f"the value {value!r} of {key!r} is not a valid label value ({_VALUE_RULE})"
            if problem:
                problems.append(problem)
        if problems:  # one error per problem, each at metadata.labels (as the API server reports them)
            raise ValueError("\n".join(f"metadata.labels: {p}" for p in problems))
        return v

    @field_validator("annotations")
    @classmethod
    def _annotation_syntax(cls, v: dict[Any, Any] | None) -> dict[Any, Any] | None:
        problems = [p for key, value in (v or {}).items()
                    if (p := _key_problem(key) or _string_value_problem(key, value))]
        if not problems:
            size = sum(len(k.encode()) + len(val.encode()) for k, val in (v or {}).items())
            if size > ANNOTATIONS_MAX_BYTES:
                problems.append(f"{size} bytes in all; the API server allows at most {ANNOTATIONS_MAX_BYTES} (256 KiB)")
        if problems:
            raise ValueError("\n".join(f"metadata.annotations: {p}" for p in problems))
        return v


class RLTrainingJob(_Model):
    """An RL post-training job: `apiVersion: daedalus.dev/v1alpha1`, `kind: RLTrainingJob`. Unknown top-level keys
    are errors, as ``kubectl apply``'s strict field validation makes them (a `suspend:` meant for `spec` is not
    silently dropped)."""

    api_version: Literal["daedalus.dev/v1alpha1"] = API_VERSION
    """API version."""
    kind: Literal["RLTrainingJob"] = KIND
    """Kind."""
    metadata: ObjectMeta
    """Object metadata; `name` is required."""
    spec: RLTrainingJobSpec
    """Desired state (required; its sections may be left out for their defaults)."""
    status: RLTrainingJobStatus | None = None
    """Observed state."""

    def to_manifest(self) -> dict[str, Any]:
        """The object as a Kubernetes manifest dict (camelCase, no status, defaults filled in)."""
        return self.model_dump(by_alias=True, mode="json", exclude={"status"}, exclude_none=True)


# ---------------------------------------------------------------------------------------------------------- CEL rules
class CelRule:
    """A cross-field rule stated once: CEL for the API server, a Python twin for everything else.

    ``path`` is the JSON path of the object the rule is attached to in the CRD; ``rule`` is evaluated there with `self`
    bound to that object (Kubernetes CEL, apiextensions.k8s.io/v1 `x-kubernetes-validations`). ``python`` is the twin,
    a predicate over the whole :class:`RLTrainingJobSpec`.
    """

    def __init__(self, path: str, rule: str, message: str, python, field_path: str | None = None):
        self.path = path
        self.rule = rule
        self.message = message
        self.python = python
        self.field_path = field_path

    @property
    def error_path(self) -> str:
        """Field path reported to users, e.g. ``spec.cluster.workerGroups``."""
        return self.path + (self.field_path or "")

    def as_validation(self) -> dict[str, str]:
        """The `x-kubernetes-validations` entry."""
        v = {"rule": self.rule, "message": self.message}
        if self.field_path:
            v["fieldPath"] = self.field_path
        return v


#: Training layouts a job needs besides its held-out set: at least this many (fewer teaches layouts by heart rather
#: than navigation), and no fewer than it holds out.
MIN_TRAINING_LAYOUTS = 16

#: Distinct perfect-maze layouts at the sides where ``evalMazes`` can leave too few for training: the spanning trees
#: of the ``n x n`` room grid, ``n = (size - 1) // 2`` (Kirchhoff's matrix-tree theorem; computed by
#: :func:`daedalus_trainer.envs.count_layouts`, and a test keeps the two equal). From size 11 on (557,568,000
#: layouts) every allowed ``evalMazes`` (at most 100,000) leaves enough.
SMALL_SIZE_LAYOUTS: dict[int, int] = {5: 4, 7: 192, 9: 100_352}


def max_eval_mazes(possible: float) -> int:
    """The largest held-out set that leaves ``max(MIN_TRAINING_LAYOUTS, evalMazes)`` of ``possible`` layouts for
    training (0: none does)."""
    return max(0, int(min(possible - MIN_TRAINING_LAYOUTS, possible // 2)))


_LAYOUT_LIMITS = {size: max_eval_mazes(n) for size, n in SMALL_SIZE_LAYOUTS.items()}


def _layouts_ok(size: int, eval_mazes: int) -> bool:
    return eval_mazes <= _LAYOUT_LIMITS.get(size, eval_mazes)
_LAYOUT_CEL = " && ".join(f"(self.size != {size} || self.evalMazes <= {limit})"
                          for size, limit in _LAYOUT_LIMITS.items())
_LAYOUT_MESSAGE = (
    f"environment.evalMazes must leave at least {MIN_TRAINING_LAYOUTS} training layouts and no fewer than it holds "
    "out: " + ", ".join(f"at most {limit} at size {size}" for size, limit in _LAYOUT_LIMITS.items() if limit)
    + "; size " + ", ".join(str(size) for size, limit in _LAYOUT_LIMITS.items() if not limit)
    + " has too few layouts (use 7 or more)"
)

_VISION_CEL = " || ".join(
    ["m == 'proj'"] + [f"m.contains('{marker}')" for marker in VISION_MODULE_MARKERS]
)

CEL_RULES: list[CelRule] = [
    CelRule(
        "spec.environment",
        "self.size % 2 == 1",
        "environment.size must be odd (outer walls included), e.g. 7, 9 or 11",
        lambda s: s.environment.size % 2 == 1,
        field_path=".size",
    ),
    CelRule(
        "spec.environment",
        _LAYOUT_CEL,
        _LAYOUT_MESSAGE,
        lambda s: _layouts_ok(s.environment.size, s.environment.eval_mazes),
        field_path=".evalMazes",
    ),
    CelRule(
        "spec.algorithm",
        "self.mazesPerStep % self.miniBatches == 0",
        "algorithm.miniBatches must divide algorithm.mazesPerStep (each mini-batch holds whole groups)",
        lambda s: s.algorithm.mazes_per_step % s.algorithm.mini_batches == 0,
        field_path=".miniBatches",
    ),
    CelRule(
        "spec.algorithm",
        # double(): a topP written as the integer 1 is an int to a CEL interpreter that does not apply the schema's
        # number type, and CEL has no int == double overload
        "self.rolloutEngine != 'vllm' || double(self.topP) == 1.0",
        "algorithm.rolloutEngine vllm needs algorithm.topP 1: vLLM reports the log-probs of the top-p truncated "
        "distribution, not the policy's the learner compares them with (use topP 1, or rolloutEngine transformers)",
        lambda s: s.algorithm.rollout_engine != "vllm" or s.algorithm.top_p == 1,
        field_path=".topP",
    ),
    CelRule(
        "spec.lora",
        f"!self.targetModules.exists(m, {_VISION_CEL})",
        "lora.targetModules must not name vision-tower modules (vLLM ignores vision LoRA for Qwen3-VL)",
        lambda s: not any(_is_vision_target(m) for m in s.lora.target_modules),
        field_path=".targetModules",
    ),
    CelRule(
        "spec",
        "self.model.tiny || self.cluster.workerGroups.exists(g, g.gpusPerWorker > 0 && g.replicas > 0)",
        "cluster.workerGroups needs at least one group with gpusPerWorker > 0 and replicas > 0 unless model.tiny",
        lambda s: s.model.tiny or any(g.gpus_per_worker > 0 and g.replicas > 0 for g in s.cluster.worker_groups),
        field_path=".cluster.workerGroups",
    ),
    CelRule(
        "spec",
        "self.model.tiny || has(self.model.path)",
        "model.path is required unless model.tiny (no model downloads at run time)",
        lambda s: s.model.tiny or s.model.path is not None,
        field_path=".model.path",
    ),
    CelRule(
        "spec.cluster",
        "self.workerGroups.all(a, self.workerGroups.filter(b, b.name == a.name).size() == 1)",
        "cluster.workerGroups names must be unique",
        lambda s: len({g.name for g in s.cluster.worker_groups}) == len(s.cluster.worker_groups),
        field_path=".workerGroups",
    ),
]


# ------------------------------------------------------------------------------------------------------------ loading
class SpecError(ValueError):
    """An invalid RLTrainingJob. ``errors`` holds one ``(field path, message)`` pair per problem; ``note``, when set,
    says what was not checked because of them (:data:`CROSS_FIELD_NOT_CHECKED`), shown after the errors."""

    def __init__(self, errors: list[tuple[str, str]], source: str = "RLTrainingJob", *, note: str | None = None):
        self.errors, self.note = errors, note
        lines = "\n".join(f"  {p}: " + str(m).replace("\n", "\n      ") for p, m in errors)
        super().__init__(f"{source}: {len(errors)} error(s)\n{lines}" + (f"\n  ({note})" if note else ""))


class ManifestLoader(yaml.SafeLoader):
    """YAML as ``kubectl`` reads a manifest, where PyYAML (YAML 1.1) differs in ways that matter to a job spec:

    - a float written without a dot, ``2e-3`` or ``1e5``, is a number (YAML 1.2's core schema, which Kubernetes'
      YAML decoder follows); PyYAML alone reads a string and the spec would be rejected as "not a number";
    - a key given twice in one mapping is an error (``kubectl apply`` refuses it) instead of the last one winning.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """:meth:`yaml.SafeLoader.construct_mapping` after a duplicate-key check of the keys written in ``node``.

        Raises:
            yaml.constructor.ConstructorError: a key appears twice (both lines named).
        """
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<` merges: later keys may override merged ones, as YAML intends
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base constructor reports it
                continue
            if first is not None:  # also on the same line: `{seed: 1, seed: 2}` or one-line JSON
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r} (first given on line {first + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


ManifestLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field annotation holds (``X``, ``X | None``, ``list[X]``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


@functools.cache
def _fields_of(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    """camelCase field name -> the model it holds (None for a plain value) of ``model``. Cached: :func:`parse_job`
    reads the top-level names on every call (the operator's every reconcile); callers must not mutate the result."""
    return {(f.alias or to_camel(n)): _model_of(f.annotation) for n, f in model.model_fields.items()}


def _all_field_paths(model: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """Every field name of the API under ``model`` -> the path of its first occurrence (``suspend`` -> ``spec.suspend``)."""
    out: dict[str, str] = {}
    for name, sub in _fields_of(model).items():
        out.setdefault(name, prefix + name)
        if sub is not None and name != "status":
            for k, v in _all_field_paths(sub, prefix + name + ".").items():
                out.setdefault(k, v)
    return out


def _unknown_field_message(loc: tuple) -> str:
    """The message for the unknown field at ``loc`` (pydantic's location: names and list indices): the right
    spelling when it is a snake_case or wrongly cased field of that object, the right place when it is a field of
    another object, else the closest names (or all of them, when there are few)."""
    model: type[BaseModel] | None = RLTrainingJob
    for part in loc[:-1]:
        if isinstance(part, str) and model is not None:
            model = _fields_of(model).get(part)
    name = str(loc[-1])
    here = sorted(_fields_of(model)) if model is not None else []
    camel = to_camel(name)
    if camel != name and camel in here:
        return f"unknown field: the API spells it {camel!r} (camelCase)"
    folded = {k.lower(): k for k in here}
    if name.lower() in folded:
        return f"unknown field: the API spells it {folded[name.lower()]!r} (field names are case-sensitive)"
    elsewhere = _all_field_paths(RLTrainingJob).get(camel)
    if elsewhere:  # (a field of this object was answered above)
        return f"unknown field here: {camel!r} is a field of {elsewhere.rsplit('.', 1)[0]!r} ({elsewhere})"
    close = difflib.get_close_matches(name, here, n=2, cutoff=0.6)
    if close:
        return "unknown field (did you mean " + " or ".join(repr(c) for c in close) + "?)"
    if here and len(here) <= 8:
        return "unknown field; the fields here are " + ", ".join(here)
    return "unknown field (`kubectl explain` on the RLTrainingJob, or the CRD in crds/, lists the fields)"


def _loc_to_path(loc: tuple) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def yaml_error_line(exc: yaml.YAMLError) -> str:
    """One line for a YAML (or JSON, which is read as YAML) syntax error: where and what, then what was being read
    and from where, e.g. ``line 3, column 7: expected ',' or '}', but got ':' (while parsing a flow mapping from line
    2, column 10)``. PyYAML's own text spans four or five lines and repeats the file name at each mark. Lines and
    columns count from 1."""
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow (a NUL byte, ...)
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        return f"character {exc.position + 1} of the file: {exc.reason} (#x{code:04x})"
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return " ".join(str(exc).split())

    def at(mark: Any) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    text = f"{at(exc.problem_mark)}: {exc.problem}"
    if exc.context:
        start = exc.context_mark
        same = start is not None and (start.line, start.column) == (exc.problem_mark.line, exc.problem_mark.column)
        text += f" ({exc.context}" + (f" from {at(start)}" if start is not None and not same else "") + ")"
    return text


def _unquoted(value: Any) -> Any:
    """The number or boolean a quoted YAML scalar would be without its quotes (``"0.002"`` -> 0.002), else None."""
    if not isinstance(value, str):
        return None
    try:
        parsed = yaml.load(value, Loader=ManifestLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError:
        return None
    return parsed if isinstance(parsed, (bool, int, float)) else None


#: :attr:`SpecError.note` when field errors kept the cross-field rules (:data:`CEL_RULES`) from being checked; the
#: API server adds the like ("some validation rules were not checked because the object was invalid", apiextensions-
#: apiserver's hasBlockingErr) when schema errors keep it from evaluating a CRD's x-kubernetes-validations.
CROSS_FIELD_NOT_CHECKED = ("the cross-field rules (the CRD's x-kubernetes-validations) were not checked because of the "
                           "errors above; correct them to complete validation")

#: The error for a job without ``metadata.name`` (every command needs one: :class:`ObjectMeta`).
NAME_REQUIRED = ("the API server rejects an object without a name, and local runs keep their files under it "
                 "(runs/<name>/, <checkpoint.path>/<namespace>/<name>/)")


def _errors_from(exc: ValidationError) -> list[tuple[str, str]]:
    out = []
    for err in exc.errors():
        path = _loc_to_path(err["loc"])
        msg = err["msg"]
        loc, empty = tuple(err["loc"]), err["type"] == "model_type" and err.get("input") is None
        if (loc in (("metadata",), ("metadata", "name")) and (err["type"] == "missing" or empty)
                or loc == ("metadata", "name") and err.get("input", "") is None):
            out.append(("metadata.name", ("required (metadata is empty): " if empty else "required: ") + NAME_REQUIRED))
            continue
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        elif (err["type"] == "string_pattern_mismatch"
              and err.get("ctx", {}).get("pattern") == POSITIVE_QUANTITY_PATTERN
              and re.match(QUANTITY_PATTERN, err["input"])):
            msg = f"must be a quantity greater than zero (a Ray pod's resources); got {err['input']!r}"
        elif err["type"] == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") in (
                QUANTITY_PATTERN, POSITIVE_QUANTITY_PATTERN):
            msg = f"must be a Kubernetes quantity such as \"4\", \"500m\" or \"16Gi\"; got {err['input']!r}"
        elif err["type"] == "string_too_long" and isinstance(err.get("input"), str):
            msg += f" (got {err['input']!r}, {len(err['input'])} characters)"
        elif err["type"] == "string_type" and isinstance(err.get("input"), bool):  # before int: bool is one
            msg += (f" (got the boolean {str(err['input']).lower()}: quote it; YAML reads unquoted yes, no, on, off, "
                    "true and false as booleans)")
        elif err["type"] == "string_type" and isinstance(err.get("input"), (int, float)):
            msg += f" (got the number {err['input']!r}: quote it)"
        elif err["type"] in ("float_type", "bool_type", "int_type") and _unquoted(err.get("input")) is not None:
            msg += f" (got the string {err['input']!r}: unquote it, the API server does not convert strings)"
        elif err["type"] in ("float_type", "bool_type", "int_type", "int_from_float", "literal_error", "enum",
                             "string_type", "greater_than_equal", "less_than_equal", "greater_than", "less_than"):
            msg += f" (got {_shown(err.get('input'))})"
        elif err["type"] == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") == JOB_NAME_PATTERN:
            msg = ("must be a lowercase DNS label that starts with a letter: a-z, 0-9 and '-', starting with a letter "
                   "and ending with a letter or digit (RFC 1035: it begins the name of the job's RayCluster, which "
                   f"KubeRay requires to be one); got {err.get('input')!r}")
        elif err["type"] == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") == DNS_LABEL_PATTERN:
            msg = ("must be a lowercase DNS label: a-z, 0-9 and '-', starting and ending with a letter or digit "
                   f"(RFC 1123); got {err.get('input')!r}")
        elif empty and loc == ("spec",):
            msg = "must be a mapping: the job's desired state (model, algorithm, environment, ...); got an empty value"
        elif empty:  # a list item (`workerGroups: [null]`, a `-` with nothing after it); a null field is defaulted
            msg = "must be a mapping of fields; got an empty value (a list item with nothing after its '-'?)"
        elif err["type"] == "model_type":
            msg = f"must be a mapping of fields; got {type(err.get('input')).__name__} {_shown(err.get('input'))}"
        elif err["type"] == "extra_forbidden":
            msg = _unknown_field_message(tuple(err["loc"]))
        # Validators that find several problems (the cross-field rules, metadata.labels) raise "<path>: message" lines,
        # each path at or under the failing field's: lift the paths out, one error per line.
        lines = msg.split("\n")
        heads = [line.split(": ", 1)[0] for line in lines]
        if all(": " in line for line in lines) and all(
                h == path or h.startswith((path + ".", path + "[")) for h in heads):
            out.extend(tuple(line.split(": ", 1)) for line in lines)
        else:
            out.append((path or "(root)", msg))
    return out


def parse_job(obj: dict[str, Any], source: str = "RLTrainingJob",
              dropped: list[tuple[str | int, ...]] | None = None) -> RLTrainingJob:
    """Validate a manifest dict into an :class:`RLTrainingJob`, as the API server would at ``kubectl apply``.

    Every command reads a job through here (``daedalus validate``, and :func:`load_job` for ``run``, ``train``,
    ``sft`` and ``eval``), so all of them require what Kubernetes requires: ``apiVersion``, ``kind``,
    ``metadata.name`` (a DNS label; no default name, see :class:`ObjectMeta`) and ``spec``. A spec field that is null
    where the CRD does not allow null is dropped first, as the API server drops it
    (:func:`daedalus_trainer.crd.prune_nulls`), and so defaulted; ``dropped``, when given, receives the path of
    each such field (for :func:`dropped_null_notes`).

    Raises:
        SpecError: with every problem and its field path (e.g. ``spec.environment.size``).
    """
    if not isinstance(obj, dict):
        raise SpecError([("(root)", f"expected a mapping, got {type(obj).__name__}")], source)
    errors: list[tuple[str, str]] = []
    # `apiVersion` and `kind` are required, as kubectl requires them ("apiVersion not set", "kind not set"): every
    # object carries both (Kubernetes API conventions, "Types (Kinds)", sig-architecture/api-conventions.md).
    kind, api_version = obj.get("kind"), obj.get("apiVersion")
    if kind is None:
        errors.append(("kind", f"required: {KIND!r} (kubectl refuses a document without it: \"kind not set\")"))
    elif kind != KIND:
        errors.append(("kind", f"expected {KIND!r}, got {_shown(kind)}"))
    if api_version is None:
        errors.append(("apiVersion", f"required: {API_VERSION!r} (kubectl refuses a document without it: "
                                     "\"apiVersion not set\")"))
    elif api_version != API_VERSION:
        errors.append(("apiVersion", f"expected {API_VERSION!r}, got {_shown(api_version)}"))
    if kind is not None and kind != KIND:
        raise SpecError(errors, source)  # another kind of object: its fields say nothing about a job's
    # A spec field set to null (`podSecurity: null`, `checkpoint:` with no value) where the CRD does not allow null
    # is dropped by the API server before it defaults and validates, so it is defaulted as if left out. The top-level
    # keys keep their own messages below (`spec:` or `metadata:` left empty is a mistake worth naming).
    if isinstance(obj.get("spec"), dict):
        from daedalus_trainer.crd import prune_nulls  # crd builds its schema from this module

        obj = {**obj, "spec": prune_nulls({"spec": obj["spec"]}, dropped=dropped)["spec"]}
    # Top-level keys are checked here: a misspelt `spec` is then one error about the spelling (and `spec` missing).
    top = set(_fields_of(RLTrainingJob))
    errors.extend((k, _unknown_field_message((k,))) for k in obj if k not in top)
    if "spec" not in obj:
        errors.append(("spec", "required: the job's desired state (model, algorithm, environment, ...)"))
    # `status` is the operator's (an object read back from the API server carries it): it is read as JSON, not held
    # to the strict rules of what a user writes (its phase is a string there, never an enum instance).
    status = obj.get("status")
    manifest = {k: v for k, v in obj.items() if k != "status" and k in top}
    try:
        # As the API server reads a manifest: types strict ("0.002" is not a number, "true" not a boolean) and only
        # the camelCase field names of the CRD (a snake_case key would be an unknown field there).
        job = RLTrainingJob.model_validate(manifest, strict=True, by_alias=True, by_name=False)
    except ValidationError as exc:
        reported = {path for path, _ in errors}  # apiVersion, kind, spec: our messages above say more
        errors.extend(e for e in _errors_from(exc) if e[0] not in reported)
        # The cross-field rules (RLTrainingJobSpec._cross_field) run only on a spec whose fields all validate; say
        # so, as the API server does when its schema errors keep it from evaluating the x-kubernetes-validations.
        spec_fields_failed = any(len(e["loc"]) > 1 and e["loc"][0] == "spec" for e in exc.errors())
        raise SpecError(errors, source, note=CROSS_FIELD_NOT_CHECKED if spec_fields_failed else None) from None
    if status is not None:
        try:
            job.status = RLTrainingJobStatus.model_validate(status, by_alias=True)
        except ValidationError as exc:
            errors.extend((f"status.{p}" if p != "(root)" else "status", m) for p, m in _errors_from(exc))
    if errors:
        raise SpecError(errors, source)
    return job


def load_documents(path: str | Path) -> list[Any]:
    """The RLTrainingJob documents of a YAML or JSON file (all documents whose kind is RLTrainingJob, the items of a
    ``kind: List`` included; the first document when none says so, so that its validation names what is wrong; none
    for a ``List`` without items). Read with :class:`ManifestLoader`, as ``kubectl`` reads YAML. ``-`` reads standard
    input.

    Raises:
        FileNotFoundError: the file does not exist.
        SpecError: the file is a directory, not UTF-8 text or unreadable, the YAML is malformed, or the file holds
            no document.
    """
    if str(path) == "-":  # standard input, as kubectl reads `-f -`
        path = Path("<stdin>")
        if sys.stdin is None:  # closed (`<&-`): Python has no stdin object then
            raise SpecError([("(file)", "cannot be read: standard input is closed")], str(path))
        # The bytes, decoded as UTF-8 here: sys.stdin's own decoding depends on the locale, and under the C or
        # C.UTF-8 locale it lets invalid bytes through as surrogates, which YAML then calls "special characters".
        raw = getattr(sys.stdin, "buffer", None)
        try:
            text = raw.read().decode("utf-8") if raw is not None else sys.stdin.read()
        except UnicodeDecodeError:
            raise SpecError([("(file)", "is not UTF-8 text: expected a YAML or JSON file")], str(path)) from None
        except OSError as exc:
            raise SpecError([("(file)", f"cannot be read: {exc.strerror or exc}")], str(path)) from None
    else:
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise
        except IsADirectoryError:
            raise SpecError([("(file)", "is a directory, not a YAML or JSON file")], str(path)) from None
        except UnicodeDecodeError:
            raise SpecError([("(file)", "is not UTF-8 text: expected a YAML or JSON file")], str(path)) from None
        except OSError as exc:
            raise SpecError([("(file)", f"cannot be read: {exc.strerror or exc}")], str(path)) from None
    stream = io.StringIO(text)
    stream.name = str(path)  # YAML error marks name the file
    try:
        docs = [d for d in yaml.load_all(stream, Loader=ManifestLoader) if d is not None]  # noqa: S506 (SafeLoader)
    except yaml.YAMLError as exc:
        raise SpecError([("(syntax)", yaml_error_line(exc))], str(path)) from None
    if not docs:
        raise SpecError([("(root)", "the file holds no document")], str(path))
    # A `kind: List` (what `kubectl get rltj -o yaml` prints) stands for its items; one without items holds no job.
    docs = [item for d in docs for item in (
        d.get("items") or [] if isinstance(d, dict) and str(d.get("kind", "")).endswith("List") else [d])]
    # A document without a kind is taken for a job (its validation then says the kind is missing), not skipped as
    # another kind of object would be.
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") in (KIND, None)]
    return jobs or docs[:1]


def _doc_key(doc: Any) -> tuple[str | None, str] | None:
    """(namespace as written, name) of a document that names itself, else None."""
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not meta["name"]:
        return None
    namespace = meta.get("namespace")
    return (namespace if isinstance(namespace, str) else None, meta["name"])


def duplicate_name_errors(docs: list[Any]) -> dict[int, list[tuple[str, str]]]:
    """Errors for the documents (by index in ``docs``, as :func:`load_documents` returns them) that repeat the
    namespace and name of an earlier one. In one file such jobs are one object to ``kubectl apply``: the later is
    applied over the earlier (or refused, as an edit of its immutable sections), and local runs would share files.
    A document without a namespace matches only another without one (both go to the current namespace)."""
    first: dict[tuple[str | None, str], int] = {}
    out: dict[int, list[tuple[str, str]]] = {}
    for i, doc in enumerate(docs):
        key = _doc_key(doc)
        if key is None:
            continue
        if key in first:
            namespace = f"namespace {key[0]!r}" if key[0] is not None else "namespace not set"
            out.setdefault(i, []).append((
                "metadata.name",
                f"{key[1]!r} ({namespace}) is also the name of RLTrainingJob document {first[key] + 1} of "
                f"{len(docs)} in this file: kubectl apply would make them one object; give each job its own name"))
        else:
            first[key] = i
    return out


def dropped_null_notes(dropped: list[tuple[str | int, ...]], job: RLTrainingJob) -> list[str]:
    """One line per field :func:`parse_job` dropped as a null the CRD does not allow (its ``dropped`` paths; the API
    server drops such a field the same way, silently: :func:`daedalus_trainer.crd.prune_nulls`), with the value
    ``job`` (what parse_job returned) has in its place: a ``name:`` left empty reads as the default model, which is
    worth a warning. Empty when nothing was dropped."""
    values = job.model_dump(by_alias=True, mode="json") if dropped else {}
    notes = []
    for parts in dropped:
        value: Any = values
        for part in parts:
            if type(part) is int:
                value = value[part] if isinstance(value, list) and part < len(value) else None
            else:
                value = value.get(part) if isinstance(value, dict) else None
        # as the errors write a path; a key holding a dot (a label such as topology.kubernetes.io/zone) in quotes
        path = _loc_to_path(tuple(f'"{p}"' if isinstance(p, str) and "." in p else p for p in parts))
        if value is None:
            notes.append(f"{path}: empty (null), so dropped, as the API server drops it")
        else:
            notes.append(f"{path}: empty (null), so read as left out, as the API server reads it: the default "
                         f"{json.dumps(value)} applies")
    return notes


def load_job(path: str | Path) -> RLTrainingJob:
    """Read the one RLTrainingJob of a YAML or JSON file (the job of ``daedalus run``, ``train``, ``sft`` and
    ``eval``). Other kinds of objects in the file are skipped; two or more jobs (documents, or items of a
    ``kind: List``) are refused rather than one of them silently chosen. ``-`` reads standard input, named
    ``<stdin>`` in the errors.

    Raises:
        FileNotFoundError: the file does not exist.
        SpecError: the YAML is malformed, holds no job or more than one, or the job is invalid (every error with its
            field path).

    A spec field left empty (null) where the CRD does not allow null is read as left out, as the API server reads
    it, with a warning on the ``daedalus.config`` logger naming it and the value used (:func:`dropped_null_notes`).
    """
    docs = load_documents(path)
    source = "<stdin>" if str(path) == "-" else str(path)  # as load_documents' own errors and `validate -` name it
    if not docs:
        raise SpecError([("(root)", "the List holds no items: no RLTrainingJob to read")], source)
    if len(docs) > 1:
        names = ", ".join(repr(key[1]) if (key := _doc_key(d)) else "unnamed" for d in docs)
        raise SpecError([("(file)", f"holds {len(docs)} RLTrainingJobs ({names}); daedalus run, train, sft and eval "
                                    "take one: split the file (daedalus validate checks them all)")], source)
    dropped: list[tuple[str | int, ...]] = []
    job = parse_job(docs[0], source=source, dropped=dropped)
    for note in dropped_null_notes(dropped, job):
        logging.getLogger("daedalus.config").warning("%s: %s", source, note)
    return job
