"""The planning core: ``plan(job, observed, now) -> Plan``. Pure: no I/O, no clock, no randomness.

Given the job (spec, metadata, the status the operator wrote last time) and what the handlers observed (the
RayCluster, the Ray job of the current attempt, the trainer's ``/status``, the health of the nodes under the job's
pods, the state of an in-flight checkpoint request), it returns the next phase, the actions to execute, the status
fields to record, the events to post and when to look again.

The loop is a flat switch over the phase (KubeRay's ``rayjob_controller.go`` habit); everything that must survive an
operator restart is in the status the planner reads back, so a restarted operator continues where the last one
stopped (one table row per phase tests exactly that).

Lifecycle (DESIGN.md §3)::

    Pending -> Provisioning -> Running -> Succeeded
                    ^             |  \\
                    |             |   Checkpointing (announced node replacement/reboot, drain, hang, suspend)
                    |             v  /
                    +------- Recovering -> Failed (maxRestarts unplanned restarts exhausted)
                                  \\-> Suspended (spec.suspend) -> Provisioning (suspend: false)

Failure handling, in DESIGN order:

1. HyperPod labels a node under the job ``UnschedulablePendingReplacement`` / ``UnschedulablePendingReboot``: request an
   immediate checkpoint (bounded by ``checkpointTimeoutSeconds``), stop the Ray job, delete the job's pods on nodes
   that must not run them (KubeRay recreates them; node affinity keeps them on ``Schedulable`` nodes), resubmit the
   next attempt with ``--resume latest`` once the cluster is ready again. No restart backoff: it is planned.
   A node under the job being drained (cordoned, tainted for removal by Karpenter, the cluster autoscaler or an EKS
   managed node group update, being deleted) is handled the same way with ``checkpointOnDrain`` (reason NodeDrain): the job's PodDisruptionBudget
   refuses the drain's evictions until the operator has stopped the attempt and deleted the pods there itself.
2. A worker pod or node is lost, or the Ray job fails/stops on its own: classify (node and pod evidence first, then the
   Ray job's message), stop what is left, resubmit with resume after an exponential backoff
   (``restartBackoffSeconds * 2**(failures-1)``, capped at 600 s) on the same RayCluster.
3. The head is lost (head pod gone, the Ray job unknown to the head, the dashboard unreachable for longer than
   ``unreachable_grace``): wait for KubeRay's new head (or recreate a deleted RayCluster), resubmit with resume.
   Never two attempts at once: the next attempt is submitted only with evidence that the previous one ended (its Ray
   job ended or is unknown to a reachable dashboard, or the head pod / RayCluster is newer than the attempt);
   otherwise the previous one is asked to stop, and after ``unreachable_grace`` the RayCluster is recreated.
   A pod that is only not Ready (Running or Pending on a Ready node: a readiness probe failing under load) is lost
   only once its ``Ready`` condition has been False for longer than ``pod_ready_grace``; then the trainer, when it
   answers, is asked for a checkpoint before the stop. A pod on a gone or NotReady node is lost at once.
   While Provisioning or Recovering, a pod Running but not Ready on a good node for longer than ``pod_ready_grace``
   (at least 60 s; counted from its Ready condition's last flip or its containers' latest start, whichever is later)
   is deleted like a pod on a bad node, so that KubeRay recreates it: otherwise the cluster never becomes usable and
   the job waits for ever.
4. Every resubmission counts in ``status.restarts``; those after a planned cause (a HyperPod replacement or reboot,
   the resume of a job that failed for an invalid spec once it is fixed: :data:`api.PLANNED_REASONS`) also in
   ``status.plannedRestarts``. Only unplanned ones count against
   ``maxRestarts``: once ``restarts - plannedRestarts >= maxRestarts``, the next unplanned failure makes the job Failed
   (RestartLimitExceeded); a planned restart is never refused (maintenance must not fail a weeks-long job), but one
   detected before the previous restart made a step backs off like a failure (a flapping node cannot loop at full
   speed).
   No step progress for ``progressDeadlineSeconds`` counts as hung: checkpoint if possible, then restart.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import re
from typing import Any

from daedalus_trainer.config import (
    CheckpointRef,
    FailureInfo,
    RecoveryInfo,
    RecoveryRecord,
    RLTrainingJobSpec,
    RLTrainingJobStatus,
)

from daedalus_operator import api
from daedalus_operator.api import EventType, Phase, Reason
from daedalus_operator.nodes import ClusterState, NodeHealth, format_time, parse_time

#: Backoff cap (ResilienceSpec.restart_backoff_seconds doc: "capped at 10 minutes").
MAX_BACKOFF_SECONDS = 600.0

#: Ray job messages that point at infrastructure rather than the application (Ray's exception names and messages of
#: ray.exceptions: NodeDiedError, RayletDiedError, OwnerDiedError, WorkerCrashedError, ActorDiedError; SIGKILL'd
#: entrypoints report exit code -9 / 137 (OOM killer, node shutdown)).
INFRASTRUCTURE_PATTERNS = re.compile(
    r"NodeDiedError|node .* (died|dead)|marked dead|RayletDied|raylet died|OwnerDiedError|WorkerCrashedError"
    r"|ActorDiedError|actor died unexpectedly|ObjectLostError|job supervisor actor died|exit code -9|exit code 137"
    r"|killed by signal|SIGKILL|connection to the head|GCS",
    re.IGNORECASE,
)


class RayJobState(str, enum.Enum):
    """The Ray job of the current attempt as seen through the dashboard (ray.job_submission.JobStatus plus two
    operator-side states)."""

    NOT_FOUND = "NOT_FOUND"  # the head does not know the submission id
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"
    UNREACHABLE = "UNREACHABLE"  # no head address, or the dashboard did not answer

    @property
    def active(self) -> bool:
        """PENDING or RUNNING."""
        return self in (RayJobState.PENDING, RayJobState.RUNNING)

    @property
    def ended(self) -> bool:
        """SUCCEEDED, FAILED or STOPPED."""
        return self in (RayJobState.SUCCEEDED, RayJobState.FAILED, RayJobState.STOPPED)


@dataclasses.dataclass(frozen=True)
class RayJobObservation:
    """``state`` of the Ray job ``status.submissionId`` and its ``message`` (Ray's JobDetails.message or the
    connection error)."""

    state: RayJobState = RayJobState.NOT_FOUND
    message: str = ""
    unauthorized: bool = False
    """``UNREACHABLE`` because the dashboard refused the Ray token (:class:`~daedalus_operator.submit.RayUnauthorized`):
    the caller reads the token from the job's Secret again."""


