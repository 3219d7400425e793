"""The planning core as tables: one row per (phase, observation), including an operator restart in every phase.

Each row gives the job's last written status and what the handlers observed, and asserts the next phase, the actions
(types and their key arguments), the status fields recorded and the events. A second test re-plans every row as a
restarted operator would (status written, actions' effects not yet visible) and checks the invariant that matters most:
no submission ever uses an id other than the one recorded in status.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml
from daedalus_trainer.config import RLTrainingJobStatus, SpecError, parse_job
from jobs import set_spec_fields

from daedalus_operator import api, plan as p
from daedalus_operator.api import Phase, Reason
from daedalus_operator.nodes import ClusterState, NodeHealth, NodeIssue, PodIssue, format_time
from daedalus_operator.status import compute_status

ROOT = Path(__file__).resolve().parents[2]
NOW = dt.datetime(2026, 1, 1, 0, 10, 0, tzinfo=dt.timezone.utc)
UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


def ago(seconds: float) -> str:
    return format_time(NOW - dt.timedelta(seconds=seconds))


def later(seconds: float) -> str:
    return format_time(NOW + dt.timedelta(seconds=seconds))


def sid(attempt: int) -> str:
    return api.submission_id("local-tiny", UID, attempt)


def manifest(**spec_overrides: Any) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text())
    doc["metadata"]["namespace"] = "ml"
    # 40 steps whatever the example says: the rows' trainer reports totalSteps 40 and "all steps done" as step 40
    doc["spec"]["algorithm"]["steps"] = 40
    set_spec_fields(doc["spec"], **spec_overrides)
    return doc


def job(status: dict | None = None, lora_uri: str | None = "s3://b/exports", **spec_overrides: Any) -> p.JobView:
    doc = manifest(**spec_overrides)
    try:
        parsed = parse_job(doc)
        spec, errors = parsed.spec, ()
    except SpecError as exc:
        spec, errors = None, tuple(exc.errors)
    return p.JobView(name="local-tiny", namespace="ml", uid=UID, generation=1, spec=spec,
                     status=RLTrainingJobStatus.model_validate(status or {}), spec_errors=errors,
                     serving_lora_uri=lora_uri)


READY = ClusterState(exists=True, ready=True, head_host="10.0.0.5", state="ready")
NOT_READY = ClusterState(exists=True, ready=False, head_host=None)
GONE = ClusterState(exists=False)
DELETING = ClusterState(exists=True, deleting=True)
HEALTHY = NodeHealth(pods=2, ready_pods=2)  # head + 1 worker (local-tiny)


def trainer(step: int, ckpt: int | None = None, attempt: int | None = None, **kw: Any) -> p.TrainerObservation:
    return p.TrainerObservation(
        reachable=True, step=step, total_steps=40, phase="training", attempt=attempt,
        latest_checkpoint={"step": ckpt, "path": f"/ckpt/ml/local-tiny/step-{ckpt:06d}", "time": ago(5)}
        if ckpt is not None else None, **kw)


def obs(cluster: ClusterState = READY, state: p.RayJobState = p.RayJobState.RUNNING, message: str = "",
        t: p.TrainerObservation | None = None, health: NodeHealth = HEALTHY,
        call: p.CheckpointCall = p.CheckpointCall(), serving: bool = False) -> p.Observed:
    return p.Observed(cluster=cluster, ray_job=p.RayJobObservation(state, message), trainer=t or p.TrainerObservation(),
                      health=health, checkpoint_call=call, serving_exists=serving)


def running_status(attempt: int = 1, **extra: Any) -> dict:
    st = {"phase": "Running", "rayClusterName": "local-tiny-ray", "attempt": attempt, "submissionId": sid(attempt),
          "submissionConfirmed": True, "attemptStartTime": ago(300), "lastProgressTime": ago(10), "currentStep": 12,
          "latestCheckpoint": {"step": 10, "path": "/ckpt/ml/local-tiny/step-000010"}, "startTime": ago(300)}
    st.update(extra)
    return st


ANNOUNCED = NodeHealth(pods=2, ready_pods=2, bad_pods=("local-tiny-ray-cpu-worker-abcde",), announced=(
    NodeIssue("node-b", Reason.NODE_REPLACEMENT, "node node-b is UnschedulablePendingReplacement",
              ("local-tiny-ray-cpu-worker-abcde",)),))
REBOOT = dataclasses.replace(ANNOUNCED, announced=(
    NodeIssue("node-b", Reason.NODE_REBOOT, "node node-b is UnschedulablePendingReboot",
              ("local-tiny-ray-cpu-worker-abcde",)),))
DRAIN = dataclasses.replace(ANNOUNCED, announced=(
    NodeIssue("node-b", Reason.NODE_DRAIN, "node node-b is cordoned", ("local-tiny-ray-cpu-worker-abcde",)),))
WORKER_LOST = NodeHealth(pods=2, ready_pods=1, lost_pods=(
    PodIssue("local-tiny-ray-cpu-worker-fghij", "node-c", "worker", "PodReplaced", "created after the attempt"),))
HEAD_LOST = NodeHealth(pods=1, ready_pods=1, lost_pods=(PodIssue("", None, "head", "PodMissing", "no head pod"),))


def head_not_ready(seconds: float) -> NodeHealth:
    """The head pod Running on a Ready node, its Ready condition False for ``seconds`` (a failing readiness probe)."""
    since = NOW - dt.timedelta(seconds=seconds)
    return NodeHealth(pods=2, ready_pods=1, lost_pods=(PodIssue(
        "local-tiny-ray-head-x", "node-a", "head", "PodNotReady", f"phase Running, not Ready since {format_time(since)}",
        not_ready_since=since),))


def _no_failure(plan: p.Plan) -> bool:
    return plan.in_grace and not ({"recovery", "last_failure", "consecutive_failures"} & plan.status.keys())
RECOVERING = {"reason": "NodeReplacement", "node": "node-b", "detectedAt": ago(60), "stepAtDetection": 12,
              "checkpointRequestedAt": ago(50), "checkpointTargetStep": 12, "stopRequestedAt": ago(40)}


@dataclasses.dataclass
class Row:
    id: str
    job: p.JobView
    observed: p.Observed
    phase: Phase
    actions: list[Any]  # action instances, or action classes when the arguments do not matter
    status: dict[str, Any] = dataclasses.field(default_factory=dict)  # expected plan.status subset (callables ok)
    events: list[str] = dataclasses.field(default_factory=list)  # expected event reasons, in order
    requeue: float | None | str = "any"
    check: Any = None  # extra callable(plan)


ROWS = [
    # ---------------------------------------------------------------------------------------------- invalid spec
    Row("invalid-spec-new-job", job(environment__size=8), obs(GONE, p.RayJobState.NOT_FOUND), Phase.FAILED, [],
        {"last_failure": lambda f: f.reason == "InvalidSpec" and "spec.environment.size" in f.message},
        ["InvalidSpec"], None),
    Row("invalid-spec-restart-no-change",
        job({"phase": "Failed", "lastFailure": {"reason": "InvalidSpec",
             "message": "spec.environment.size: must be odd (outer walls included), e.g. 7, 9 or 11; got 8"}},
            environment__size=8),
        obs(GONE, p.RayJobState.NOT_FOUND), Phase.FAILED, [], {}, [], None,
        check=lambda plan: plan.status == {}),
    Row("invalid-spec-fixed", job({"phase": "Failed", "lastFailure": {"reason": "InvalidSpec", "message": "x"}}),
        obs(GONE, p.RayJobState.NOT_FOUND), Phase.PROVISIONING, [p.EnsureChildren()],
        {"last_failure": None, "ray_cluster_name": "local-tiny-ray"}, ["AsExpected", "Provisioning"], 0),
    # Succeeded and Failed stay terminal whatever the spec becomes; an active job turning invalid frees its cluster
    Row("invalid-spec-after-success-stays-succeeded", job(running_status(phase="Succeeded"), environment__size=8),
        obs(GONE, p.RayJobState.UNREACHABLE), Phase.SUCCEEDED, [], {}, [], None, check=lambda plan: plan.status == {}),
    Row("invalid-spec-after-success-frees-cluster", job(running_status(phase="Succeeded"), environment__size=8),
        obs(state=p.RayJobState.SUCCEEDED), Phase.SUCCEEDED, [p.DeleteCluster()], {}, [], None),
    Row("invalid-spec-after-failure-keeps-its-reason",
        job(running_status(phase="Failed", lastFailure={"reason": "RestartLimitExceeded"}), environment__size=8),
        obs(GONE, p.RayJobState.UNREACHABLE), Phase.FAILED, [], {}, [], None, check=lambda plan: plan.status == {}),
    Row("invalid-spec-while-running-frees-cluster", job(running_status(), environment__size=8),
        obs(t=trainer(12, 10)), Phase.FAILED, [p.DeleteCluster()],
        {"last_failure": lambda f: f.reason == "InvalidSpec"}, ["InvalidSpec"], None),
    # ---------------------------------------------------------------------------------------------- Pending
    Row("pending-new", job(), obs(GONE, p.RayJobState.NOT_FOUND), Phase.PROVISIONING, [p.EnsureChildren()],
        {"ray_cluster_name": "local-tiny-ray"}, ["Provisioning"], 0),
    Row("pending-created-suspended", job(suspend=True), obs(GONE, p.RayJobState.NOT_FOUND), Phase.SUSPENDED, [],
        {}, ["Suspended"], None),
    # ---------------------------------------------------------------------------------------------- Provisioning
    Row("provisioning-cluster-absent", job({"phase": "Provisioning"}), obs(GONE, p.RayJobState.UNREACHABLE),
        Phase.PROVISIONING, [p.EnsureChildren()], {}, [], 2.0),
    Row("provisioning-not-ready", job({"phase": "Provisioning"}), obs(NOT_READY, p.RayJobState.UNREACHABLE,
        health=NodeHealth()), Phase.PROVISIONING, [], {}, [], 2.0),
    Row("provisioning-deleting-old-cluster", job({"phase": "Provisioning"}), obs(DELETING, p.RayJobState.UNREACHABLE),
        Phase.PROVISIONING, [], {}, [], 2.0),
    Row("provisioning-pods-not-all-ready", job({"phase": "Provisioning"}),
        obs(READY, p.RayJobState.NOT_FOUND, health=NodeHealth(pods=2, ready_pods=1)), Phase.PROVISIONING, [], {}, [],
        2.0),
    Row("provisioning-ready-submit-a1", job({"phase": "Provisioning"}), obs(READY, p.RayJobState.NOT_FOUND),
        Phase.RUNNING, [p.EnsureChildren(), p.Submit(sid(1), 1)],
        {"attempt": 1, "submission_id": sid(1), "submission_confirmed": False, "start_time": format_time(NOW),
         "attempt_start_time": format_time(NOW), "last_progress_time": format_time(NOW)}, ["Submitted"], 2.0,
        check=lambda plan: "restarts" not in plan.status and plan.restart_reason is None),
    Row("provisioning-pod-on-bad-node", job({"phase": "Provisioning"}),
        obs(READY, p.RayJobState.NOT_FOUND, health=NodeHealth(pods=2, ready_pods=2, bad_pods=("w-1",))),
        Phase.PROVISIONING, [p.DeletePods(("w-1",))], {}, [], 2.0),
    # a node drained before the first submission: its pod is moved and nothing is submitted meanwhile (DRAIN has the
    # pod in bad_pods and the node announced)
    Row("provisioning-pod-on-drained-node", job({"phase": "Provisioning"}),
        obs(READY, p.RayJobState.NOT_FOUND, health=DRAIN), Phase.PROVISIONING,
        [p.DeletePods(("local-tiny-ray-cpu-worker-abcde",))], {}, [], 2.0),
    Row("provisioning-drained-node-pods-going-waits", job({"phase": "Provisioning"}),
        obs(READY, p.RayJobState.NOT_FOUND, health=dataclasses.replace(DRAIN, bad_pods=())), Phase.PROVISIONING,
        [], {}, [], 2.0),
    # the same for the first cluster: a pod Running but never Ready on a good node (a raylet that cannot join) past
    # --pod-ready-grace is recreated instead of the job staying Provisioning for ever; within it, looked at again
    # when the grace ends
    Row("provisioning-pod-not-ready-past-grace-is-recreated", job({"phase": "Provisioning"}),
        obs(READY, p.RayJobState.NOT_FOUND, health=NodeHealth(pods=2, ready_pods=1, not_ready=(
            ("local-tiny-ray-cpu-worker-abcde", NOW - dt.timedelta(seconds=61)),))), Phase.PROVISIONING,
        [p.DeletePods(("local-tiny-ray-cpu-worker-abcde",))], {}, ["RecreatingPods"], 2.0,
        check=lambda plan: "while provisioning" in plan.events[0].message),
    Row("provisioning-pod-not-ready-within-grace-waits", job({"phase": "Provisioning"}),
        obs(READY, p.RayJobState.NOT_FOUND, health=NodeHealth(pods=2, ready_pods=1, not_ready=(
            ("local-tiny-ray-cpu-worker-abcde", NOW - dt.timedelta(seconds=59.5)),))), Phase.PROVISIONING, [], {}, [],
        0.5),
    Row("provisioning-suspend", job({"phase": "Provisioning"}, suspend=True), obs(NOT_READY, p.RayJobState.UNREACHABLE),
        Phase.SUSPENDED, [p.DeleteCluster()], {}, ["Suspended"], None),
    Row("provisioning-after-suspend-submits-next-attempt",
        job({"phase": "Provisioning", "attempt": 2, "submissionId": sid(2), "restarts": 1,
             "latestCheckpoint": {"step": 20, "path": "/c/step-000020"}}),
        obs(READY, p.RayJobState.NOT_FOUND), Phase.RUNNING, [p.EnsureChildren(), p.Submit(sid(3), 3)],
        {"attempt": 3}, ["Submitted"], 2.0,
        check=lambda plan: not {"restarts", "planned_restarts"} & plan.status.keys()
        and "step 20" in plan.events[0].message),
    # ---------------------------------------------------------------------------------------------- Running
    Row("running-restart-after-status-before-submit", job(running_status(submissionConfirmed=False)),
        obs(READY, p.RayJobState.NOT_FOUND), Phase.RUNNING, [p.EnsureChildren(), p.Submit(sid(1), 1)], {}, [], 2.0),
    Row("running-restart-after-submit-confirms", job(running_status(submissionConfirmed=False)),
        obs(READY, p.RayJobState.RUNNING, t=trainer(12, 10)), Phase.RUNNING, [], {"submission_confirmed": True}, [],
        2.0),
    Row("running-not-confirmed-cluster-not-ready", job(running_status(submissionConfirmed=False)),
        obs(NOT_READY, p.RayJobState.NOT_FOUND), Phase.RUNNING, [], {}, [], 2.0),
    # a recorded submission the head never shows: resubmitted each poll, but suspend, node health, the progress
    # deadline (counted from the submission) and maxRestarts still apply
    Row("running-not-confirmed-never-appears-past-deadline",
        job(running_status(submissionConfirmed=False, lastProgressTime=ago(1801))), obs(READY, p.RayJobState.NOT_FOUND),
        Phase.RECOVERING, [], {"last_failure": lambda f: f.reason == "Hung" and "never appeared" in f.message,
                               "recovery": lambda r: r.reason == "Hung" and r.not_before == later(15)}, ["Hung"], 0),
    Row("running-not-confirmed-never-appears-restart-limit",
        job(running_status(submissionConfirmed=False, lastProgressTime=ago(1801), restarts=3)),
        obs(READY, p.RayJobState.NOT_FOUND), Phase.FAILED, [p.DeleteCluster()],
        {"last_failure": lambda f: f.reason == "RestartLimitExceeded" and "never appeared" in f.message},
        ["RestartLimitExceeded"], None),
    Row("running-not-confirmed-suspend", job(running_status(submissionConfirmed=False), suspend=True),
        obs(READY, p.RayJobState.NOT_FOUND), Phase.RECOVERING, [], {"recovery": lambda r: r.reason == "Suspend"},
        ["Suspend"], 0),
    Row("running-not-confirmed-node-replacement", job(running_status(submissionConfirmed=False),
                                                      resilience__hyperPod=True),
        obs(READY, p.RayJobState.NOT_FOUND, health=ANNOUNCED), Phase.RECOVERING, [],
        {"recovery": lambda r: r.reason == "NodeReplacement" and r.checkpoint_requested_at is None},
        ["NodeReplacement"], 0),
    Row("running-step-advances", job(running_status()), obs(t=trainer(13, 10)), Phase.RUNNING, [],
        {"last_progress_time": format_time(NOW)}, [], 2.0),
    Row("running-no-advance-no-write", job(running_status()), obs(t=trainer(12, 10)), Phase.RUNNING, [], {}, [], 2.0,
        check=lambda plan: plan.status == {}),
    Row("running-stale-trainer-of-other-attempt", job(running_status(attempt=2)), obs(t=trainer(30, 30, attempt=1)),
        Phase.RUNNING, [], {}, [], 2.0, check=lambda plan: plan.status == {}),
    Row("running-succeeded", job(running_status()), obs(state=p.RayJobState.SUCCEEDED), Phase.SUCCEEDED,
        [p.DeleteCluster()], {"completion_time": format_time(NOW),
                              "adapter_path": "/checkpoints/ml/local-tiny/exports/adapter"}, ["Succeeded"], None),
    Row("running-succeeded-serving", job(running_status(), serving__enabled=True), obs(state=p.RayJobState.SUCCEEDED),
        Phase.SUCCEEDED, [p.DeleteCluster(), p.EnsureServing("/checkpoints/ml/local-tiny/exports/adapter")],
        {"serving_name": "local-tiny-serve"}, ["Succeeded"], None),
    Row("running-succeeded-serving-not-configured", job(running_status(), lora_uri=None, serving__enabled=True),
        obs(state=p.RayJobState.SUCCEEDED), Phase.SUCCEEDED, [p.DeleteCluster()], {},
        ["Succeeded", "ServingNotConfigured"], None, check=lambda plan: "serving_name" not in plan.status),
    Row("running-node-replacement-checkpoint", job(running_status(), resilience__hyperPod=True),
        obs(t=trainer(12, 10), health=ANNOUNCED), Phase.CHECKPOINTING, [p.RequestCheckpoint(sid(1), 12)],
        {"recovery": lambda r: r.reason == "NodeReplacement" and r.node == "node-b" and r.checkpoint_target_step == 12
         and r.checkpoint_requested_at == format_time(NOW) and r.not_before is None,
         "last_failure": lambda f: f.reason == "NodeReplacement", "consecutive_failures": 0},
        ["NodeReplacement"], 2.0),
    Row("running-node-replacement-stale-trainer-is-not-asked", job(running_status(attempt=2), resilience__hyperPod=True),
        obs(t=trainer(30, 30, attempt=1), health=ANNOUNCED), Phase.RECOVERING, [p.StopJob(sid(2))],
        {"recovery": lambda r: r.reason == "NodeReplacement" and r.checkpoint_requested_at is None},
        ["NodeReplacement"], 2.0),
    Row("running-node-reboot-no-checkpoint-wanted",
        job(running_status(), resilience__hyperPod=True, resilience__checkpointOnNodeWarning=False),
        obs(t=trainer(12, 10), health=REBOOT), Phase.RECOVERING, [p.StopJob(sid(1))],
        {"recovery": lambda r: r.reason == "NodeReboot" and r.stop_requested_at == format_time(NOW)},
        ["NodeReboot"], 2.0),
    # A drained node (checkpointOnDrain: node_health announces it only then) is checkpointed before stopping even
    # with checkpointOnNodeWarning false (that field is HyperPod's), and is planned: no backoff, no failure counted.
    Row("running-node-drain-checkpoint",
        job(running_status(restarts=3), resilience__checkpointOnNodeWarning=False, resilience__maxRestarts=3),
        obs(t=trainer(12, 10), health=DRAIN), Phase.CHECKPOINTING, [p.RequestCheckpoint(sid(1), 12)],
        {"recovery": lambda r: r.reason == "NodeDrain" and r.node == "node-b" and r.checkpoint_target_step == 12
         and r.not_before is None and r.message == "node node-b is cordoned",
         "last_failure": lambda f: f.reason == "NodeDrain", "consecutive_failures": 0},
        ["NodeDrain"], 2.0),
    Row("running-node-replacement-trainer-unreachable", job(running_status(), resilience__hyperPod=True),
        obs(health=ANNOUNCED), Phase.RECOVERING, [p.StopJob(sid(1))],
        {"recovery": lambda r: r.step_at_detection == 12 and r.checkpoint_requested_at is None}, ["NodeReplacement"]),
    Row("running-worker-lost", job(running_status(), resilience__restartBackoffSeconds=15),
        obs(t=trainer(12, 10), health=WORKER_LOST), Phase.RECOVERING, [p.StopJob(sid(1))],
        {"recovery": lambda r: r.reason == "WorkerLost" and r.not_before == later(15), "consecutive_failures": 1},
        ["WorkerLost"]),
    Row("running-worker-lost-second-failure-backoff-doubles",
        job(running_status(consecutiveFailures=2), resilience__restartBackoffSeconds=15),
        obs(t=trainer(12, 10), health=WORKER_LOST), Phase.RECOVERING, [p.StopJob(sid(1))],
        {"recovery": lambda r: r.not_before == later(60), "consecutive_failures": 3}, ["WorkerLost"]),
    Row("running-head-lost", job(running_status()), obs(state=p.RayJobState.UNREACHABLE, health=HEAD_LOST),
        Phase.RECOVERING, [], {"recovery": lambda r: r.reason == "HeadLost"}, ["HeadLost"], 0),
    # a pod not Ready on a Ready node (readiness probe failing under load) is tolerated for --pod-ready-grace (60 s),
    # the job looked at again when the grace ends; past it, checkpoint when the trainer answers, else stop
    Row("running-head-not-ready-within-grace", job(running_status()), obs(t=trainer(12, 10), health=head_not_ready(5)),
        Phase.RUNNING, [], {}, [], 2.0, check=_no_failure),
    Row("running-head-not-ready-grace-ends-before-the-next-poll", job(running_status()),
        obs(t=trainer(12, 10), health=head_not_ready(59.5)), Phase.RUNNING, [], {}, [], 0.5, check=_no_failure),
    Row("running-head-not-ready-and-dashboard-timing-out-within-grace", job(running_status()),
        obs(state=p.RayJobState.UNREACHABLE, message="timeout", health=head_not_ready(5)), Phase.RUNNING, [],
        {"unreachable_since": format_time(NOW)}, [], 2.0, check=_no_failure),
    Row("running-head-not-ready-past-grace-checkpoint", job(running_status()),
        obs(t=trainer(12, 10), health=head_not_ready(61)), Phase.CHECKPOINTING, [p.RequestCheckpoint(sid(1), 12)],
        {"recovery": lambda r: r.reason == "HeadLost" and r.checkpoint_target_step == 12
         and "local-tiny-ray-head-x" in r.message}, ["HeadLost"], 2.0, check=lambda plan: not plan.in_grace),
    Row("running-head-not-ready-past-grace-trainer-silent", job(running_status()),
        obs(health=head_not_ready(61)), Phase.RECOVERING, [p.StopJob(sid(1))],
        {"recovery": lambda r: r.reason == "HeadLost" and r.checkpoint_requested_at is None
         and r.stop_requested_at == format_time(NOW)}, ["HeadLost"], 2.0),
    Row("running-app-error", job(running_status()),
        obs(state=p.RayJobState.FAILED, message="Job entrypoint command failed with exit code 1: ValueError: bad"),
        Phase.RECOVERING, [], {"last_failure": lambda f: f.reason == "ApplicationError" and "ValueError" in f.message,
                               "recovery": lambda r: r.not_before == later(15)}, ["ApplicationError"], 0),
    Row("running-infra-failure-message", job(running_status()),
        obs(state=p.RayJobState.FAILED, message="ray.exceptions.NodeDiedError: node 1f3 died"),
        Phase.RECOVERING, [], {"last_failure": lambda f: f.reason == "JobFailed"}, ["JobFailed"], 0),
    Row("running-killed-sigkill", job(running_status()),
        obs(state=p.RayJobState.FAILED, message="Job entrypoint command failed with exit code -9"),
        Phase.RECOVERING, [], {"last_failure": lambda f: f.reason == "JobFailed"}, ["JobFailed"], 0),
    Row("running-failed-restart-limit", job(running_status(restarts=3)),
        obs(state=p.RayJobState.FAILED, message="boom"), Phase.FAILED, [p.DeleteCluster()],
        {"last_failure": lambda f: f.reason == "RestartLimitExceeded" and "ApplicationError" in f.message,
         "completion_time": format_time(NOW)}, ["RestartLimitExceeded"], None),
    Row("running-failed-within-limit-planned-restarts-excluded", job(running_status(restarts=3, plannedRestarts=1)),
        obs(state=p.RayJobState.FAILED, message="boom"), Phase.RECOVERING, [],
        {"last_failure": lambda f: f.reason == "ApplicationError"}, ["ApplicationError"], 0),
    Row("running-failed-past-limit-after-planned-restarts", job(running_status(restarts=4, plannedRestarts=1)),
        obs(state=p.RayJobState.FAILED, message="boom"), Phase.FAILED, [p.DeleteCluster()],
        {"last_failure": lambda f: f.reason == "RestartLimitExceeded" and "ApplicationError" in f.message},
        ["RestartLimitExceeded"], None),
    Row("running-ended-on-announced-node-past-limit-is-planned",
        job(running_status(restarts=3), resilience__hyperPod=True),
        obs(state=p.RayJobState.FAILED, message="exit code 1", health=ANNOUNCED), Phase.RECOVERING, [],
        {"recovery": lambda r: r.reason == "NodeReplacement" and r.not_before is None}, ["NodeReplacement"], 0),
    Row("running-stopped-externally", job(running_status()), obs(state=p.RayJobState.STOPPED),
        Phase.RECOVERING, [], {"last_failure": lambda f: f.reason == "JobStopped"}, ["JobStopped"], 0),
    Row("running-job-forgotten-by-head", job(running_status()), obs(state=p.RayJobState.NOT_FOUND),
        Phase.RECOVERING, [], {"last_failure": lambda f: f.reason == "HeadLost"}, ["HeadLost"], 0),
    Row("running-cluster-deleted-by-hand", job(running_status()), obs(GONE, p.RayJobState.UNREACHABLE),
        Phase.RECOVERING, [], {"last_failure": lambda f: f.reason == "ClusterLost"}, ["ClusterLost"], 0),
    Row("running-dashboard-unreachable-first", job(running_status()), obs(state=p.RayJobState.UNREACHABLE,
        message="connection refused"), Phase.RUNNING, [], {"unreachable_since": format_time(NOW)}, [], 2.0),
    Row("running-dashboard-unreachable-past-grace", job(running_status(unreachableSince=ago(61))),
        obs(state=p.RayJobState.UNREACHABLE, message="connection refused"), Phase.RECOVERING, [],
        {"last_failure": lambda f: f.reason == "HeadLost" and "unreachable for 61 s" in f.message}, ["HeadLost"], 0),
    Row("running-dashboard-back", job(running_status(unreachableSince=ago(30))), obs(t=trainer(12, 10)),
        Phase.RUNNING, [], {"unreachable_since": None}, [], 2.0),
    Row("running-hung", job(running_status(lastProgressTime=ago(1801))), obs(t=trainer(12, 10)),
        Phase.CHECKPOINTING, [p.RequestCheckpoint(sid(1), 12)], {"recovery": lambda r: r.reason == "Hung",
                                                                  "consecutive_failures": 1}, ["Hung"]),
    Row("running-suspend", job(running_status(), suspend=True), obs(t=trainer(12, 10)), Phase.CHECKPOINTING,
        [p.RequestCheckpoint(sid(1), 12)], {"recovery": lambda r: r.reason == "Suspend"}, ["Suspend"],
        check=lambda plan: "last_failure" not in plan.status and "consecutive_failures" in plan.status
        and plan.status["consecutive_failures"] == 0),
    Row("running-recovery-completes",
        job(running_status(attempt=2, currentStep=12, restarts=1, recovery=dict(
            RECOVERING, resubmittedAt=ago(20), resumeStep=12))),
        obs(t=trainer(13, 12, attempt=2)), Phase.RUNNING, [],
        {"recovery": None, "consecutive_failures": 0,
         "last_recovery": lambda r: r.seconds == 60.0 and r.lost_steps == 0 and r.resumed_from_step == 12},
        ["Recovered"], 2.0, check=lambda plan: plan.recovered is not None and plan.recovered.seconds == 60.0),
    Row("running-resumed-but-not-yet-stepping",
        job(running_status(attempt=2, currentStep=12, recovery=dict(RECOVERING, resubmittedAt=ago(20),
                                                                    resumeStep=10))),
        obs(t=trainer(10, 10, attempt=2)), Phase.RUNNING, [], {}, [], 2.0,
        check=lambda plan: "recovery" not in plan.status),
    Row("running-recovery-uses-the-trainers-resume-step",
        job(running_status(attempt=2, currentStep=10, recovery=dict(RECOVERING, reason="JobFailed",
                                                                    resubmittedAt=ago(20), resumeStep=5))),
        obs(t=dataclasses.replace(trainer(11, 10, attempt=2), resumed_from=10)), Phase.RUNNING, [],
        {"last_recovery": lambda r: r.resumed_from_step == 10 and r.lost_steps == 2}, ["Recovered"], 2.0),
    Row("running-recovery-completes-with-lost-steps",
        job(running_status(attempt=2, currentStep=10, recovery=dict(RECOVERING, reason="JobFailed",
                                                                    resubmittedAt=ago(20), resumeStep=10))),
        obs(t=trainer(11, 10, attempt=2)), Phase.RUNNING, [],
        {"last_recovery": lambda r: r.lost_steps == 2 and r.step_at_detection == 12}, ["Recovered"], 2.0),
    # ---------------------------------------------------------------------------------------------- Checkpointing
    Row("checkpointing-done-by-status", job(running_status(phase="Checkpointing", recovery=dict(
        RECOVERING, stopRequestedAt=None))), obs(t=trainer(13, 13), call=p.CheckpointCall(in_flight=True)),
        Phase.RECOVERING, [p.StopJob(sid(1))],
        {"latest_checkpoint": lambda c: c.step == 13 and c.path.endswith("step-000013"),
         "recovery": lambda r: r.stop_requested_at == format_time(NOW)}, ["CheckpointTaken", "Recovering"]),
    Row("checkpointing-done-by-call-result", job(running_status(phase="Checkpointing", recovery=dict(
        RECOVERING, stopRequestedAt=None))), obs(t=trainer(13, 10), call=p.CheckpointCall(step=13, path="/c/13")),
        Phase.RECOVERING, [p.StopJob(sid(1))], {"latest_checkpoint": lambda c: c.step == 13 and c.path == "/c/13"},
        ["CheckpointTaken", "Recovering"]),
    Row("checkpointing-waiting", job(running_status(phase="Checkpointing", recovery=dict(
        RECOVERING, checkpointRequestedAt=ago(5), stopRequestedAt=None))),
        obs(t=trainer(12, 10), call=p.CheckpointCall(in_flight=True)), Phase.CHECKPOINTING, [], {}, [], 2.0),
    Row("checkpointing-operator-restart-asks-again", job(running_status(phase="Checkpointing", recovery=dict(
        RECOVERING, checkpointRequestedAt=ago(5), stopRequestedAt=None))), obs(t=trainer(12, 10)),
        Phase.CHECKPOINTING, [p.RequestCheckpoint(sid(1), 12)], {}, [], 2.0),
    Row("checkpointing-timeout", job(running_status(phase="Checkpointing", recovery=dict(
        RECOVERING, checkpointRequestedAt=ago(301), stopRequestedAt=None))),
        obs(t=trainer(12, 10), call=p.CheckpointCall(in_flight=True)), Phase.RECOVERING, [p.StopJob(sid(1))], {},
        ["CheckpointTimeout", "Recovering"]),
    Row("checkpointing-call-failed", job(running_status(phase="Checkpointing", recovery=dict(
        RECOVERING, checkpointRequestedAt=ago(5), stopRequestedAt=None))),
        obs(t=trainer(12, 10), call=p.CheckpointCall(error="POST /stop: HTTP 500: disk full", http_status=500)),
        Phase.RECOVERING, [p.StopJob(sid(1))], {}, ["CheckpointFailed", "Recovering"]),
    Row("checkpointing-call-trainer-ended", job(running_status(phase="Checkpointing", recovery=dict(
        RECOVERING, checkpointRequestedAt=ago(5), stopRequestedAt=None))),
        obs(t=trainer(12, 10), call=p.CheckpointCall(error="POST /stop: HTTP 409: trainer already failed",
                                                     http_status=409)),
        Phase.RECOVERING, [p.StopJob(sid(1))], {}, ["CheckpointFailed", "Recovering"]),
    # no answer (a connection reset) or 401 (the token Secret was replaced): ask again at the next look while
    # checkpointTimeoutSeconds lasts, stop only after it
    Row("checkpointing-call-no-answer-asks-again", job(running_status(phase="Checkpointing", recovery=dict(
        RECOVERING, checkpointRequestedAt=ago(5), stopRequestedAt=None))),
        obs(t=trainer(12, 10), call=p.CheckpointCall(error="trainer did not answer: connection reset", http_status=0)),
        Phase.CHECKPOINTING, [p.RequestCheckpoint(sid(1), 12)], {}, [], 2.0),
    Row("checkpointing-call-401-asks-again", job(running_status(phase="Checkpointing", recovery=dict(
        RECOVERING, checkpointRequestedAt=ago(5), stopRequestedAt=None))),
        obs(t=trainer(12, 10), call=p.CheckpointCall(error="POST /stop: HTTP 401: wrong token", http_status=401)),
        Phase.CHECKPOINTING, [p.RequestCheckpoint(sid(1), 12)], {}, [], 2.0),
    Row("checkpointing-call-no-answer-trainer-unreachable-waits", job(running_status(
        phase="Checkpointing", recovery=dict(RECOVERING, checkpointRequestedAt=ago(5), stopRequestedAt=None))),
        obs(call=p.CheckpointCall(error="trainer did not answer: connection refused", http_status=0)),
        Phase.CHECKPOINTING, [], {}, [], 2.0),
    Row("checkpointing-call-no-answer-past-timeout", job(running_status(phase="Checkpointing", recovery=dict(
        RECOVERING, checkpointRequestedAt=ago(301), stopRequestedAt=None))),
        obs(t=trainer(12, 10), call=p.CheckpointCall(error="trainer did not answer: connection reset", http_status=0)),
        Phase.RECOVERING, [p.StopJob(sid(1))], {}, ["CheckpointFailed", "Recovering"]),
    Row("checkpointing-job-ended", job(running_status(phase="Checkpointing", recovery=dict(
        RECOVERING, stopRequestedAt=None))), obs(state=p.RayJobState.FAILED, message="node died"),
        Phase.RECOVERING, [], {"recovery": lambda r: r.stop_requested_at == format_time(NOW)}, ["Recovering"], 0),
    # one dashboard timeout is no evidence that the Ray job ended: keep waiting for the checkpoint (bounded by
    # checkpointTimeoutSeconds), never go on to StopJob the trainer mid-checkpoint
    Row("checkpointing-dashboard-timeout-keeps-waiting", job(running_status(phase="Checkpointing", recovery=dict(
        RECOVERING, checkpointRequestedAt=ago(5), stopRequestedAt=None))),
        obs(state=p.RayJobState.UNREACHABLE, message="timeout", call=p.CheckpointCall(in_flight=True)),
        Phase.CHECKPOINTING, [], {}, [], 2.0, check=lambda plan: "recovery" not in plan.status),
    Row("checkpointing-dashboard-timeout-checkpoint-written", job(running_status(phase="Checkpointing", recovery=dict(
        RECOVERING, checkpointRequestedAt=ago(5), stopRequestedAt=None))),
        obs(state=p.RayJobState.UNREACHABLE, message="timeout", call=p.CheckpointCall(step=13, path="/c/13")),
        Phase.RECOVERING, [p.StopJob(sid(1))], {"latest_checkpoint": lambda c: c.step == 13},
        ["CheckpointTaken", "Recovering"]),
    Row("checkpointing-dashboard-timeout-past-checkpoint-timeout", job(running_status(
        phase="Checkpointing", recovery=dict(RECOVERING, checkpointRequestedAt=ago(301), stopRequestedAt=None))),
        obs(state=p.RayJobState.UNREACHABLE, message="timeout", call=p.CheckpointCall(in_flight=True)),
        Phase.RECOVERING, [p.StopJob(sid(1))], {}, ["CheckpointTimeout", "Recovering"]),
    Row("checkpointing-cluster-gone", job(running_status(phase="Checkpointing", recovery=dict(
        RECOVERING, checkpointRequestedAt=ago(5), stopRequestedAt=None))), obs(GONE, p.RayJobState.UNREACHABLE),
        Phase.RECOVERING, [], {}, ["Recovering"], 0),
    Row("checkpointing-job-finished-all-steps", job(running_status(phase="Checkpointing", recovery=RECOVERING,
                                                                  currentStep=40)),
        obs(state=p.RayJobState.SUCCEEDED), Phase.SUCCEEDED, [p.DeleteCluster()], {"recovery": None}, ["Succeeded"],
        None),
    Row("checkpointing-stopped-on-request-is-not-success", job(running_status(phase="Checkpointing", recovery=dict(
        RECOVERING, stopRequestedAt=None))), obs(state=p.RayJobState.SUCCEEDED, call=p.CheckpointCall(step=13,
                                                                                                       path="/c/13")),
        Phase.RECOVERING, [], {"latest_checkpoint": lambda c: c.step == 13}, ["Recovering"], 0,
        check=lambda plan: "stopped after its checkpoint at step 13" in plan.events[0].message),
    Row("recovering-last-step-finished-meanwhile",
        job(running_status(phase="Recovering", recovery=RECOVERING, currentStep=40)),
        obs(state=p.RayJobState.SUCCEEDED), Phase.SUCCEEDED, [p.DeleteCluster()], {}, ["Succeeded"], None),
    # ---------------------------------------------------------------------------------------------- Recovering
    Row("recovering-operator-restart-stops-again", job(running_status(phase="Recovering", recovery=RECOVERING)),
        obs(t=trainer(13, 13)), Phase.RECOVERING, [p.StopJob(sid(1))], {}, [], 2.0,
        check=lambda plan: plan.status == {}),
    Row("recovering-stop-not-yet-recorded", job(running_status(phase="Recovering", recovery=dict(
        RECOVERING, stopRequestedAt=None))), obs(state=p.RayJobState.RUNNING), Phase.RECOVERING,
        [p.StopJob(sid(1))], {"recovery": lambda r: r.stop_requested_at == format_time(NOW)}, [], 2.0),
    Row("recovering-delete-pods-on-bad-node", job(running_status(phase="Recovering", recovery=RECOVERING)),
        obs(state=p.RayJobState.STOPPED, health=ANNOUNCED), Phase.RECOVERING,
        [p.DeletePods(("local-tiny-ray-cpu-worker-abcde",))], {}, [], 2.0),
    Row("recovering-backoff", job(running_status(phase="Recovering", recovery=dict(RECOVERING, notBefore=later(7)))),
        obs(state=p.RayJobState.FAILED), Phase.RECOVERING, [], {}, [], 7.0),
    Row("recovering-cluster-not-ready", job(running_status(phase="Recovering", recovery=RECOVERING)),
        obs(NOT_READY, p.RayJobState.UNREACHABLE, health=NodeHealth(pods=1, ready_pods=1)), Phase.RECOVERING, [], {},
        [], 2.0),
    Row("recovering-worker-rescheduled-not-ready", job(running_status(phase="Recovering", recovery=RECOVERING)),
        obs(state=p.RayJobState.STOPPED, health=NodeHealth(pods=2, ready_pods=1)), Phase.RECOVERING, [], {}, [], 2.0),
    # a pod Running but never Ready on a good node would keep the cluster unusable for ever: past --pod-ready-grace
    # (60 s) it is deleted like a pod on a bad node (KubeRay recreates it); within it, looked at when it ends
    Row("recovering-pod-not-ready-past-grace-is-recreated",
        job(running_status(phase="Recovering", recovery=RECOVERING)),
        obs(state=p.RayJobState.STOPPED, health=NodeHealth(pods=2, ready_pods=1, not_ready=(
            ("local-tiny-ray-cpu-worker-abcde", NOW - dt.timedelta(seconds=61)),))), Phase.RECOVERING,
        [p.DeletePods(("local-tiny-ray-cpu-worker-abcde",))], {}, ["RecreatingPods"], 2.0,
        check=lambda plan: "local-tiny-ray-cpu-worker-abcde" in plan.events[0].message),
    Row("recovering-pod-not-ready-within-grace-waits",
        job(running_status(phase="Recovering", recovery=RECOVERING)),
        obs(state=p.RayJobState.STOPPED, health=NodeHealth(pods=2, ready_pods=1, not_ready=(
            ("local-tiny-ray-cpu-worker-abcde", NOW - dt.timedelta(seconds=59.5)),))), Phase.RECOVERING, [], {}, [],
        0.5),
    Row("recovering-pod-not-ready-and-pod-on-bad-node-deleted-together",
        job(running_status(phase="Recovering", recovery=RECOVERING)),
        obs(state=p.RayJobState.STOPPED, health=dataclasses.replace(ANNOUNCED, ready_pods=1, not_ready=(
            ("local-tiny-ray-head-x", NOW - dt.timedelta(seconds=120)),))), Phase.RECOVERING,
        [p.DeletePods(("local-tiny-ray-cpu-worker-abcde", "local-tiny-ray-head-x"))], {}, ["RecreatingPods"], 2.0),
    Row("recovering-cluster-gone", job(running_status(phase="Recovering", recovery=dict(RECOVERING,
                                                                                        reason="ClusterLost"))),
        obs(GONE, p.RayJobState.UNREACHABLE, health=NodeHealth()), Phase.RECOVERING, [p.EnsureChildren()], {}, [],
        2.0),
    Row("recovering-resubmit", job(running_status(phase="Recovering", recovery=RECOVERING,
                                                  latestCheckpoint={"step": 12, "path": "/c/12"})),
        obs(state=p.RayJobState.STOPPED), Phase.RUNNING, [p.EnsureChildren(), p.Submit(sid(2), 2)],
        {"attempt": 2, "submission_id": sid(2), "restarts": 1, "submission_confirmed": False,
         "recovery": lambda r: r.resubmitted_at == format_time(NOW) and r.resume_step == 12},
        ["Resubmitted"], 2.0, check=lambda plan: plan.restart_reason == "NodeReplacement"),
    Row("recovering-resubmit-after-drain-is-planned",
        job(running_status(phase="Recovering", recovery=dict(RECOVERING, reason="NodeDrain"), restarts=3),
            resilience__maxRestarts=3),
        obs(state=p.RayJobState.STOPPED), Phase.RUNNING, [p.EnsureChildren(), p.Submit(sid(2), 2)],
        {"attempt": 2, "restarts": 4, "planned_restarts": 1}, ["Resubmitted"], 2.0,
        check=lambda plan: plan.restart_reason == "NodeDrain"),
    Row("recovering-deletes-the-pods-on-a-drained-node",
        job(running_status(phase="Recovering", recovery=dict(RECOVERING, reason="NodeDrain"))),
        obs(state=p.RayJobState.STOPPED, health=DRAIN), Phase.RECOVERING,
        [p.DeletePods(("local-tiny-ray-cpu-worker-abcde",))], {}, [], 2.0),
    # during an unplanned restart's backoff too: the drain is not held for the backoff
    Row("recovering-in-backoff-still-moves-pods-off-a-drained-node",
        job(running_status(phase="Recovering", recovery=dict(RECOVERING, reason="WorkerLost", notBefore=later(60)))),
        obs(state=p.RayJobState.STOPPED, health=DRAIN), Phase.RECOVERING,
        [p.DeletePods(("local-tiny-ray-cpu-worker-abcde",))], {}, [], 2.0),
    Row("recovering-resubmit-after-head-loss-job-unknown",
        job(running_status(phase="Recovering", recovery=dict(RECOVERING, reason="HeadLost"))),
        obs(state=p.RayJobState.NOT_FOUND), Phase.RUNNING, [p.EnsureChildren(), p.Submit(sid(2), 2)], {},
        ["Resubmitted"], 2.0),
    # maxRestarts (3 in the example) counts unplanned restarts only: restarts - plannedRestarts; a status written by
    # an operator without plannedRestarts reads it as 0
    Row("recovering-restart-limit", job(running_status(phase="Recovering", restarts=3,
                                                       recovery=dict(RECOVERING, reason="WorkerLost"))),
        obs(state=p.RayJobState.STOPPED), Phase.FAILED, [p.DeleteCluster()],
        {"last_failure": lambda f: f.reason == "RestartLimitExceeded" and "unplanned 3 >= maxRestarts 3" in f.message},
        ["RestartLimitExceeded"], None),
    Row("recovering-all-restarts-planned-resubmits", job(running_status(phase="Recovering", recovery=RECOVERING,
                                                                        restarts=3, plannedRestarts=3)),
        obs(state=p.RayJobState.STOPPED), Phase.RUNNING, [p.EnsureChildren(), p.Submit(sid(2), 2)],
        {"restarts": 4, "planned_restarts": 4}, ["Resubmitted"], 2.0),
    Row("recovering-planned-restart-never-refused", job(running_status(phase="Recovering", recovery=RECOVERING,
                                                                       restarts=3)),
        obs(state=p.RayJobState.STOPPED), Phase.RUNNING, [p.EnsureChildren(), p.Submit(sid(2), 2)],
        {"restarts": 4, "planned_restarts": 1}, ["Resubmitted"], 2.0),
    Row("recovering-unplanned-restart-counts-only-in-restarts",
        job(running_status(phase="Recovering", restarts=3, plannedRestarts=1,
                           recovery=dict(RECOVERING, reason="WorkerLost"))),
        obs(state=p.RayJobState.STOPPED), Phase.RUNNING, [p.EnsureChildren(), p.Submit(sid(2), 2)],
        {"restarts": 4}, ["Resubmitted"], 2.0, check=lambda plan: "planned_restarts" not in plan.status),
    Row("recovering-unplanned-past-limit-after-planned-ones",
        job(running_status(phase="Recovering", restarts=5, plannedRestarts=2,
                           recovery=dict(RECOVERING, reason="WorkerLost"))),
        obs(state=p.RayJobState.STOPPED), Phase.FAILED, [p.DeleteCluster()],
        {"last_failure": lambda f: f.reason == "RestartLimitExceeded" and "restarts 5, 2 of them planned" in f.message},
        ["RestartLimitExceeded"], None),
    Row("recovering-suspend-done", job(running_status(phase="Recovering", recovery=dict(RECOVERING, reason="Suspend")),
                                       suspend=True),
        obs(state=p.RayJobState.STOPPED), Phase.SUSPENDED, [p.DeleteCluster()], {"recovery": None}, ["Suspended"],
        None),
    # suspend and resume are no restart, planned or not, and are never refused at the restart limit
    Row("recovering-suspend-at-restart-limit",
        job(running_status(phase="Recovering", restarts=3, recovery=dict(RECOVERING, reason="Suspend")), suspend=True),
        obs(state=p.RayJobState.STOPPED), Phase.SUSPENDED, [p.DeleteCluster()], {"recovery": None}, ["Suspended"],
        None, check=lambda plan: not {"restarts", "planned_restarts", "last_failure"} & plan.status.keys()),
    Row("provisioning-resumed-at-restart-limit-submits",
        job({"phase": "Provisioning", "attempt": 4, "submissionId": sid(4), "restarts": 3}),
        obs(READY, p.RayJobState.NOT_FOUND), Phase.RUNNING, [p.EnsureChildren(), p.Submit(sid(5), 5)], {"attempt": 5},
        ["Submitted"], 2.0, check=lambda plan: not {"restarts", "planned_restarts"} & plan.status.keys()),
    # ---------------------------------------------------------------------------------------------- Suspended
    Row("suspended-deletes-cluster", job(running_status(phase="Suspended"), suspend=True),
        obs(state=p.RayJobState.UNREACHABLE), Phase.SUSPENDED, [p.DeleteCluster()], {}, [], None),
    Row("suspended-stays", job(running_status(phase="Suspended"), suspend=True), obs(GONE, p.RayJobState.UNREACHABLE),
        Phase.SUSPENDED, [], {}, [], None, check=lambda plan: plan.status == {}),
    Row("suspended-resume", job(running_status(phase="Suspended")), obs(GONE, p.RayJobState.UNREACHABLE),
        Phase.PROVISIONING, [p.EnsureChildren()], {}, ["Resumed"], 0),
    # ---------------------------------------------------------------------------------------------- terminal
    Row("succeeded-frees-cluster", job(running_status(phase="Succeeded")), obs(state=p.RayJobState.SUCCEEDED),
        Phase.SUCCEEDED, [p.DeleteCluster()], {}, [], None),
    Row("succeeded-operator-restart-nothing", job(running_status(phase="Succeeded")),
        obs(GONE, p.RayJobState.UNREACHABLE), Phase.SUCCEEDED, [], {}, [], None, check=lambda plan: plan.status == {}),
    Row("succeeded-serving-missing", job(running_status(phase="Succeeded", adapterPath="/a"), serving__enabled=True),
        obs(GONE, p.RayJobState.UNREACHABLE), Phase.SUCCEEDED, [p.EnsureServing("/a")], {}, [], None),
    Row("succeeded-serving-not-configured-quiet",
        job(running_status(phase="Succeeded", adapterPath="/a"), lora_uri=None, serving__enabled=True),
        obs(GONE, p.RayJobState.UNREACHABLE), Phase.SUCCEEDED, [], {}, [], None),
    Row("succeeded-serving-exists", job(running_status(phase="Succeeded", adapterPath="/a"), serving__enabled=True),
        obs(GONE, p.RayJobState.UNREACHABLE, serving=True), Phase.SUCCEEDED, [], {}, [], None),
    Row("failed-frees-cluster", job(running_status(phase="Failed", lastFailure={"reason": "RestartLimitExceeded"})),
        obs(state=p.RayJobState.FAILED), Phase.FAILED, [p.DeleteCluster()], {}, [], None),
    Row("failed-operator-restart-nothing",
        job(running_status(phase="Failed", lastFailure={"reason": "RestartLimitExceeded"})),
        obs(GONE, p.RayJobState.UNREACHABLE), Phase.FAILED, [], {}, [], None, check=lambda plan: plan.status == {}),
]


def _match_actions(got: list[Any], want: list[Any]) -> bool:
    if len(got) != len(want):
        return False
    return all((isinstance(g, w) if isinstance(w, type) else g == w) for g, w in zip(got, want))


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_plan_table(row: Row) -> None:
    result = p.plan(row.job, row.observed, NOW)
    assert result.phase == row.phase, result
    assert _match_actions(result.actions, row.actions), (result.actions, row.actions)
    for key, want in row.status.items():
        assert key in result.status, (key, result.status)
        got = result.status[key]
        assert (want(got) if callable(want) else got == want), (key, got)
    assert [e.reason for e in result.events] == row.events, result.events
    if row.requeue != "any":
        assert result.requeue_after == row.requeue
    if row.check is not None:
        assert row.check(result), result


def test_trainer_answers_only_for_its_own_attempt() -> None:
    assert trainer(5, attempt=2).answers_for(2)
    assert not trainer(5, attempt=1).answers_for(2)  # the previous attempt's trainer, still up
    assert trainer(5, attempt=None).answers_for(2) and trainer(5, attempt=0).answers_for(2)  # names no attempt
    assert not p.TrainerObservation(attempt=2).answers_for(2)  # did not answer


def test_every_phase_has_rows() -> None:
    phases = {r.job.status.phase or Phase.PENDING for r in ROWS}
    assert phases == set(Phase)


def _restarted(row: Row) -> tuple[p.JobView, p.Plan]:
    """The operator wrote the status of the first plan and crashed before its actions had any visible effect."""
    first = p.plan(row.job, row.observed, NOW)
    new_status = compute_status(row.job.status.model_dump(by_alias=True, mode="json", exclude_none=True),
                                row.observed, first, None, job=row.job, now=NOW)
    job2 = dataclasses.replace(row.job, status=RLTrainingJobStatus.model_validate(new_status))
    return job2, p.plan(job2, row.observed, NOW + dt.timedelta(seconds=1))


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_restart_never_submits_an_unrecorded_id(row: Row) -> None:
    job2, second = _restarted(row)
    for action in second.actions:
        if isinstance(action, p.Submit):
            recorded = second.status.get("submission_id", job2.status.submission_id)
            assert action.submission_id == recorded
            assert action.attempt == second.status.get("attempt", job2.status.attempt)
    first_ids = {a.submission_id for a in p.plan(row.job, row.observed, NOW).actions if isinstance(a, p.Submit)}
    second_ids = {a.submission_id for a in second.actions if isinstance(a, p.Submit)}
    assert not (first_ids and second_ids) or first_ids == second_ids, "a restart must resubmit the same id"


def test_backoff_doubles_and_caps() -> None:
    assert [p.backoff_seconds(15, n) for n in range(0, 8)] == [0, 15, 30, 60, 120, 240, 480, 600]
    assert p.backoff_seconds(0, 5) == 0


@pytest.mark.parametrize("message,reason", [
    ("Job entrypoint command failed with exit code 1, last available logs: ValueError", Reason.APPLICATION_ERROR),
    ("ray.exceptions.RayletDiedError: the raylet died", Reason.JOB_FAILED),
    ("The actor died unexpectedly before finishing this task", Reason.JOB_FAILED),
    ("Job supervisor actor died", Reason.JOB_FAILED),
    ("exit code 137", Reason.JOB_FAILED),
])
def test_classify_failure_messages(message: str, reason: Reason) -> None:
    got, node, msg = p.classify_failure(p.RayJobObservation(p.RayJobState.FAILED, message), NodeHealth())
    assert got == reason and node is None and message in msg


def test_a_failed_entrypoint_s_message_keeps_the_last_log_lines_where_the_cause_is() -> None:
    """Ray's message for a failed entrypoint carries the driver's last log lines (up to 20,000 characters); the
    conditions and events keep 1024 characters of the message, which could end before the trainer's error, the last
    line. Now the last lines are kept, colour codes removed."""
    chatter = "".join(f"2026-12-06 22:10:{i % 60:02d},775 INFO worker.py:2038 -- \x1b[36mline {i}\x1b[0m\n"
                      for i in range(300))
    message = ("Job entrypoint command failed with exit code 2, last available logs (truncated to 20,000 chars):\n"
               + chatter + "error: cannot load the adapter in /fsx/sft: adapter_model.safetensors: Error while "
               "deserializing header: incomplete metadata, file not fully covered\n")
    reason, node, msg = p.classify_failure(p.RayJobObservation(p.RayJobState.FAILED, message), NodeHealth())
    assert reason == Reason.APPLICATION_ERROR and node is None
    assert msg.startswith("Ray job FAILED: Job entrypoint command failed with exit code 2; last log lines: ")
    assert msg.endswith("| error: cannot load the adapter in /fsx/sft: adapter_model.safetensors: Error while "
                        "deserializing header: incomplete metadata, file not fully covered")
    assert "line 299 | error:" in msg and "line 0 " not in msg and "\x1b" not in msg
    assert len(msg) <= 1024 - len("ApplicationError: ")
    assert p.quotes_log_tail(message) and not p.quotes_log_tail("exit code 1") and not p.quotes_log_tail(None)
    no_logs = "Job entrypoint command failed with exit code 1. No logs available."
    assert p.summarize_ray_message(no_logs) == no_logs and p.summarize_ray_message(None) == ""
    long_line = "Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):\n" \
        + "x" * 5000 + "\n"
    assert p.summarize_ray_message(long_line) == "Job entrypoint command failed with exit code 1; last log lines: " \
        "..." + "x" * p.LOG_TAIL_CHARS


def test_classify_prefers_node_evidence() -> None:
    got, node, msg = p.classify_failure(p.RayJobObservation(p.RayJobState.FAILED, "exit code 1"), ANNOUNCED)
    assert (got, node) == (Reason.NODE_REPLACEMENT, "node-b") and "exit code 1" in msg


def test_trainer_observation_from_status_document() -> None:
    t = p.TrainerObservation.from_status({"step": "7", "totalSteps": 40, "phase": "training",
                                          "latestCheckpoint": {"step": 5, "path": "/c/5", "time": "t"},
                                          "successRatio": 0.5, "attempt": 2, "extra": 1})
    assert (t.step, t.total_steps, t.checkpoint_step, t.success_ratio, t.attempt) == (7, 40, 5, 0.5, 2)
    assert p.TrainerObservation.from_status({"latestCheckpoint": None}).checkpoint_step is None


# ------------------------------------------------------------------------------------------------ pods not Ready
def _pod(name: str, node: str, role: str, ready: bool, since: dt.datetime) -> dict:
    return {"metadata": {"name": name, "creationTimestamp": ago(600),
                         "labels": {api.JOB_LABEL: "local-tiny", api.RAY_NODE_TYPE_LABEL: role}},
            "spec": {"nodeName": node},
            "status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": format_time(since)}]}}


def _node(name: str, ready: bool) -> dict:
    return {"metadata": {"name": name}, "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}


@pytest.mark.parametrize("head_node_ready,not_ready_for,grace,phase", [
    (True, 5, 60.0, Phase.RUNNING),  # a readiness blip: tolerated
    (True, 61, 60.0, Phase.CHECKPOINTING),  # past the grace, the trainer answering: checkpoint first
    (True, 5, 0.0, Phase.CHECKPOINTING),  # --pod-ready-grace 0: lost at once
    (False, 5, 60.0, Phase.RECOVERING),  # the head's node NotReady: lost at once, as before (no checkpoint)
])
def test_a_pod_not_ready_counts_as_lost_after_the_grace_unless_its_node_is_not_ready(
        head_node_ready: bool, not_ready_for: float, grace: float, phase: Phase) -> None:
    """From pod and node bodies as the handlers read them: the grace counts from the Ready condition's
    lastTransitionTime (no operator memory), and only for a pod on a Ready node."""
    from daedalus_operator.nodes import node_health

    pods = [_pod("local-tiny-ray-head-x", "node-a", "head", False, NOW - dt.timedelta(seconds=not_ready_for)),
            _pod("local-tiny-ray-cpu-worker-y", "node-b", "worker", True, NOW - dt.timedelta(seconds=500))]
    nodes = {"node-a": _node("node-a", head_node_ready), "node-b": _node("node-b", True)}
    st = running_status()
    health = node_health(pods, nodes, hyperpod=False, since=NOW - dt.timedelta(seconds=300), expected_pods=2)
    o = obs(t=trainer(12, 10), health=health)
    result = p.plan(job(st), o, NOW, p.Timing(pod_ready_grace=grace))
    assert result.phase == phase, result
    if phase == Phase.RUNNING:
        assert result.actions == [] and result.events == [] and result.in_grace
        ready = {c["type"]: c for c in compute_status(st, o, result, None, job=job(st), now=NOW)["conditions"]}
        assert (ready["Ready"]["status"], ready["Ready"]["reason"]) == ("True", "Running")
        assert ready["Failed"]["status"] == ready["Stalled"]["status"] == "False"
    elif phase == Phase.CHECKPOINTING:
        assert result.actions == [p.RequestCheckpoint(sid(1), 12)]
    else:
        assert result.actions == [p.StopJob(sid(1))] and result.status["recovery"].reason == "HeadLost"
        assert "node node-a not Ready" in result.status["recovery"].message


@pytest.mark.parametrize("grace,flipped_ago,started_ago,deleted", [
    (60.0, 600, None, True),  # not Ready for 10 minutes on a Ready node: recreated
    (60.0, 600, 30, False),  # its container started 30 s ago (image pull, restart): still inside the grace
    (60.0, 600, 90, True),
    (0.0, 600, None, False),  # --pod-ready-grace 0: never (a recreated pod is never Ready at once)
    (5.0, 600, 30, False),  # a 5 s grace (for a flickering probe while Running) waits at least 60 s here
    (5.0, 600, 61, True),
])
def test_recovery_recreates_a_pod_that_stays_not_ready_on_a_ready_node(
        grace: float, flipped_ago: float, started_ago: float | None, deleted: bool) -> None:
    """From pod and node bodies as the handlers read them while Recovering (no attempt: ``since`` None): a worker
    Running but not Ready on a Ready node past the grace is deleted, so that recovery does not wait for a cluster
    that never becomes usable; a healthy job with that worker would otherwise requeue forever."""
    from daedalus_operator.nodes import node_health

    worker = _pod("local-tiny-ray-cpu-worker-y", "node-b", "worker", False, NOW - dt.timedelta(seconds=flipped_ago))
    if started_ago is not None:
        worker["status"]["containerStatuses"] = [{"name": "ray-worker", "state": {"running": {
            "startedAt": ago(started_ago)}}}]
    pods = [_pod("local-tiny-ray-head-x", "node-a", "head", True, NOW - dt.timedelta(seconds=900)), worker]
    nodes = {"node-a": _node("node-a", True), "node-b": _node("node-b", True)}
    health = node_health(pods, nodes, hyperpod=False, since=None, expected_pods=2)
    st = running_status(phase="Recovering", recovery=dict(RECOVERING, reason="WorkerLost"))
    result = p.plan(job(st), obs(state=p.RayJobState.STOPPED, health=health), NOW, p.Timing(pod_ready_grace=grace))
    assert result.phase == Phase.RECOVERING
    if deleted:
        assert result.actions == [p.DeletePods(("local-tiny-ray-cpu-worker-y",))]
        assert [e.reason for e in result.events] == ["RecreatingPods"]
    else:
        assert result.actions == [] and result.events == []  # waits for the pod (the old behaviour, within grace)


# ------------------------------------------------------------------------------------------------ one attempt at a time
def _walk(status: dict, seconds: float, observed: p.Observed) -> tuple[dict, p.Plan]:
    """Plan at ``NOW + seconds`` and write the status as the handler would."""
    j = job(status)
    now = NOW + dt.timedelta(seconds=seconds)
    result = p.plan(j, observed, now)
    return compute_status(status, observed, result, None, job=j, now=now), result


def _kinds(result: p.Plan) -> list[tuple[str, str]]:
    return [(type(a).__name__, getattr(a, "submission_id", "")[-2:]) for a in result.actions]


def test_an_unanswering_dashboard_never_leads_to_a_second_attempt_beside_the_first() -> None:
    """The dashboard stops answering (a busy head) while attempt 1 keeps training: HeadLost after the grace, then no
    attempt 2 until there is evidence that attempt 1 ended. Asked to stop; still unconfirmed after the grace, the
    RayCluster is deleted and recreated; the new cluster's head cannot run attempt 1, so attempt 2 goes there."""
    unreachable = obs(state=p.RayJobState.UNREACHABLE, message="timeout")
    st = running_status()
    st, r = _walk(st, 0, unreachable)
    st, r = _walk(st, 61, unreachable)
    assert r.phase == Phase.RECOVERING and [e.reason for e in r.events] == ["HeadLost"]
    submitted = []
    for t in range(62, 140, 2):  # the backoff passes; the dashboard still does not answer
        st, r = _walk(st, t, unreachable)
        submitted += [a for a in r.actions if isinstance(a, p.Submit)]
        if any(isinstance(a, p.DeleteCluster) for a in r.actions):
            break
    assert submitted == [], "attempt 2 submitted while attempt 1 may still run"
    assert st["attempt"] == 1 and st["phase"] == "Recovering"
    assert [e.reason for e in r.events] == ["RecreatingCluster"] and r.events[0].type.value == "Warning"
    st, r = _walk(st, t + 2, obs(cluster=GONE, state=p.RayJobState.UNREACHABLE))
    assert _kinds(r) == [("EnsureChildren", "")]
    fresh = dataclasses.replace(READY, created=NOW + dt.timedelta(seconds=t + 3))
    st, r = _walk(st, t + 20, obs(cluster=fresh, state=p.RayJobState.UNREACHABLE))  # its dashboard not up yet
    assert ("Submit", "a2") in _kinds(r) and st["attempt"] == 2


