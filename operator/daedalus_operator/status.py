"""One function computes the whole status: ``compute_status(old, observed, plan, error) -> status dict``.

It applies the planner's decisions, copies the trainer's figures, sets ``observedGeneration`` and every condition in
``metav1.Condition`` form (type, status, reason, message, lastTransitionTime, observedGeneration;
k8s.io/apimachinery/pkg/apis/meta/v1 types.go). ``lastTransitionTime`` changes only when a condition's status flips
(reason and message may change without it), exactly as ``meta.SetStatusCondition`` does.

:func:`merge_patch` turns (old, new) into an RFC 7386 JSON merge patch (``None`` when nothing changed), so the handler
writes the status once and only when it changed.

Condition semantics (kstatus, https://github.com/kubernetes-sigs/cli-utils/blob/master/pkg/kstatus/README.md):
``Reconciling`` True while the operator is still moving the job towards its desired state (provisioning,
checkpointing, recovering, a recovery not yet confirmed by a new step, or a failed action); ``Stalled`` True when it
cannot progress without a human (Failed: invalid spec, restart limit); ``Ready`` True while training runs healthily or
after success. ``Succeeded``, ``Failed``, ``Suspended`` mirror the terminal/paused phases.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from daedalus_trainer.config import CheckpointRef, Condition, JobMetrics, RLTrainingJobStatus

from daedalus_operator.api import ConditionType, Phase, Reason
from daedalus_operator.nodes import format_time, parse_time
from daedalus_operator.plan import JobView, Observed, Plan

#: Order of conditions in the status (stable output, stable patches).
CONDITION_ORDER = [ConditionType.READY, ConditionType.RECONCILING, ConditionType.STALLED,
                   ConditionType.SUCCEEDED, ConditionType.FAILED, ConditionType.SUSPENDED]

#: Seconds after a RayCluster's creation with no ``status`` at all before the conditions ask whether KubeRay runs (its
#: first reconcile writes one within seconds; pods still pulling images have one).
NO_KUBERAY_AFTER_SECONDS = 60.0

_PHASE_MESSAGES = {
    Phase.PENDING: "waiting to create the RayCluster",
    Phase.PROVISIONING: "waiting for the RayCluster to become ready",
    Phase.CHECKPOINTING: "waiting for the trainer to write a checkpoint",
    Phase.RECOVERING: "recovering: stopping the attempt and waiting for a usable cluster",
    Phase.SUSPENDED: "suspended (spec.suspend is true)",
}


def _desired(st: RLTrainingJobStatus, phase: Phase, error: str | None,
             detail: str = "") -> dict[ConditionType, tuple[str, str, str]]:
    """(status, reason, message) per condition type; ``detail`` (what KubeRay, the scheduler and the kubelet say) is
    appended to the Provisioning and Recovering messages (a recovery waits for a usable cluster as provisioning does:
    pods the scheduler cannot place, or containers that cannot start, keep a job there)."""
    rec = st.recovery
    fail = st.last_failure
    step = f"step {st.current_step}/{st.total_steps or '?'}"
    recovering = rec is not None and phase == Phase.RUNNING
    # Submitted (the decision is in status) but the Ray head has not reported the job yet: not Ready. A dashboard the
    # operator cannot reach (a NetworkPolicy, a head still starting) keeps a job here; it read "running, step 0/N",
    # and Argo CD's health check "Healthy", for a job Ray never received.
    unconfirmed = phase == Phase.RUNNING and not st.submission_confirmed and st.submission_id
    if unconfirmed and not recovering:
        ready = ("False", Reason.SUBMITTED.value,
                 f"attempt {st.attempt} submitted as {st.submission_id}; waiting for the Ray head to report it")
    elif phase == Phase.RUNNING and not recovering:
        ready = ("True", Reason.RUNNING.value, f"attempt {st.attempt} running, {step}")
    elif phase == Phase.SUCCEEDED:
        ready = ("True", Reason.SUCCEEDED.value, f"finished at {step}; adapter at {st.adapter_path}")
    elif phase == Phase.RUNNING:
        ready = ("False", Reason.RECOVERING.value,
                 f"attempt {st.attempt} resubmitted after {rec.reason}; waiting for the first new step")
    else:
        ready = ("False", phase.value, _PHASE_MESSAGES.get(phase, phase.value))
    if phase in (Phase.PROVISIONING, Phase.RECOVERING) and detail:
        ready = (ready[0], ready[1], f"{ready[2]}: {detail}"[:1024])
    if phase == Phase.FAILED and fail is not None:
        ready = ("False", fail.reason or Reason.JOB_FAILED.value, fail.message)

    if error:
        reconciling = ("True", Reason.API_ERROR.value, error[:1024])
    elif phase in (Phase.PENDING, Phase.PROVISIONING, Phase.CHECKPOINTING, Phase.RECOVERING):
        msg = ready[2] if phase in (Phase.PROVISIONING, Phase.RECOVERING) else _PHASE_MESSAGES[phase]
        if rec is not None and phase in (Phase.CHECKPOINTING, Phase.RECOVERING):
            msg = f"{rec.reason}: {rec.message}" + (f"; waiting for the RayCluster: {detail}" if detail else "")
            msg = msg[:1024]
        reconciling = ("True", phase.value, msg)
    elif recovering:
        reconciling = ("True", Reason.RECOVERING.value, ready[2])
    elif unconfirmed:
        reconciling = ("True", Reason.SUBMITTED.value, ready[2])
    else:
        reconciling = ("False", Reason.AS_EXPECTED.value, "")

    if phase == Phase.FAILED:
        reason = fail.reason if fail is not None and fail.reason else Reason.JOB_FAILED.value
        stalled = ("True", reason, fail.message if fail is not None else "failed")
        failed = ("True", reason, stalled[2])
    else:
        stalled = ("False", Reason.AS_EXPECTED.value, "")
        failed = ("False", Reason.AS_EXPECTED.value, "")
    succeeded = ("True", Reason.SUCCEEDED.value, ready[2]) if phase == Phase.SUCCEEDED else (
        "False", Reason.AS_EXPECTED.value, "")
    suspended = ("True", Reason.SUSPENDED.value, _PHASE_MESSAGES[Phase.SUSPENDED]) if phase == Phase.SUSPENDED else (
        "False", Reason.AS_EXPECTED.value, "")
    return {
        ConditionType.READY: ready,
        ConditionType.RECONCILING: reconciling,
        ConditionType.STALLED: stalled,
        ConditionType.SUCCEEDED: succeeded,
        ConditionType.FAILED: failed,
        ConditionType.SUSPENDED: suspended,
    }


def conditions(old: list[Condition], st: RLTrainingJobStatus, phase: Phase, generation: int, now: dt.datetime,
               error: str | None = None, detail: str = "") -> list[Condition]:
    """Every condition, in :data:`CONDITION_ORDER`; ``lastTransitionTime`` kept from ``old`` unless the status flips."""
    before = {c.type: c for c in old}
    out = []
    for ctype, (status, reason, message) in _desired(st, phase, error, detail).items():
        prev = before.get(ctype.value)
        ltt = prev.last_transition_time if prev is not None and prev.status == status and prev.last_transition_time \
            else format_time(now)
        out.append(Condition(type=ctype.value, status=status, reason=reason, message=message,
                             last_transition_time=ltt, observed_generation=generation))
    return out


def _steps_per_hour(st: RLTrainingJobStatus, now: dt.datetime) -> float | None:
    start = parse_time(st.attempt_start_time)
    if start is None or st.current_step <= 0:
        return None
    base = 0
    if st.recovery is not None and st.recovery.resume_step is not None:
        base = st.recovery.resume_step
    elif st.last_recovery is not None and st.attempt > 1:
        base = st.last_recovery.resumed_from_step
    hours = (now - start).total_seconds() / 3600.0
    if hours <= 0 or st.current_step <= base:
        return None
    return round((st.current_step - base) / hours, 3)


def compute_status(
    old: dict[str, Any] | None,
    observed: Observed,
    plan: Plan,
    error: str | None,
    *,
    job: JobView,
    now: dt.datetime,
) -> dict[str, Any]:
    """The new ``.status`` (camelCase JSON, ``None`` fields omitted).

    Args:
        old: the current ``.status`` (may hold fields this version does not know; they are kept).
        observed: the observations the plan was made from (trainer figures, cluster address).
        plan: the planner's decision (phase, status fields).
        error: message of an action that failed in this reconcile (Reconciling=True, reason APIError), or ``None``.
        job: the job (generation, spec for totalSteps).
        now: current time (aware UTC), for lastTransitionTime and steps/hour.
    """
    st = RLTrainingJobStatus.model_validate(old or {})
    st = st.model_copy(update=plan.status)
    st.phase = plan.phase
    t = observed.trainer
    if t.answers_for(st.attempt) and plan.phase in (Phase.RUNNING, Phase.CHECKPOINTING):
        if t.step is not None:
            st.current_step = t.step
        if t.latest_checkpoint is not None and t.checkpoint_step is not None:
            st.latest_checkpoint = CheckpointRef(step=t.checkpoint_step, path=str(t.latest_checkpoint.get("path", "")),
                                                 time=t.latest_checkpoint.get("time"))
        if t.adapter_path:
            st.adapter_path = t.adapter_path
        metrics = st.metrics or JobMetrics()
        if t.success_ratio is not None:
            metrics.success_rate = t.success_ratio
        if t.reward_mean is not None:
            metrics.reward_mean = t.reward_mean
        st.metrics = metrics
    if plan.phase in (Phase.RUNNING, Phase.CHECKPOINTING):
        sph = _steps_per_hour(st, now)
        if sph is not None:
            st.metrics = (st.metrics or JobMetrics()).model_copy(update={"steps_per_hour": sph})
    if t.answers_for(st.attempt) and t.total_steps is not None and plan.phase in (
            Phase.RUNNING, Phase.CHECKPOINTING):
        st.total_steps = t.total_steps  # what the running trainer was configured with
    elif job.spec is not None and (st.total_steps is None or st.attempt == 0):
        st.total_steps = job.spec.algorithm.steps  # before the first attempt; later, submit_next records it
    cluster = observed.cluster
    st.dashboard_url = cluster.dashboard_url if cluster.exists and not cluster.deleting else None
    st.observed_generation = job.generation
    detail = ""
    if plan.phase in (Phase.PROVISIONING, Phase.RECOVERING):
        said = ([f"RayCluster: {cluster.message}"] if cluster.exists and cluster.message else []) + list(
            observed.health.unscheduled[:2]) + list(observed.health.not_starting[:2])
        silent = (now - cluster.created).total_seconds() if cluster.exists and cluster.created else 0.0
        if cluster.exists and not cluster.reported and not cluster.deleting and silent >= NO_KUBERAY_AFTER_SECONDS:
            # No running count of seconds: the message must not change on every poll (a status patch each time)
            name = f"RayCluster {st.ray_cluster_name}" if st.ray_cluster_name else "the RayCluster"
            said.insert(0, f"{name} (created {format_time(cluster.created)}) has had no status for over "
                        f"{NO_KUBERAY_AFTER_SECONDS:.0f} s: is the KubeRay operator running? (docs/deploy.md section 2)")
        detail = "; ".join(said)
    st.conditions = conditions(st.conditions, st, plan.phase, job.generation, now, error, detail)
    return st.model_dump(by_alias=True, mode="json", exclude_none=True)


def merge_patch(old: Any, new: Any) -> Any:
    """RFC 7386 JSON merge patch turning ``old`` into ``new``: changed or added keys with their new values, removed
    keys as ``None``, nested objects recursively, lists whole. ``None`` when nothing changed."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return None if old == new else new
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif isinstance(value, dict) and isinstance(old[key], dict):
            sub = merge_patch(old[key], value)
            if sub is not None:
                patch[key] = sub
        elif old[key] != value:
            patch[key] = value
    return patch or None