#: The trainer's ``/status`` phase before its first step (daedalus_trainer.server): model, Ray actors and the checkpoint
#: still loading.
STARTING = "starting"


@dataclasses.dataclass(frozen=True)
class TrainerObservation:
    """The trainer's ``GET /status`` (port 9400 on the head), or ``reachable=False``.

    ``step`` is the latest completed GRPO step (``None`` while the trainer is ``starting`` and still says 0: the
    placeholder it serves before it has loaded its checkpoint, which must not reset the job's step);
    ``latest_checkpoint`` is ``{step, path, time}``; ``resumed_from`` the step of the checkpoint this attempt loaded
    (optional ``resumedFrom``: a step or ``{step, ...}``), which makes the recovery record exact.
    """

    reachable: bool = False
    step: int | None = None
    total_steps: int | None = None
    phase: str | None = None
    latest_checkpoint: dict[str, Any] | None = None
    success_ratio: float | None = None
    reward_mean: float | None = None
    adapter_path: str | None = None
    attempt: int | None = None
    resumed_from: int | None = None

    def answers_for(self, attempt: int) -> bool:
        """The trainer answered and speaks for ``attempt``: its ``/status`` names that attempt, or names none (a
        trainer started outside the operator, or one older than the ``attempt`` field). A previous attempt's trainer
        still answering must not move this attempt's step, totals or checkpoint."""
        return self.reachable and self.attempt in (None, 0, attempt)

    @classmethod
    def from_status(cls, doc: dict[str, Any]) -> "TrainerObservation":
        """Build from the JSON document of ``GET /status`` (unknown keys ignored, missing ones ``None``)."""
        ckpt = doc.get("latestCheckpoint")
        step = _int_or_none(doc.get("step"))
        if doc.get("phase") == STARTING and not step:
            step = None  # not known yet: a resumed attempt serves 0 until its checkpoint is loaded
        return cls(
            reachable=True,
            step=step,
            total_steps=_int_or_none(doc.get("totalSteps")),
            phase=doc.get("phase"),
            latest_checkpoint=ckpt if isinstance(ckpt, dict) and ckpt.get("step") is not None else None,
            success_ratio=doc.get("successRatio"),
            reward_mean=doc.get("rewardMean"),
            adapter_path=doc.get("adapterPath"),
            attempt=_int_or_none(doc.get("attempt")),
            resumed_from=_int_or_none((doc.get("resumedFrom") or {}).get("step")
                                      if isinstance(doc.get("resumedFrom"), dict) else doc.get("resumedFrom")),
        )

    @property
    def checkpoint_step(self) -> int | None:
        """Step of the latest checkpoint the trainer reports, if any."""
        return _int_or_none((self.latest_checkpoint or {}).get("step"))


def _int_or_none(v: Any) -> int | None:
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class CheckpointCall:
    """The operator's ``POST /checkpoint`` (or ``POST /stop``) for the current attempt: ``in_flight`` while waiting,
    then ``step``/``path`` of the written checkpoint or ``error`` with ``http_status`` (the trainer's HTTP status; 0
    when it did not answer; ``None`` for an answer without a usable body)."""

    in_flight: bool = False
    step: int | None = None
    path: str | None = None
    error: str | None = None
    http_status: int | None = None

    @property
    def retryable(self) -> bool:
        """Failed in a way that asking again may mend: no HTTP answer (connection reset, refused) or 401 (the token
        Secret was replaced; the handler reads it again). 409 (the trainer ended), 500 (the save failed), 504 (no
        step boundary within the wait) and any other answer are final."""
        return self.error is not None and self.http_status in (0, 401)


@dataclasses.dataclass(frozen=True)
class Observed:
    """Everything the handlers gathered for one job."""

    cluster: ClusterState = ClusterState()
    ray_job: RayJobObservation = RayJobObservation()
    trainer: TrainerObservation = TrainerObservation()
    health: NodeHealth = NodeHealth()
    checkpoint_call: CheckpointCall = CheckpointCall()
    serving_exists: bool = False


@dataclasses.dataclass(frozen=True)
class JobView:
    """The RLTrainingJob as the planner sees it: identity, the validated spec (``None`` when invalid, with
    ``spec_errors`` as ``(field path, message)`` pairs), the last written status, and the object-store URI the exported
    adapter is mirrored to for serving (annotation ``daedalus.dev/serving-lora-uri``; Ray Serve LLM loads dynamic LoRA
    adapters from object storage only)."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: RLTrainingJobSpec | None
    status: RLTrainingJobStatus
    spec_errors: tuple[tuple[str, str], ...] = ()
    serving_lora_uri: str | None = None
    status_error: str | None = None  # why this operator cannot read the stored status (``status`` is then empty)

    @property
    def expected_pods(self) -> int:
        """Head + all worker replicas of the spec (0 when the spec is invalid)."""
        if self.spec is None:
            return 0
        return 1 + sum(g.replicas for g in self.spec.cluster.worker_groups)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Operator timing knobs (seconds): ``poll`` between looks while a job is active; ``unreachable_grace`` before an
    unanswering dashboard counts as a lost head; ``pod_ready_grace`` before a Running job's pod that is not Ready on
    a Ready node (its ``Ready`` condition False for longer than this) counts as lost (0: at once), and before a
    Provisioning or Recovering job's pod Running but not Ready on a good node is deleted to be recreated (at least
    60 s; 0: never, a recreated pod is not Ready at once)."""

    poll: float = 2.0
    unreachable_grace: float = 60.0
    pod_ready_grace: float = 60.0


# ------------------------------------------------------------------------------------------------ actions
@dataclasses.dataclass(frozen=True)
class EnsureChildren:
    """Create what is missing of ConfigMap, Secret, NetworkPolicy and RayCluster; bring the ConfigMap up to date."""


@dataclasses.dataclass(frozen=True)
class DeleteCluster:
    """Delete the RayCluster (suspend, terminal phases)."""


@dataclasses.dataclass(frozen=True)
class Submit:
    """Submit the Ray job ``submission_id`` (attempt ``attempt``); an existing id means already submitted."""

    submission_id: str
    attempt: int


@dataclasses.dataclass(frozen=True)
class RequestCheckpoint:
    """Ask the trainer of ``submission_id`` for a checkpoint at its next step boundary, in the background (the result
    is observed later). ``stop``: ``POST /stop`` - checkpoint, then exit cleanly, so no step runs after the checkpoint
    (zero lost steps); otherwise ``POST /checkpoint``."""

    submission_id: str
    target_step: int
    stop: bool = True