def test_a_reachable_dashboard_still_running_the_old_attempt_is_stopped_first() -> None:
    """After HeadLost the dashboard answers again and attempt 1 is still RUNNING there: stop it, wait for STOPPED,
    then submit attempt 2 (never both)."""
    st = running_status(phase="Recovering", unreachableSince=None,
                        recovery={"reason": "HeadLost", "detectedAt": ago(100), "stepAtDetection": 12})
    st, r = _walk(st, 0, obs(state=p.RayJobState.RUNNING))
    assert _kinds(r) == [("StopJob", "a1")] and st["attempt"] == 1
    st, r = _walk(st, 2, obs(state=p.RayJobState.UNREACHABLE))
    assert _kinds(r) == [("StopJob", "a1")] and st["attempt"] == 1
    st, r = _walk(st, 4, obs(state=p.RayJobState.STOPPED))
    assert ("Submit", "a2") in _kinds(r) and st["attempt"] == 2


def test_the_grace_before_recreating_counts_from_the_first_unanswered_look_not_an_earlier_stop() -> None:
    """The Ray job was asked to stop 120 s ago (a slow checkpoint-and-stop) and the dashboard now times out once:
    that alone must not delete a healthy RayCluster; only the grace from this first unanswered look does."""
    st = running_status(phase="Recovering", unreachableSince=None,
                        recovery={"reason": "NodeReboot", "detectedAt": ago(130), "stopRequestedAt": ago(120),
                                  "stepAtDetection": 12})
    unreachable = obs(state=p.RayJobState.UNREACHABLE, message="timeout")
    st, r = _walk(st, 0, unreachable)
    assert _kinds(r) == [("StopJob", "a1")]
    st, r = _walk(st, 30, unreachable)
    assert _kinds(r) == [("StopJob", "a1")]
    st, r = _walk(st, 62, unreachable)
    assert ("DeleteCluster", "") in _kinds(r) and [e.reason for e in r.events] == ["RecreatingCluster"]


