"""compute_status: conditions in metav1.Condition form, lastTransitionTime only on flips, observedGeneration, trainer
figures, and no patch when nothing changed. The result must validate against the generated CRD's status schema."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import jsonschema
import pytest
import yaml

from daedalus_operator import plan as p
from daedalus_operator.nodes import format_time
from daedalus_operator.status import CONDITION_ORDER, compute_status, merge_patch

from test_plan import ANNOUNCED, GONE, NOW, READY, RECOVERING, ago, job, obs, running_status, sid, trainer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def status_schema() -> dict:
    crd = yaml.safe_load((ROOT / "crds" / "rltrainingjob.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]


def cond(status: dict, ctype: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == ctype)


def step(j: p.JobView, o: p.Observed, now: dt.datetime, old: dict | None = None) -> dict:
    result = p.plan(j, o, now)
    return compute_status(old if old is not None else j.status.model_dump(by_alias=True, mode="json",
                                                                         exclude_none=True),
                          o, result, None, job=j, now=now)


def test_running_conditions_and_figures(status_schema: dict) -> None:
    j = job(running_status())
    o = obs(t=trainer(13, 10, success_ratio=0.75, reward_mean=0.5))
    st = step(j, o, NOW)
    jsonschema.Draft4Validator(status_schema).validate(st)
    assert [c["type"] for c in st["conditions"]] == [c.value for c in CONDITION_ORDER]
    assert cond(st, "Ready")["status"] == "True" and cond(st, "Ready")["reason"] == "Running"
    assert cond(st, "Reconciling")["status"] == "False"
    assert cond(st, "Stalled")["status"] == "False"
    assert all(c["observedGeneration"] == 1 and c["lastTransitionTime"] == format_time(NOW) for c in st["conditions"])
    assert st["observedGeneration"] == 1
    # totalSteps is the spec's algorithm.steps (the example job's)
    assert (st["currentStep"], st["totalSteps"]) == (13, j.spec.algorithm.steps)
    assert st["metrics"]["successRate"] == 0.75 and st["metrics"]["rewardMean"] == 0.5
    assert st["latestCheckpoint"]["step"] == 10
    assert st["dashboardUrl"] == "http://10.0.0.5:8265"
    # 13 steps in the 300 s since the attempt started
    assert st["metrics"]["stepsPerHour"] == pytest.approx(13 / (300 / 3600), rel=1e-3)


def test_a_submission_the_ray_head_has_not_reported_is_not_ready() -> None:
    """Decided and recorded (phase Running, a submission id) but unconfirmed: the dashboard did not answer, so Ray may
    never have received the job. Ready is False and Reconciling True (reason Submitted) until the head reports it;
    then Running."""
    j = job(running_status(submissionConfirmed=False, currentStep=0))
    unreachable = obs(READY, p.RayJobState.UNREACHABLE)
    st = step(j, unreachable, NOW)
    assert st["phase"] == "Running" and st["submissionConfirmed"] is False
    ready, reconciling = cond(st, "Ready"), cond(st, "Reconciling")
    assert (ready["status"], ready["reason"]) == ("False", "Submitted")
    assert ready["message"] == (f"attempt 1 submitted as {sid(1)}; waiting for the Ray head to report it")
    assert (reconciling["status"], reconciling["reason"]) == ("True", "Submitted")
    confirmed = step(j, obs(READY, p.RayJobState.RUNNING, t=trainer(0)), NOW, old=st)
    assert confirmed["submissionConfirmed"] is True
    assert (cond(confirmed, "Ready")["status"], cond(confirmed, "Ready")["reason"]) == ("True", "Running")
    assert cond(confirmed, "Reconciling")["status"] == "False"


@pytest.mark.parametrize("reported,age,asks", [(False, 90, True), (False, 30, False), (True, 600, False)])
def test_a_raycluster_kuberay_never_answers_makes_the_conditions_ask_for_kuberay(reported, age, asks) -> None:
    """No KubeRay operator running: the RayCluster the operator created never gets a status, and the job waited
    "for the RayCluster to become ready" with no hint why. After 60 s without one the conditions ask."""
    from daedalus_operator.nodes import ClusterState

    cluster = ClusterState(exists=True, ready=False, created=NOW - dt.timedelta(seconds=age), reported=reported)
    j = job({"phase": "Provisioning", "rayClusterName": "local-tiny-ray"})
    st = step(j, obs(cluster, p.RayJobState.UNREACHABLE), NOW)
    assert st["phase"] == "Provisioning"
    hint = (f"RayCluster local-tiny-ray (created {format_time(NOW - dt.timedelta(seconds=age))}) has had no status "
            "for over 60 s: is the KubeRay operator running? (docs/deploy.md section 2)")
    assert (hint in cond(st, "Ready")["message"]) is asks
    assert (hint in cond(st, "Reconciling")["message"]) is asks
    if asks:  # the same words a minute later: no status patch on every poll while the job waits
        later = step(j, obs(cluster, p.RayJobState.UNREACHABLE), NOW + dt.timedelta(seconds=60), old=st)
        assert merge_patch(st, later) is None


def test_no_patch_when_nothing_changed() -> None:
    j = job(running_status())
    o = obs(t=trainer(13, 10))
    first = step(j, o, NOW)
    j2 = job(first)
    second = step(j2, o, NOW + dt.timedelta(seconds=1), old=first)
    # stepsPerHour moves with the clock; everything else is identical
    assert merge_patch(first, second) == {"metrics": {"stepsPerHour": second["metrics"]["stepsPerHour"]}}
    o_idle = obs(t=trainer(13, 10), state=p.RayJobState.RUNNING)
    third = compute_status(first, o_idle, p.plan(j2, o_idle, NOW), None, job=j2, now=NOW)
    assert merge_patch(first, third) is None


def test_last_transition_time_changes_only_on_flip() -> None:
    j = job(running_status())
    t0 = NOW
    st0 = step(j, obs(t=trainer(12, 10)), t0)
    # an announced node: Ready flips to False, Reconciling to True
    j1 = job(st0, resilience__hyperPod=True)
    t1 = t0 + dt.timedelta(seconds=30)
    st1 = step(j1, obs(t=trainer(12, 10), health=ANNOUNCED), t1, old=st0)
    assert st1["phase"] == "Checkpointing"
    assert cond(st1, "Ready")["status"] == "False" and cond(st1, "Ready")["lastTransitionTime"] == format_time(t1)
    assert cond(st1, "Reconciling")["status"] == "True" and cond(st1, "Reconciling")["reason"] == "Checkpointing"
    assert "NodeReplacement" in cond(st1, "Reconciling")["message"]
    # unchanged statuses keep their time
    assert cond(st1, "Stalled")["lastTransitionTime"] == format_time(t0)
    assert cond(st1, "Succeeded")["lastTransitionTime"] == format_time(t0)
    # a later message change without a flip keeps the time
    t2 = t1 + dt.timedelta(seconds=30)
    st2 = step(job(st1, resilience__hyperPod=True), obs(t=trainer(13, 13), health=ANNOUNCED), t2, old=st1)
    assert st2["phase"] == "Recovering"
    assert cond(st2, "Reconciling")["reason"] == "Recovering"
    assert cond(st2, "Reconciling")["lastTransitionTime"] == format_time(t1)


def test_failed_is_stalled_with_reason(status_schema: dict) -> None:
    j = job(environment__size=8)
    st = step(j, obs(), NOW)
    jsonschema.Draft4Validator(status_schema).validate(st)
    assert st["phase"] == "Failed"
    for ctype in ("Stalled", "Failed"):
        c = cond(st, ctype)
        assert (c["status"], c["reason"]) == ("True", "InvalidSpec")
        assert "spec.environment.size" in c["message"]
    assert cond(st, "Ready")["status"] == "False"
    assert "rayClusterName" not in st and "submissionId" not in st


def test_error_sets_reconciling_api_error() -> None:
    j = job(running_status())
    o = obs(t=trainer(12, 10))
    st = compute_status(None, o, p.plan(j, o, NOW), "POST /api/v1/namespaces/ml/configmaps: 500", job=j, now=NOW)
    c = cond(st, "Reconciling")
    assert (c["status"], c["reason"]) == ("True", "APIError") and "500" in c["message"]


def test_succeeded_and_suspended_conditions() -> None:
    j = job(running_status())
    st = step(j, obs(state=p.RayJobState.SUCCEEDED), NOW)
    assert cond(st, "Succeeded")["status"] == "True" and cond(st, "Ready")["status"] == "True"
    assert st["completionTime"] == format_time(NOW) and st["adapterPath"].endswith("exports/adapter")
    assert "dashboardUrl" in st  # the cluster still exists in this observation
    js = job(running_status(phase="Suspended"), suspend=True)
    st = step(js, obs(GONE, p.RayJobState.UNREACHABLE), NOW)
    assert st["phase"] == "Suspended" and cond(st, "Suspended")["status"] == "True"


def test_resubmitted_attempt_is_reconciling_until_it_steps() -> None:
    j = job(running_status(attempt=2, recovery=dict(RECOVERING, resubmittedAt=ago(5), resumeStep=12)))
    st = step(j, obs(t=trainer(12, 12, attempt=2)), NOW)
    assert st["phase"] == "Running"
    assert cond(st, "Ready")["status"] == "False" and cond(st, "Reconciling")["status"] == "True"
    st2 = step(job(st), obs(t=trainer(13, 12, attempt=2)), NOW, old=st)
    assert "recovery" not in st2 and st2["lastRecovery"]["lostSteps"] == 0
    assert cond(st2, "Ready")["status"] == "True" and cond(st2, "Reconciling")["status"] == "False"
    assert st2["currentStep"] == 13 and st2["attempt"] == 2


def test_merge_patch_removes_nested_keys() -> None:
    old = {"a": 1, "recovery": {"reason": "X", "notBefore": "t"}, "conditions": [1]}
    new = {"a": 1, "recovery": {"reason": "X"}, "conditions": [2]}
    assert merge_patch(old, new) == {"recovery": {"notBefore": None}, "conditions": [2]}
    assert merge_patch({"recovery": {"r": 1}}, {}) == {"recovery": None}
    assert merge_patch(new, new) is None


def test_a_recovery_waiting_for_pods_the_scheduler_cannot_place_says_so() -> None:
    """After a node replacement the job's new worker pod cannot be scheduled (no Schedulable node with a free GPU):
    the job waits in Recovering for a usable cluster, and its Reconciling and Ready conditions say what the scheduler
    says, as they do while provisioning, instead of only the cause of the recovery."""
    from daedalus_operator.nodes import ClusterState, NodeHealth

    st = running_status(phase="Recovering", recovery=dict(RECOVERING))
    unscheduled = "pod local-tiny-ray-cpu-worker-x: Unschedulable: 0/3 nodes are available: 3 Insufficient cpu"
    o = obs(ClusterState(exists=True, ready=False, head_host="10.0.0.5",
                         message="RayClusterProvisioned: waiting for worker pods"),
            p.RayJobState.STOPPED, health=NodeHealth(pods=1, ready_pods=1, unscheduled=(unscheduled,)))
    new = step(job(st), o, NOW, old=st)
    assert new["phase"] == "Recovering"
    reconciling = cond(new, "Reconciling")["message"]
    assert reconciling.startswith("NodeReplacement: ") and unscheduled in reconciling
    assert "RayCluster: RayClusterProvisioned: waiting for worker pods" in reconciling
    assert unscheduled in cond(new, "Ready")["message"]


def test_a_job_whose_containers_cannot_start_says_what_the_kubelet_says() -> None:
    """Provisioning with the head's container refused by the kubelet (a root image under the restricted level): the
    Reconciling and Ready conditions quote the first two containers that cannot start, after KubeRay's message and
    the scheduler's; without such containers the message is KubeRay's alone."""
    from daedalus_operator.nodes import ClusterState, NodeHealth

    j = job({"phase": "Provisioning", "rayClusterName": "local-tiny-ray"})
    cluster = ClusterState(exists=True, ready=False, created=NOW - dt.timedelta(seconds=30),
                           message="HeadPodNotReady: head pod not ready")
    refused = ("pod local-tiny-ray-head-x: container ray-head: CreateContainerConfigError: container has "
               "runAsNonRoot and image will run as root")
    pulls = [f"pod local-tiny-ray-cpu-worker-{i}: init container wait-gcs-ready: ImagePullBackOff: Back-off pulling "
             f"image" for i in "abc"]
    health = NodeHealth(pods=4, ready_pods=0, not_starting=(refused, *pulls))
    new = step(j, obs(cluster, p.RayJobState.UNREACHABLE, health=health), NOW)
    assert new["phase"] == "Provisioning"
    for ctype in ("Reconciling", "Ready"):
        message = cond(new, ctype)["message"]
        assert message.endswith(f"RayCluster: HeadPodNotReady: head pod not ready; {refused}; {pulls[0]}"), message
        assert pulls[1] not in message
    plain = step(j, obs(cluster, p.RayJobState.UNREACHABLE, health=NodeHealth(pods=4, ready_pods=0)), NOW)
    assert cond(plain, "Reconciling")["message"].endswith("RayCluster: HeadPodNotReady: head pod not ready")