@dataclasses.dataclass(frozen=True)
class StopJob:
    """Ask Ray to stop the job ``submission_id`` (idempotent)."""

    submission_id: str


@dataclasses.dataclass(frozen=True)
class DeletePods:
    """Delete these pods of the job (on nodes that must not run them); KubeRay recreates them elsewhere."""

    names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class EnsureServing:
    """Create the RayService serving the exported adapter if it does not exist."""

    adapter_path: str


Action = EnsureChildren | DeleteCluster | Submit | RequestCheckpoint | StopJob | DeletePods | EnsureServing


@dataclasses.dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post on the RLTrainingJob."""

    type: EventType
    reason: str
    message: str


@dataclasses.dataclass
class Plan:
    """The planner's decision.

    Attributes:
        phase: the next phase.
        actions: to execute in order, after the status was written.
        status: RLTrainingJobStatus fields (snake_case) to set; ``None`` clears a field.
        events: to post.
        requeue_after: look again after this many seconds (0: at once; ``None``: only on the next event/timer).
        restart_reason: set when this plan resubmits after a failure (metric ``daedalus_operator_restarts_total``).
        recovered: set when a recovery completed in this plan (metric ``daedalus_operator_recovery_seconds``).
        in_grace: a Running job's pod is not Ready but still inside ``pod_ready_grace``: the job must be looked at on
            every poll tick until that grace ends (never a quiet job, ``handlers.is_quiet``).
    """

    phase: Phase
    actions: list[Action] = dataclasses.field(default_factory=list)
    status: dict[str, Any] = dataclasses.field(default_factory=dict)
    events: list[Event] = dataclasses.field(default_factory=list)
    requeue_after: float | None = None
    restart_reason: str | None = None
    recovered: RecoveryRecord | None = None
    in_grace: bool = False


# ------------------------------------------------------------------------------------------------ helpers
def backoff_seconds(base: float, failures: int) -> float:
    """Exponential restart backoff: ``base * 2**(failures-1)`` for ``failures >= 1``, capped at 600 s; 0 for none."""
    if failures <= 0 or base <= 0:
        return 0.0
    return min(MAX_BACKOFF_SECONDS, base * 2 ** min(failures - 1, 30))


def is_planned(reason: str | Reason) -> bool:
    """True for a recovery reason announced ahead of time (:data:`api.PLANNED_REASONS`: HyperPod node replacement or
    reboot, suspend): no backoff, and no count against ``maxRestarts``."""
    return reason in api.PLANNED_REASONS


#: Ray's message for an entrypoint that exited non-zero: one sentence, then the driver's last log lines (10 in Ray
#: 2.60, at most 20,000 characters; ray/dashboard/modules/job/job_supervisor.py); handlers.gather adds the last 600
#: characters of the job's log to any other message. A traceback's lines are long: the first 1024 characters often
#: end before the error.
_LOG_TAIL = re.compile(r"(?P<head>Job entrypoint command failed with exit code -?\d+), last available logs "
                       r"\(truncated to [\d,]+ chars\):\n(?P<logs>.*)", re.DOTALL)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

#: Characters of the driver's last log lines :func:`summarize_ray_message` keeps (conditions and events keep 1024 of
#: the whole message).
LOG_TAIL_CHARS = 700


def quotes_log_tail(message: str | None) -> bool:
    """Whether ``message`` is Ray's failed-entrypoint message, which already quotes the driver's last log lines."""
    return _LOG_TAIL.fullmatch(message or "") is not None


def summarize_ray_message(message: str | None, budget: int = LOG_TAIL_CHARS) -> str:
    """Ray's message for a failed entrypoint with its log tail cut to the last lines, where the cause is (the
    trainer's ``error:`` line, an exception's last line), rather than to the first ones: ``"Job entrypoint command
    failed with exit code 2; last log lines: ... | error: cannot load the adapter in ..."`` (lines joined by ``|``,
    colour codes removed, at most ``budget`` characters of them). Any other message is returned as it is."""
    m = _LOG_TAIL.fullmatch(message or "")
    if m is None:
        return message or ""
    lines = [line.strip() for line in _ANSI.sub("", m["logs"]).splitlines() if line.strip()]
    kept: list[str] = []
    size = 0
    for line in reversed(lines):
        if kept and size + len(line) + 3 > budget:
            break
        kept.append(line if len(line) <= budget else "..." + line[-budget:])
        size += len(line) + 3
    return f"{m['head']}; last log lines: " + " | ".join(reversed(kept)) if kept else m["head"]


def classify_failure(ray_job: RayJobObservation, health: NodeHealth) -> tuple[Reason, str | None, str]:
    """Why did the Ray job end without success? ``(reason, node, message)``.

    Evidence in order: node/pod health under the job (an announced or lost node, a lost head or worker), then a
    STOPPED job nobody asked to stop (JobStopped), then Ray's message matched against
    :data:`INFRASTRUCTURE_PATTERNS` (JobFailed), else ApplicationError.
    """
    issue = health.first_issue()
    detail = f"Ray job {ray_job.state.value}: {summarize_ray_message(ray_job.message)}".strip().rstrip(":")
    if issue is not None:
        reason, node, message = issue
        return reason, node, f"{message}; {detail}"
    if ray_job.state == RayJobState.STOPPED:
        return Reason.JOB_STOPPED, None, detail
    if ray_job.state == RayJobState.NOT_FOUND:
        return Reason.HEAD_LOST, None, "the head no longer knows the submitted Ray job (new head?)"
    if INFRASTRUCTURE_PATTERNS.search(ray_job.message or ""):
        return Reason.JOB_FAILED, None, detail
    return Reason.APPLICATION_ERROR, None, detail


class _Builder:
    """Accumulates one plan; the phase handlers below read like the lifecycle."""

    def __init__(self, job: JobView, observed: Observed, now: dt.datetime, timing: Timing):
        self.job = job
        self.spec = job.spec
        self.st = job.status
        self.o = observed
        self.now = now
        self.timing = timing
        self.plan = Plan(phase=job.status.phase or Phase.PENDING)

    # -- primitives
    def set(self, **fields: Any) -> None:
        self.plan.status.update(fields)

    def get(self, field: str) -> Any:
        """The status field as this plan leaves it."""
        if field in self.plan.status:
            return self.plan.status[field]
        return getattr(self.st, field)

    def act(self, action: Action) -> None:
        self.plan.actions.append(action)

    def event(self, reason: str | Reason, message: str, type: EventType = EventType.NORMAL) -> None:
        self.plan.events.append(Event(type, str(reason.value if isinstance(reason, Reason) else reason), message))

    def requeue(self, seconds: float | None = None) -> Plan:
        seconds = self.timing.poll if seconds is None else max(0.0, seconds)
        cur = self.plan.requeue_after
        self.plan.requeue_after = seconds if cur is None else min(cur, seconds)
        return self.plan

    def done(self) -> Plan:
        return self.plan

    def to(self, phase: Phase, reason: Reason, message: str, type: EventType = EventType.NORMAL) -> None:
        """Move to ``phase``; an event is posted when the phase changes."""
        if phase != self.st.phase:
            self.event(reason, message, type)
        self.plan.phase = phase

    def now_s(self) -> str:
        return format_time(self.now)

    def seconds_since(self, stamp: str | None) -> float | None:
        t = parse_time(stamp)
        return None if t is None else (self.now - t).total_seconds()

    def recovery(self) -> RecoveryInfo:
        rec = self.get("recovery")
        return rec.model_copy() if rec is not None else RecoveryInfo(reason="Unknown", detected_at=self.now_s())

    def attempt_total(self) -> int:
        """Steps the current attempt's trainer runs to: its ``/status`` ``totalSteps`` when it answers, else the total
        recorded in status (set when the attempt was submitted, kept from the trainer's answers); 0 when unknown."""
        t = self.o.trainer
        if t.answers_for(self.st.attempt) and t.total_steps is not None:
            return t.total_steps
        return self.st.total_steps or 0

    def unplanned_restarts(self) -> int:
        """Resubmissions after unplanned failures: ``restarts - plannedRestarts`` (a status written by an operator
        without ``plannedRestarts`` reads it as 0: every restart it made counts, as it did then)."""
        return max(0, self.st.restarts - self.st.planned_restarts)

    def restart_limit_reached(self, reason: str | Reason) -> bool:
        """A resubmission for ``reason`` is refused: the reason is unplanned and ``maxRestarts`` unplanned restarts
        were made already. A planned one (HyperPod replacement or reboot) is never refused."""
        assert self.spec is not None
        return not is_planned(reason) and self.unplanned_restarts() >= self.spec.resilience.max_restarts

    def limit_message(self, reason: str, message: str) -> str:
        """RestartLimitExceeded's message: the cause and the counts."""
        assert self.spec is not None
        st = self.st
        planned = f", {st.planned_restarts} of them planned" if st.planned_restarts else ""
        return (f"{reason}: {message} (restarts {st.restarts}{planned}; unplanned {self.unplanned_restarts()} >= "
                f"maxRestarts {self.spec.resilience.max_restarts})")

    def reported_step(self) -> int:
        """Latest completed step: the trainer's answer when it has one, else the last recorded one."""
        t = self.o.trainer
        if t.answers_for(self.st.attempt) and t.step is not None:
            return t.step
        return self.st.current_step

    # -- composite steps
    def submit_next(self, *, after_failure: bool) -> Plan:
        """Submit attempt N+1: record the decision (attempt, id) in status first, then submit (KubeRay habit: the name
        is in status before the object exists, so a retry cannot create a second one)."""
        attempt = self.st.attempt + 1
        sid = api.submission_id(self.job.name, self.job.uid, attempt)
        self.set(
            attempt=attempt,
            total_steps=self.spec.algorithm.steps,  # what this attempt's config (EnsureChildren below) runs to
            submission_id=sid,
            submission_confirmed=False,
            attempt_start_time=self.now_s(),
            last_progress_time=self.now_s(),
            unreachable_since=None,
        )
        if self.st.start_time is None:
            self.set(start_time=self.now_s())
        latest = self.get("latest_checkpoint")
        resume = latest.step if latest else 0
        if self.get("recovery") is not None:
            rec = self.recovery()
            rec.resubmitted_at = self.now_s()
            rec.resume_step = resume
            self.set(recovery=rec)
        self.act(EnsureChildren())
        self.act(Submit(sid, attempt))
        if after_failure:
            self.set(restarts=self.st.restarts + 1)
            self.plan.restart_reason = self.recovery().reason
            if is_planned(self.plan.restart_reason):
                self.set(planned_restarts=self.st.planned_restarts + 1)
            self.to(Phase.RUNNING, Reason.RESUBMITTED,
                    f"attempt {attempt} ({sid}) submitted, "
                    + (f"resuming from the checkpoint at step {resume}" if latest else
                       "resuming from the newest checkpoint on the volume, if any (the status records none)"))
        else:
            self.to(Phase.RUNNING, Reason.SUBMITTED, f"attempt {attempt} ({sid}) submitted"
                    + (f", resuming from the checkpoint at step {resume}" if resume else ""))
        return self.requeue()

    def detected(self, reason: Reason, node: str | None, message: str, *, checkpoint: bool, job_active: bool) -> Plan:
        """A cause to stop the current attempt was detected: record it, then checkpoint (when wanted and possible) or
        stop; when the job already ended, go straight to Recovering (or Failed past maxRestarts)."""
        assert self.spec is not None
        step = self.reported_step()
        rec = RecoveryInfo(reason=reason.value, node=node, message=message, detected_at=self.now_s(),
                           step_at_detection=step)
        planned = is_planned(reason)
        # A planned cause while the previous restart has not stepped yet (its recovery still open: HyperPod flapping
        # a node's label, or KubeRay putting the pods back on a node that fails again) backs off like a failure, so
        # such a loop slows down instead of resubmitting at full speed for ever; it still does not count against
        # maxRestarts (the recovery's reason stays planned), and the first step made resets the backoff.
        prev = self.st.recovery
        stalled = planned and prev is not None and prev.resubmitted_at is not None
        failures = self.st.consecutive_failures + (0 if planned and not stalled else 1)
        wait = 0.0 if planned and not stalled else backoff_seconds(self.spec.resilience.restart_backoff_seconds,
                                                                   failures)
        if wait:
            rec.not_before = format_time(self.now + dt.timedelta(seconds=wait))
        self.set(recovery=rec, consecutive_failures=failures, unreachable_since=None)
        if reason != Reason.SUSPEND:
            self.set(last_failure=FailureInfo(reason=reason.value, node=node, message=message[:1024],
                                              time=self.now_s()))
        warn = EventType.NORMAL if planned else EventType.WARNING
        if not job_active and self.restart_limit_reached(reason):
            return self.fail(Reason.RESTART_LIMIT, self.limit_message(reason.value, message))
        sid = self.st.submission_id or ""
        if checkpoint and job_active and self.o.trainer.answers_for(self.st.attempt):
            rec.checkpoint_requested_at = self.now_s()
            rec.checkpoint_target_step = step
            self.set(recovery=rec)
            self.act(RequestCheckpoint(sid, step))
            self.to(Phase.CHECKPOINTING, reason, f"{message}: checkpoint requested at step {step}", warn)
            return self.requeue()
        if job_active:
            rec.stop_requested_at = self.now_s()
            self.set(recovery=rec)
            self.act(StopJob(sid))
        self.to(Phase.RECOVERING, reason, message + ("" if job_active else " (the Ray job has ended)"), warn)
        return self.requeue(0 if not job_active else None)

    def fail(self, reason: Reason, message: str) -> Plan:
        """Terminal failure: record it, free the RayCluster."""
        last = self.get("last_failure")
        self.set(completion_time=self.now_s(), recovery=None,
                 last_failure=FailureInfo(reason=reason.value, node=last.node if last else None,
                                          message=message[:1024], time=self.now_s()))
        if self.o.cluster.exists and not self.o.cluster.deleting:
            self.act(DeleteCluster())
        self.to(Phase.FAILED, reason, message, EventType.WARNING)
        return self.done()

    def succeed(self) -> Plan:
        assert self.spec is not None
        t = self.o.trainer
        adapter = t.adapter_path if t.answers_for(self.st.attempt) and t.adapter_path else (
            self.st.adapter_path or api.adapter_export_path(self.spec.checkpoint.path, self.job.namespace,
                                                            self.job.name))
        # The Ray job succeeded: the trainer's entrypoint exited 0, which it does only after the last step of the
        # config it was started with: the total it reported (or the attempt was submitted with), never the spec's
        # steps now (an edit after the start does not reach a running trainer).
        self.set(completion_time=self.now_s(), adapter_path=adapter, recovery=None, unreachable_since=None,
                 current_step=max(self.st.current_step, self.reported_step(), self.attempt_total()))
        if self.o.cluster.exists and not self.o.cluster.deleting:
            self.act(DeleteCluster())
        self.to(Phase.SUCCEEDED, Reason.SUCCEEDED, f"training finished; adapter exported to {adapter}")
        if self.spec.serving.enabled and not self.o.serving_exists:
            if self.job.serving_lora_uri:
                self.set(serving_name=api.rayservice_name(self.job.name))
                self.act(EnsureServing(adapter))
            else:
                self.event("ServingNotConfigured", "spec.serving.enabled but no object-store mirror of the exported "
                           "adapter: set annotation daedalus.dev/serving-lora-uri (Ray Serve LLM loads dynamic LoRA "
                           "adapters from s3://, gs://, abfss:// or azure:// only)", EventType.WARNING)
        return self.done()

    def progress(self) -> None:
        """While the Ray job runs: progress time, and the end of a recovery (the new attempt stepped past the step it
        resumed from)."""
        t = self.o.trainer
        if not t.answers_for(self.st.attempt) or t.step is None:
            return  # no answer, or a previous attempt's trainer answering (should not happen once stopped)
        if self.st.last_progress_time is None or t.step > self.st.current_step:
            self.set(last_progress_time=self.now_s())
        rec = self.st.recovery
        resumed = t.resumed_from if t.resumed_from is not None else (rec.resume_step or 0) if rec else 0
        if rec is not None and rec.resubmitted_at is not None and t.step > resumed:
            detected = parse_time(rec.detected_at) or self.now
            record = RecoveryRecord(
                reason=rec.reason, detected_at=rec.detected_at, recovered_at=self.now_s(),
                seconds=round((self.now - detected).total_seconds(), 3),
                step_at_detection=rec.step_at_detection, resumed_from_step=resumed,
                lost_steps=max(0, rec.step_at_detection - resumed),
            )
            self.set(recovery=None, last_recovery=record, consecutive_failures=0)
            self.plan.recovered = record
            self.event(Reason.RECOVERED, f"{rec.reason}: stepping again at step {t.step} after "
                       f"{record.seconds:.0f} s; resumed from step {resumed}, {record.lost_steps} step(s) lost")


# ------------------------------------------------------------------------------------------------ phases
def _invalid(b: _Builder) -> Plan:
    """A job that is not Succeeded or Failed for another reason has an invalid spec: Failed (InvalidSpec), and its
    RayCluster deleted as for any failed job (a Ray job still running goes with it and releases its GPUs)."""
    if b.o.cluster.exists and not b.o.cluster.deleting:
        b.act(DeleteCluster())
    msg = "; ".join(f"{p}: {m}" for p, m in b.job.spec_errors) or "invalid spec"
    last = b.st.last_failure
    if not (b.st.phase == Phase.FAILED and last is not None and last.reason == Reason.INVALID_SPEC.value
            and last.message == msg[:1024]):
        b.set(last_failure=FailureInfo(reason=Reason.INVALID_SPEC.value, message=msg[:1024], time=b.now_s()))
        if b.st.phase == Phase.FAILED:
            b.event(Reason.INVALID_SPEC, msg, EventType.WARNING)
    b.to(Phase.FAILED, Reason.INVALID_SPEC, msg, EventType.WARNING)
    return b.done()


def _pending(b: _Builder) -> Plan:
    assert b.spec is not None
    b.set(ray_cluster_name=api.raycluster_name(b.job.name))
    if b.spec.suspend:
        b.to(Phase.SUSPENDED, Reason.SUSPENDED, "created suspended (spec.suspend is true)")
        return b.done()
    b.act(EnsureChildren())
    b.to(Phase.PROVISIONING, Reason.PROVISIONING, f"creating RayCluster {api.raycluster_name(b.job.name)}")
    return b.requeue(0)


def expected_pods(job: JobView, cluster: ClusterState) -> int:
    """The pods the job's Ray cluster should have: what its RayCluster asks for when it exists
    (:attr:`ClusterState.expected_pods`; the operator never patches a RayCluster, so a worker group edited in the
    job's spec takes effect with the next RayCluster), else what the job's spec asks for."""
    if cluster.expected_pods is not None:  # None when the RayCluster does not exist
        return cluster.expected_pods
    return job.expected_pods


def _cluster_usable(b: _Builder) -> bool:
    """Cluster ready per KubeRay and every expected pod (:func:`expected_pods`) present, Ready and on a node that may
    run it."""
    h = b.o.health
    return (b.o.cluster.ready and h.pods >= expected_pods(b.job, b.o.cluster) and h.ready_pods >= h.pods
            and not h.bad_pods and not h.announced)


#: Seconds a pod may stay Running but not Ready on a good node before Provisioning or Recovering deletes it to be
#: recreated, at least (``pod_ready_grace`` when longer; :func:`_recreate_unusable_pods`).
POD_RECREATE_MIN_SECONDS = 60.0


def _recreate_unusable_pods(b: _Builder, doing: str) -> bool:
    """Delete (so that KubeRay recreates them) the job's pods on bad nodes and those Running but not Ready on a good
    node for longer than ``pod_ready_grace`` (their readiness probe failing since they started: a raylet that cannot
    join, a wedged container), which would otherwise keep :func:`_cluster_usable` false for ever; while such a pod is
    within its grace, look again when the first grace ends. Used before the first submission (Provisioning) and before
    a resubmission (Recovering); ``doing`` names the phase in the event. ``pod_ready_grace`` 0 turns the not-Ready
    check off (a recreated pod is never Ready at once), and a shorter one than :data:`POD_RECREATE_MIN_SECONDS` is
    raised to it here: a grace tuned for a flickering probe while Running (5 s) would delete every pod that takes
    longer than that to pass its first readiness probe (KubeRay's waits 10 s before the first check).

    Returns:
        True when pods were deleted (the caller requeues and looks again).
    """
    c = b.o.cluster
    grace = b.timing.pod_ready_grace
    after = max(grace, POD_RECREATE_MIN_SECONDS) if grace > 0 else 0.0
    stale, grace_left = b.o.health.stale_not_ready(b.now, after)
    doomed = tuple(sorted(set(b.o.health.bad_pods) | set(stale)))
    if doomed and c.exists and not c.deleting:
        b.act(DeletePods(doomed))
        if stale:
            b.event("RecreatingPods", f"deleting pod(s) {', '.join(stale)}: Running but not Ready for longer than "
                    f"{after:.0f} s on a Ready node while {doing}; KubeRay recreates them",
                    EventType.WARNING)
        return True
    if grace_left is not None:
        b.requeue(min(b.timing.poll, grace_left))
    return False


def _provisioning(b: _Builder) -> Plan:
    assert b.spec is not None
    c = b.o.cluster
    if b.spec.suspend:
        if c.exists and not c.deleting:
            b.act(DeleteCluster())
        b.to(Phase.SUSPENDED, Reason.SUSPENDED, "suspended before the first submission")
        return b.done()
    b.set(ray_cluster_name=api.raycluster_name(b.job.name))
    if not c.exists:
        b.act(EnsureChildren())
        return b.requeue()
    if c.deleting:
        return b.requeue()  # an old cluster (suspend/resume) still going away
    if _recreate_unusable_pods(b, "provisioning"):
        return b.requeue()
    if not _cluster_usable(b):
        return b.requeue()
    return b.submit_next(after_failure=False)


def _running(b: _Builder) -> Plan:
    assert b.spec is not None
    st, o = b.st, b.o
    j = o.ray_job
    c = o.cluster
    sid = st.submission_id or ""
    # A pod not Ready on a Ready node (a readiness probe failing for a few seconds under load) is no loss until it has
    # been so for longer than pod_ready_grace; meanwhile look again when the first such grace ends. (A Ray job that
    # ended is classified with every issue, o.health: a not-Ready pod is evidence of why.)
    health, grace_left = o.health.within_grace(b.now, b.timing.pod_ready_grace)

    def wait() -> Plan:
        if grace_left is None:
            return b.requeue()
        b.plan.in_grace = True
        return b.requeue(min(b.timing.poll, grace_left))

    if not st.submission_confirmed:
        if j.state == RayJobState.NOT_FOUND:
            # Decided and recorded, but the head does not know it: the submit failed or never ran (operator restart),
            # or Ray keeps refusing it. Nothing runs, so nothing to checkpoint; suspend, node health and the progress
            # deadline (last_progress_time is the submission time) still apply, so a submission that never lands is
            # a failed attempt (Hung, counted against maxRestarts), not a resubmission every poll forever.
            if b.spec.suspend:
                return b.detected(Reason.SUSPEND, None, "spec.suspend is true", checkpoint=False, job_active=False)
            issue = health.first_issue()
            if issue is not None:
                reason, node, message = issue
                return b.detected(reason, node, message, checkpoint=False, job_active=False)
            idle = b.seconds_since(st.last_progress_time)
            deadline = b.spec.resilience.progress_deadline_seconds
            if idle is not None and idle > deadline:
                return b.detected(Reason.HUNG, None, f"attempt {st.attempt} ({sid}) never appeared on the Ray head "
                                  f"{idle:.0f} s after its submission (progressDeadlineSeconds {deadline})",
                                  checkpoint=False, job_active=False)
            if c.ready:
                b.act(EnsureChildren())
                b.act(Submit(sid, st.attempt))
            elif not c.exists:
                b.act(EnsureChildren())
            return wait()
        if j.state == RayJobState.UNREACHABLE and c.exists and not c.deleting:
            since = st.unreachable_since or b.now_s()
            b.set(unreachable_since=since)
            if (b.seconds_since(since) or 0) <= b.timing.unreachable_grace:
                return wait()
        if j.state != RayJobState.UNREACHABLE:
            b.set(submission_confirmed=True)

    if j.state == RayJobState.SUCCEEDED:
        return b.succeed()
    if j.state in (RayJobState.FAILED, RayJobState.STOPPED, RayJobState.NOT_FOUND):
        reason, node, message = classify_failure(j, o.health)
        return b.detected(reason, node, message, checkpoint=False, job_active=False)
    if j.state == RayJobState.UNREACHABLE:
        if not c.exists or c.deleting:
            return b.detected(Reason.CLUSTER_LOST, None, f"RayCluster {st.ray_cluster_name} is gone",
                              checkpoint=False, job_active=False)
        if health.head_lost:
            reason, node, message = health.first_issue() or (Reason.HEAD_LOST, None, "head lost")
            return b.detected(Reason.HEAD_LOST, node, message, checkpoint=False, job_active=False)
        since = b.get("unreachable_since") or b.now_s()
        b.set(unreachable_since=since)
        waited = b.seconds_since(since) or 0.0
        if waited > b.timing.unreachable_grace:
            return b.detected(Reason.HEAD_LOST, None,
                              f"Ray dashboard unreachable for {waited:.0f} s: {j.message}",
                              checkpoint=False, job_active=False)
        return wait()
    if st.unreachable_since is not None:
        b.set(unreachable_since=None)

    # The Ray job is PENDING or RUNNING.
    b.progress()
    if b.spec.suspend:
        return b.detected(Reason.SUSPEND, None, "spec.suspend is true", checkpoint=True, job_active=True)
    issue = health.first_issue()
    if issue is not None:
        reason, node, message = issue
        # Checkpoint first for a node HyperPod announced, a node being drained (announced only with checkpointOnDrain;
        # the PodDisruptionBudget holds the drain's evictions meanwhile), and for pods that stayed not Ready past their
        # grace while every pod and node is still there (detected() asks only when the trainer answers its /status;
        # else it stops at once).
        hyperpod = reason in (Reason.NODE_REPLACEMENT, Reason.NODE_REBOOT)
        wants = ((hyperpod and b.spec.resilience.checkpoint_on_node_warning) or reason == Reason.NODE_DRAIN
                 or health.only_not_ready)
        return b.detected(reason, node, message, checkpoint=wants, job_active=True)
    idle = b.seconds_since(b.get("last_progress_time"))
    deadline = b.spec.resilience.progress_deadline_seconds
    if idle is not None and idle > deadline:
        return b.detected(Reason.HUNG, None, f"no step progress for {idle:.0f} s (progressDeadlineSeconds "
                          f"{deadline}) at step {b.reported_step()}", checkpoint=True, job_active=True)
    return wait()


def _checkpointing(b: _Builder) -> Plan:
    assert b.spec is not None
    st, o = b.st, b.o
    j = o.ray_job
    rec = b.recovery()
    target = rec.checkpoint_target_step or 0
    steps = [s for s in (o.trainer.checkpoint_step if o.trainer.reachable else None, o.checkpoint_call.step)
             if s is not None]
    done = max(steps) if steps else None
    if j.state == RayJobState.SUCCEEDED and _finished(b, done):
        return b.succeed()
    # Ended: on our POST /stop (exit 0 after the checkpoint), or failed meanwhile; or the RayCluster is gone. A
    # dashboard that did not answer (UNREACHABLE: one timeout on a busy head) is no such evidence: the trainer may be
    # writing the checkpoint; the wait below (checkpointTimeoutSeconds) bounds it.
    if j.state.ended or j.state == RayJobState.NOT_FOUND or (
            j.state == RayJobState.UNREACHABLE and (not o.cluster.exists or o.cluster.deleting)):
        rec.stop_requested_at = rec.stop_requested_at or b.now_s()
        b.set(recovery=rec)
        if done is not None and done >= target:
            _record_checkpoint(b, done)
            b.to(Phase.RECOVERING, Reason.RECOVERING,
                 f"attempt {st.attempt} stopped after its checkpoint at step {done} ({rec.reason})")
        else:
            b.to(Phase.RECOVERING, Reason.RECOVERING,
                 f"the Ray job ended ({j.state.value}) before the checkpoint was written")
        return b.requeue(0)
    waited = b.seconds_since(rec.checkpoint_requested_at) or 0.0
    timeout = b.spec.resilience.checkpoint_timeout_seconds
    if done is not None and done >= target:
        path = _record_checkpoint(b, done)
        b.event("CheckpointTaken", f"checkpoint at step {done} written ({path}); stopping attempt {st.attempt}")
    elif o.checkpoint_call.error and not (o.checkpoint_call.retryable and waited <= timeout):
        b.event("CheckpointFailed", f"checkpoint request failed: {o.checkpoint_call.error}; stopping anyway",
                EventType.WARNING)
    elif waited > timeout:
        b.event(Reason.CHECKPOINT_TIMEOUT, f"no checkpoint at step >= {target} after {waited:.0f} s "
                f"(checkpointTimeoutSeconds {timeout}); stopping anyway", EventType.WARNING)
    else:
        if not o.checkpoint_call.in_flight and o.trainer.reachable:
            # after an operator restart, or a call that failed on the way (no answer, 401): ask again, once per look
            b.act(RequestCheckpoint(st.submission_id or "", target))
        return b.requeue(min(b.timing.poll, max(0.0, timeout - waited)))
    rec.stop_requested_at = b.now_s()
    b.set(recovery=rec)
    b.act(StopJob(st.submission_id or ""))
    b.to(Phase.RECOVERING, Reason.RECOVERING, f"stopping attempt {st.attempt} ({rec.reason})")
    return b.requeue()


def _finished(b: _Builder, checkpoint_step: int | None = None) -> bool:
    """True when every step is done (a Ray job that exits 0 after our POST /stop is not a finished training)."""
    assert b.spec is not None
    known = [b.st.current_step, checkpoint_step or 0, b.st.latest_checkpoint.step if b.st.latest_checkpoint else 0]
    if b.o.trainer.reachable and b.o.trainer.step is not None:
        known.append(b.o.trainer.step)
    return max(known) >= (b.attempt_total() or b.spec.algorithm.steps)


def _record_checkpoint(b: _Builder, step: int) -> str:
    """Record the checkpoint at ``step`` as the latest (from the call's answer or the trainer's status); its path."""
    o = b.o
    path = o.checkpoint_call.path if o.checkpoint_call.step == step else (o.trainer.latest_checkpoint or {}).get("path")
    latest = b.get("latest_checkpoint")
    if latest is None or latest.step < step:
        b.set(latest_checkpoint=CheckpointRef(step=step, path=path or "",
                                              time=(o.trainer.latest_checkpoint or {}).get("time")))
    return path or ""


def _recovering(b: _Builder) -> Plan:
    assert b.spec is not None
    st, o = b.st, b.o
    j = o.ray_job
    c = o.cluster
    rec = b.recovery()
    if j.state == RayJobState.SUCCEEDED and _finished(b, o.checkpoint_call.step):
        return b.succeed()  # the last step completed while we were stopping it
    if j.state.active:
        b.act(StopJob(st.submission_id or ""))  # idempotent; repeated after an operator restart
        if rec.stop_requested_at is None or rec.unconfirmed_since is not None:
            rec.stop_requested_at = rec.stop_requested_at or b.now_s()
            rec.unconfirmed_since = None  # the dashboard answered: the grace for an unanswering one starts over
            b.set(recovery=rec)
        return b.requeue()
    if rec.reason == Reason.SUSPEND.value or b.spec.suspend:
        if c.exists and not c.deleting:
            b.act(DeleteCluster())
        b.set(recovery=None)
        b.to(Phase.SUSPENDED, Reason.SUSPENDED,
             f"suspended at step {b.get('current_step')}; latest checkpoint step "
             f"{st.latest_checkpoint.step if st.latest_checkpoint else 0}")
        return b.done()
    if b.restart_limit_reached(rec.reason):
        return b.fail(Reason.RESTART_LIMIT, b.limit_message(rec.reason, rec.message))
    if _recreate_unusable_pods(b, "recovering"):
        return b.requeue()
    wait = b.seconds_since(rec.not_before)
    if wait is not None and wait < 0:
        return b.requeue(-wait)
    if not c.exists:
        b.act(EnsureChildren())
        return b.requeue()
    if c.deleting or not _cluster_usable(b):
        return b.requeue()
    if not _previous_attempt_ended(b):
        return _await_previous_attempt(b)
    return b.submit_next(after_failure=True)


def _previous_attempt_ended(b: _Builder) -> bool:
    """Positive evidence that the Ray job of the attempt in status (the one to be replaced) no longer runs: a
    reachable dashboard reports it ended or does not know it (a new head), or the head pod or the RayCluster was
    created after the attempt started (a new Ray cluster). An unanswering dashboard proves nothing: the old trainer
    may still be stepping and writing the same checkpoint directory."""
    st, o = b.st, b.o
    if not st.submission_id:
        return True
    if o.ray_job.state.ended or o.ray_job.state == RayJobState.NOT_FOUND:
        return True
    started = parse_time(st.attempt_start_time)
    return started is not None and any(t is not None and t > started
                                       for t in (o.health.head_created, o.cluster.created))


def _await_previous_attempt(b: _Builder) -> Plan:
    """No evidence that the previous attempt ended: ask Ray to stop it and wait; once that has lasted
    ``unreachable_grace`` seconds (counted from the first such look, ``unconfirmed_since``, not from an earlier stop
    request: one dashboard timeout after a slow stop is no reason to re-provision), delete the RayCluster (a new one
    cannot run the old Ray job) and recreate it."""
    st = b.st
    rec = b.recovery()
    if rec.stop_requested_at is None or rec.unconfirmed_since is None:
        rec.stop_requested_at = rec.stop_requested_at or b.now_s()
        rec.unconfirmed_since = rec.unconfirmed_since or b.now_s()
        b.set(recovery=rec)
    waited = b.seconds_since(rec.unconfirmed_since) or 0.0
    if waited > b.timing.unreachable_grace:
        b.act(DeleteCluster())
        b.event("RecreatingCluster", f"cannot confirm that attempt {st.attempt} ({st.submission_id}) ended "
                f"{waited:.0f} s after asking it to stop (Ray job {b.o.ray_job.state.value}: {b.o.ray_job.message}); "
                f"deleting RayCluster {api.raycluster_name(b.job.name)} so that no two attempts run at once",
                EventType.WARNING)
        return b.requeue()
    b.act(StopJob(st.submission_id or ""))
    return b.requeue()


def _suspended(b: _Builder) -> Plan:
    assert b.spec is not None
    c = b.o.cluster
    if b.spec.suspend:
        if c.exists and not c.deleting:
            b.act(DeleteCluster())
        return b.done()
    b.act(EnsureChildren())
    b.to(Phase.PROVISIONING, Reason.RESUMED, "spec.suspend is false: recreating the RayCluster to resume")
    return b.requeue(0)


def _succeeded(b: _Builder) -> Plan:
    if b.o.cluster.exists and not b.o.cluster.deleting:
        b.act(DeleteCluster())
    if b.spec is not None and b.spec.serving.enabled and not b.o.serving_exists and b.job.serving_lora_uri:
        adapter = b.st.adapter_path or api.adapter_export_path(b.spec.checkpoint.path, b.job.namespace, b.job.name)
        b.set(serving_name=api.rayservice_name(b.job.name))
        b.act(EnsureServing(adapter))
    return b.done()


def _failed(b: _Builder) -> Plan:
    if b.o.cluster.exists and not b.o.cluster.deleting:
        b.act(DeleteCluster())
    return b.done()


_PHASES = {
    Phase.PENDING: _pending,
    Phase.PROVISIONING: _provisioning,
    Phase.RUNNING: _running,
    Phase.CHECKPOINTING: _checkpointing,
    Phase.RECOVERING: _recovering,
    Phase.SUSPENDED: _suspended,
    Phase.SUCCEEDED: _succeeded,
    Phase.FAILED: _failed,
}


def plan(job: JobView, observed: Observed, now: dt.datetime, timing: Timing = Timing()) -> Plan:
    """Decide the next step for one RLTrainingJob.

    Args:
        job: the job (an invalid spec is ``spec=None`` with ``spec_errors``).
        observed: what the handlers gathered.
        now: the current time (aware UTC); the planner never reads the clock.
        timing: poll interval, unreachable grace and pod-ready grace (seconds).

    Returns:
        The :class:`Plan`. Invalid spec: a Succeeded or Failed job stays so (its usual plan: free the RayCluster);
        any other becomes Failed with ``lastFailure.reason`` InvalidSpec, its RayCluster deleted and no children
        created; fixing the spec of such a job resumes from Pending (nothing submitted yet) or Recovering.
    """
    b = _Builder(job, observed, now, timing)
    phase = job.status.phase or Phase.PENDING
    last = job.status.last_failure
    invalid_before = phase == Phase.FAILED and last is not None and last.reason == Reason.INVALID_SPEC.value
    if job.spec is None:
        if phase == Phase.SUCCEEDED or (phase == Phase.FAILED and not invalid_before):
            return _PHASES[phase](b)  # terminal: an edit after the end changes nothing
        return _invalid(b)
    if invalid_before:
        phase = Phase.PENDING if job.status.attempt == 0 else Phase.RECOVERING
        b.plan.phase = phase
        b.set(last_failure=None, completion_time=None)
        b.event(Reason.AS_EXPECTED, "the spec is valid again")
        if phase == Phase.RECOVERING and job.status.recovery is None:
            # The user's fix restarts the job, as a resume after suspension does: planned, so no backoff and no count
            # against maxRestarts (it had read as an unplanned restart for reason "Unknown", and with maxRestarts
            # spent, as RestartLimitExceeded).
            b.set(recovery=RecoveryInfo(reason=Reason.SPEC_FIXED.value, message="the spec is valid again",
                                        detected_at=b.now_s(), step_at_detection=job.status.current_step))
    return _PHASES[phase](b)