@pytest.mark.parametrize("evidence", ["new head pod", "head does not know the job", "job failed"])
def test_recovery_resubmits_at_once_with_evidence_that_the_old_attempt_ended(evidence: str) -> None:
    """The fast paths stay fast: a head pod created after the attempt started, a reachable head that does not know the
    submission (NOT_FOUND), or an ended Ray job let attempt 2 go in the same plan."""
    st = running_status(phase="Recovering",
                        recovery={"reason": "HeadLost", "detectedAt": ago(10), "stepAtDetection": 12})
    o = {"new head pod": obs(state=p.RayJobState.UNREACHABLE,
                             health=dataclasses.replace(HEALTHY, head_created=NOW - dt.timedelta(seconds=5))),
         "head does not know the job": obs(state=p.RayJobState.NOT_FOUND),
         "job failed": obs(state=p.RayJobState.FAILED)}[evidence]
    st, r = _walk(st, 0, o)
    assert ("Submit", "a2") in _kinds(r) and st["attempt"] == 2


def test_a_submission_that_never_lands_is_retried_until_the_progress_deadline_then_restarted() -> None:
    """Ray refuses attempt 1 on every poll (its head reports NOT_FOUND): the same id is submitted again, never a new
    one, until progressDeadlineSeconds (1800 s) after the submission; then it is a Hung failure and, after the
    backoff, attempt 2 goes in (one restart)."""
    st = running_status(submissionConfirmed=False, lastProgressTime=ago(0))
    not_found = obs(READY, p.RayJobState.NOT_FOUND)
    for t in range(0, 1800, 300):
        st, r = _walk(st, t, not_found)
        assert _kinds(r) == [("EnsureChildren", ""), ("Submit", "a1")] and st["phase"] == "Running"
    st, r = _walk(st, 1801, not_found)
    assert r.phase == Phase.RECOVERING and [e.reason for e in r.events] == ["Hung"] and _kinds(r) == []
    st, r = _walk(st, 1801 + 16, not_found)
    assert ("Submit", "a2") in _kinds(r) and (st["attempt"], st["restarts"]) == (2, 1)


def test_hyperpod_maintenance_past_max_restarts_resumes_and_one_unplanned_failure_still_fails() -> None:
    """A long job has been resubmitted maxRestarts (3) times, every time for HyperPod maintenance: a fourth node
    replacement is checkpointed and resubmitted like the first (restarts 4, plannedRestarts 4); then one unplanned
    failure is resubmitted (unplanned 1 of 3), and once three unplanned restarts were made the next one fails the
    job with RestartLimitExceeded."""
    st = running_status(restarts=3, plannedRestarts=3, attempt=4, submissionId=sid(4))
    j = lambda status: job(status, resilience__hyperPod=True)  # noqa: E731

    def walk(status: dict, seconds: float, o: p.Observed) -> tuple[dict, p.Plan]:
        now = NOW + dt.timedelta(seconds=seconds)
        result = p.plan(j(status), o, now)
        return compute_status(status, o, result, None, job=j(status), now=now), result

    st, r = walk(st, 0, obs(t=trainer(12, 10, attempt=4), health=ANNOUNCED))
    assert r.phase == Phase.CHECKPOINTING
    st, r = walk(st, 2, obs(state=p.RayJobState.STOPPED, health=ANNOUNCED,
                            call=p.CheckpointCall(step=12, path="/c/12")))
    assert r.phase == Phase.RECOVERING
    st, r = walk(st, 3, obs(state=p.RayJobState.STOPPED, health=ANNOUNCED))
    assert _kinds(r) == [("DeletePods", "")]
    st, r = walk(st, 5, obs(state=p.RayJobState.STOPPED))
    assert ("Submit", "a5") in _kinds(r) and (st["restarts"], st["plannedRestarts"]) == (4, 4)
    for n in range(3):  # three unplanned failures: each resubmitted after its backoff
        attempt = 5 + n
        st, r = walk(st, 100 * (n + 1), obs(state=p.RayJobState.FAILED, message="boom"))
        assert r.phase == Phase.RECOVERING, (n, r)
        st, r = walk(st, 100 * (n + 1) + 90, obs(state=p.RayJobState.FAILED, message="boom"))
        assert ("Submit", f"a{attempt + 1}"[-2:]) in _kinds(r), (n, r)
    assert (st["restarts"], st["plannedRestarts"]) == (7, 4)
    st, r = walk(st, 1000, obs(state=p.RayJobState.FAILED, message="boom"))
    assert r.phase == Phase.FAILED and st["lastFailure"]["reason"] == "RestartLimitExceeded"


def test_a_flapping_hyperpod_node_backs_off_without_counting_against_max_restarts() -> None:
    """HyperPod marks a node under the job again before the restart it caused made a step (a flapping label, or the
    pods put back on a node that fails again): that restart waits restartBackoffSeconds like a failure instead of
    looping at full speed, still counts as planned (never against maxRestarts: here 1), and once the job steps again
    the next announcement is resubmitted at once."""
    j = lambda status: job(status, resilience__hyperPod=True, resilience__maxRestarts=1,  # noqa: E731
                           resilience__restartBackoffSeconds=15)

    def walk(status: dict, seconds: float, o: p.Observed) -> tuple[dict, p.Plan]:
        now = NOW + dt.timedelta(seconds=seconds)
        result = p.plan(j(status), o, now)
        return compute_status(status, o, result, None, job=j(status), now=now), result

    def replaced(status: dict, t0: float, attempt: int, step: int) -> tuple[dict, p.Plan]:
        """Checkpoint, stop, move the pods; returns the first look at which the next attempt may be submitted."""
        status, r = walk(status, t0, obs(t=trainer(step, step, attempt=attempt), health=ANNOUNCED))
        assert r.phase == Phase.CHECKPOINTING, r
        status, r = walk(status, t0 + 1, obs(state=p.RayJobState.STOPPED, health=ANNOUNCED,
                                             call=p.CheckpointCall(step=step, path=f"/c/{step}")))
        status, r = walk(status, t0 + 2, obs(state=p.RayJobState.STOPPED, health=ANNOUNCED))
        assert _kinds(r) == [("DeletePods", "")], r
        return status, r

    st = running_status()
    st, _ = replaced(st, 0, 1, 12)
    st, r = walk(st, 3, obs(state=p.RayJobState.STOPPED))
    assert ("Submit", "a2") in _kinds(r) and st["consecutiveFailures"] == 0  # the first: at once
    # attempt 2 has not stepped past 12 when the node is marked again
    st, _ = replaced(st, 10, 2, 12)
    assert st["consecutiveFailures"] == 1 and st["recovery"]["notBefore"] == format_time(
        NOW + dt.timedelta(seconds=10 + 15))
    st, r = walk(st, 13, obs(state=p.RayJobState.STOPPED))
    assert ("Submit", "a3") not in _kinds(r) and r.requeue_after == pytest.approx(12.0)  # backing off
    st, r = walk(st, 25, obs(state=p.RayJobState.STOPPED))
    assert ("Submit", "a3") in _kinds(r) and (st["restarts"], st["plannedRestarts"]) == (2, 2)  # not refused
    st, r = walk(st, 30, obs(t=trainer(13, 12, attempt=3)))  # stepping again: the recovery closes
    assert st.get("recovery") is None and st["consecutiveFailures"] == 0
    st, _ = replaced(st, 40, 3, 14)
    st, r = walk(st, 43, obs(state=p.RayJobState.STOPPED))
    assert ("Submit", "a4") in _kinds(r) and (st["restarts"], st["plannedRestarts"]) == (3, 3)


def test_success_reports_the_steps_the_trainer_ran_not_a_later_spec_edit() -> None:
    """``algorithm.steps`` raised from 40 to 96 while attempt 1 (submitted with 40, which its trainer reported) runs:
    the Ray job exits 0 after step 40. Status says 40 of 40 were done, never 96 (the trainer never ran them); on a
    server without CEL nothing else stops such an edit."""
    st = running_status(currentStep=38, totalSteps=40)
    j = job(st, algorithm__steps=96)
    o = obs(state=p.RayJobState.SUCCEEDED)
    r = p.plan(j, o, NOW)
    assert r.phase == Phase.SUCCEEDED and r.status["current_step"] == 40
    new = compute_status(st, o, r, None, job=j, now=NOW)
    assert (new["currentStep"], new["totalSteps"]) == (40, 40)
    # the trainer's own totalSteps wins while it answers
    running = compute_status(running_status(totalSteps=40), obs(t=trainer(13)), p.plan(
        job(running_status(totalSteps=40), algorithm__steps=96), obs(t=trainer(13)), NOW), None,
        job=job(running_status(totalSteps=40), algorithm__steps=96), now=NOW)
    assert (running["currentStep"], running["totalSteps"]) == (13, 40)
    # a new attempt records what it is submitted with
    rec = running_status(phase="Recovering", totalSteps=40, recovery={"reason": "JobFailed", "detectedAt": ago(60),
                                                                      "stepAtDetection": 12})
    r = p.plan(job(rec, algorithm__steps=96), obs(state=p.RayJobState.FAILED), NOW)
    assert any(isinstance(a, p.Submit) for a in r.actions) and r.status["total_steps"] == 96


def test_argocd_health_of_statuses_the_operator_computes() -> None:
    """The chart's Argo CD health check (charts/daedalus/files/argocd-health.lua, run by lupa) over statuses this
    planner and status module actually write, not hand-made fixtures: each phase maps to the Argo CD status the
    chart promises (README "Argo CD")."""
    from argocd import health

    def argo(status: dict) -> str:
        return health({"metadata": {"generation": status.get("observedGeneration", 1)}, "status": status})[0]

    def fresh(j: p.JobView, o: p.Observed) -> dict:
        return compute_status({}, o, p.plan(j, o, NOW), None, job=j, now=NOW)

    running, _ = _walk(running_status(), 0, obs(t=trainer(13)))
    provisioning = fresh(job(), obs(NOT_READY, p.RayJobState.NOT_FOUND))
    unreachable = obs(state=p.RayJobState.UNREACHABLE, message="timeout")
    recovering, _ = _walk(running_status(), 0, unreachable)
    recovering, _ = _walk(recovering, 61, unreachable)
    done = running_status(currentStep=38, totalSteps=40)
    o = obs(state=p.RayJobState.SUCCEEDED)
    succeeded = compute_status(done, o, p.plan(job(done), o, NOW), None, job=job(done), now=NOW)
    failed = fresh(job(environment__size=8), obs(GONE, p.RayJobState.NOT_FOUND))
    got = {s["phase"]: argo(s) for s in (running, provisioning, recovering, succeeded, failed)}
    assert got == {"Running": "Healthy", "Provisioning": "Progressing", "Recovering": "Progressing",
                   "Succeeded": "Healthy", "Failed": "Degraded"}


def test_a_worker_group_scaled_up_during_a_run_waits_for_the_next_raycluster_not_for_ever() -> None:
    """``workerGroups[0].replicas`` raised from 1 to 2 while the job recovers: the operator never patches a RayCluster,
    so the existing one (head + 1 worker, ``expected_pods`` 2) is what the next attempt runs on; its 2 Ready pods make
    it usable and attempt 2 is submitted. (Compared with the edited spec, 3 pods, it was never usable: Recovering for
    ever, without a word in the status about why.)"""
    st = running_status(phase="Recovering", recovery={"reason": "JobFailed", "detectedAt": ago(60),
                                                      "stepAtDetection": 12})
    cluster = dataclasses.replace(READY, expected_pods=2)
    j = job(st, cluster__workerGroups=[{"name": "cpu", "replicas": 2, "gpusPerWorker": 0, "cpu": "2",
                                        "memory": "8Gi", "shmSize": "1Gi"}])
    assert j.expected_pods == 3
    r = p.plan(j, obs(cluster, p.RayJobState.FAILED), NOW)
    assert ("Submit", "a2") in _kinds(r), r
    # a RayCluster built from the edited spec (created again: suspend and resume) waits for its third pod
    r = p.plan(j, obs(dataclasses.replace(READY, expected_pods=3), p.RayJobState.FAILED), NOW)
    assert r.phase == Phase.RECOVERING and _kinds(r) == []


def test_a_resumed_attempt_that_is_still_starting_does_not_reset_the_step() -> None:
    """Attempt 2 was submitted to resume from the checkpoint at step 12; its trainer answers /status while it still
    loads the model (phase ``starting``, the placeholder step 0, no checkpoint yet: the trainer's own initial
    document). The job's step stays 12 (never 0/40 for the minutes a large model takes to load), and loading the
    checkpoint (step 12 again) is no progress."""
    from daedalus_trainer.server import ControlState

    st = running_status(attempt=2, submissionId=sid(2), currentStep=12, lastProgressTime=ago(30),
                        latestCheckpoint={"step": 12, "path": "/ckpt/ml/local-tiny/step-000012"},
                        recovery={"reason": "NodeReplacement", "detectedAt": ago(60), "stepAtDetection": 12,
                                  "resubmittedAt": ago(30), "resumeStep": 12})
    starting = p.TrainerObservation.from_status(ControlState(total_steps=40, attempt=2).status())
    o = obs(t=starting)
    r = p.plan(job(st), o, NOW)
    new = compute_status(st, o, r, None, job=job(st), now=NOW)
    assert r.phase == Phase.RUNNING and new["currentStep"] == 12 and new["lastProgressTime"] == ago(30)
    # the checkpoint loaded: the trainer says step 12 (still starting); then its first new step closes the recovery
    loaded = dataclasses.replace(starting, step=12, resumed_from=12,
                                 latest_checkpoint={"step": 12, "path": "/ckpt/ml/local-tiny/step-000012"})
    r = p.plan(job(new), obs(t=loaded), NOW)
    new = compute_status(new, obs(t=loaded), r, None, job=job(new), now=NOW)
    assert new["currentStep"] == 12 and new["lastProgressTime"] == ago(30) and new["recovery"]
    stepping = dataclasses.replace(loaded, step=13, phase="training")
    r = p.plan(job(new), obs(t=stepping), NOW)
    assert r.recovered is not None and r.status["last_progress_time"] == format_time(NOW)


def test_a_running_job_whose_invalid_spec_is_fixed_resumes_as_a_planned_restart() -> None:
    """A running job (3 unplanned restarts already, maxRestarts 3) failed for an invalid spec; the user fixes it. The
    resume is the user's restart, as after a suspension: Recovering with a SpecFixed recovery (not "Unknown"), then a
    resubmission counted in plannedRestarts and never refused by maxRestarts (it had failed the job at once with
    "RestartLimitExceeded: Unknown: ")."""
    failed = running_status(phase="Failed", restarts=3, lastFailure={"reason": "InvalidSpec", "message": "x"})
    first = p.plan(job(failed, resilience__maxRestarts=3), obs(GONE, p.RayJobState.NOT_FOUND), NOW)
    assert first.phase == Phase.RECOVERING and first.status["last_failure"] is None
    rec = first.status["recovery"]
    assert (rec.reason, rec.message, rec.step_at_detection) == ("SpecFixed", "the spec is valid again", 12)
    assert [e.reason for e in first.events][:1] == ["AsExpected"]
    # the next reconciles: a new RayCluster, ready; the old attempt is gone with the old cluster
    recovering = dict(failed, phase="Recovering", recovery=rec.model_dump(by_alias=True, mode="json",
                                                                          exclude_none=True))
    recovering.pop("lastFailure")
    second = p.plan(job(recovering, resilience__maxRestarts=3), obs(READY, p.RayJobState.NOT_FOUND), NOW)
    assert second.phase == Phase.RUNNING, (second.phase, second.events)
    assert any(isinstance(a, p.Submit) and a.attempt == 2 for a in second.actions), second.actions
    assert (second.status["restarts"], second.status["planned_restarts"]) == (4, 1)
    assert second.restart_reason == "SpecFixed"


@pytest.mark.parametrize("latest,says", [
    ({"step": 12, "path": "/c/12"}, "resuming from the checkpoint at step 12"),
    # it said "resuming from the checkpoint at step 0"; a job created again under its name can find checkpoints on
    # the volume that its status does not know
    (None, "resuming from the newest checkpoint on the volume, if any (the status records none)"),
])
def test_the_resubmitted_event_says_where_the_attempt_starts(latest, says):
    st = running_status(phase="Recovering", recovery=RECOVERING, latestCheckpoint=latest)
    if latest is None:
        del st["latestCheckpoint"]
    result = p.plan(job(st), obs(state=p.RayJobState.STOPPED), NOW)
    assert [e.reason for e in result.events] == ["Resubmitted"]
    assert result.events[0].message == f"attempt 2 ({sid(2)}) submitted, {says}"
