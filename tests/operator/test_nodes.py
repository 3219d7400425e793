"""Pure readers: Node + Pod bodies -> NodeHealth, RayCluster body -> ClusterState; and the api name helpers."""

from __future__ import annotations

import datetime as dt

import pytest

from daedalus_operator import api
from daedalus_operator.api import Reason
from daedalus_operator.nodes import format_time, node_draining, node_health, node_schedulable, read_cluster

T0 = dt.datetime(2026, 1, 1, 0, 0, 0, tzinfo=dt.timezone.utc)


def node(name: str, health: str | None = "Schedulable", ready: str = "True", cordoned: bool = False) -> dict:
    labels = {api.HYPERPOD_HEALTH_LABEL: health} if health else {}
    return {"metadata": {"name": name, "labels": labels}, "spec": {"unschedulable": cordoned} if cordoned else {},
            "status": {"conditions": [{"type": "Ready", "status": ready}]}}


def pod(name: str, node_name: str | None, role: str = "worker", phase: str = "Running", ready: bool = True,
        created: dt.datetime = T0, deleting: bool = False, terminated: str | None = None) -> dict:
    meta = {"name": name, "labels": {api.JOB_LABEL: "j", api.RAY_NODE_TYPE_LABEL: role},
            "creationTimestamp": format_time(created)}
    if deleting:
        meta["deletionTimestamp"] = format_time(created)
    status = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if terminated:
        status["containerStatuses"] = [{"name": "ray-worker", "state": {"terminated": {"reason": terminated}}}]
    return {"metadata": meta, "spec": {"nodeName": node_name} if node_name else {}, "status": status}


NODES = {n["metadata"]["name"]: n for n in [node("a"), node("b"), node("c")]}
SINCE = T0 + dt.timedelta(seconds=60)


def test_healthy() -> None:
    h = node_health([pod("h", "a", "head"), pod("w1", "b")], NODES, hyperpod=True, since=SINCE, expected_pods=2)
    assert h.first_issue() is None and (h.pods, h.ready_pods) == (2, 2) and h.bad_pods == ()


@pytest.mark.parametrize("label,reason", [("UnschedulablePendingReplacement", Reason.NODE_REPLACEMENT),
                                          ("UnschedulablePendingReboot", Reason.NODE_REBOOT)])
def test_announced(label: str, reason: Reason) -> None:
    nodes = dict(NODES, b=node("b", label))
    h = node_health([pod("h", "a", "head"), pod("w1", "b")], nodes, hyperpod=True, since=SINCE, expected_pods=2)
    assert h.first_issue() == (reason, "b", f"node b is {label}")
    assert h.bad_pods == ("w1",) and not h.head_lost


def test_announced_ignored_without_hyperpod() -> None:
    nodes = dict(NODES, b=node("b", "UnschedulablePendingReplacement"))
    h = node_health([pod("h", "a", "head"), pod("w1", "b")], nodes, hyperpod=False, since=SINCE, expected_pods=2)
    assert h.first_issue() is None and h.bad_pods == ()


def test_plain_unschedulable_label_is_not_a_trigger_but_pods_there_are_bad() -> None:
    nodes = dict(NODES, b=node("b", "Unschedulable"))
    h = node_health([pod("h", "a", "head"), pod("w1", "b")], nodes, hyperpod=True, since=SINCE, expected_pods=2)
    assert h.first_issue() is None and h.bad_pods == ("w1",)


def tainted(name: str, key: str, effect: str = "NoSchedule", value: str | None = None, **kw) -> dict:
    n = node(name, **kw)
    n["spec"]["taints"] = [{"key": "nvidia.com/gpu", "effect": "NoSchedule"},
                           {"key": key, "effect": effect, **({"value": value} if value is not None else {})}]
    return n


def deleted(name: str) -> dict:
    n = node(name)
    n["metadata"]["deletionTimestamp"] = format_time(T0)
    return n


@pytest.mark.parametrize("body,why", [
    (node("b", cordoned=True), "is cordoned"),
    (tainted("b", "karpenter.sh/disrupted"), "is tainted karpenter.sh/disrupted:NoSchedule (to be removed)"),
    (tainted("b", "karpenter.sh/disruption"), "is tainted karpenter.sh/disruption:NoSchedule (to be removed)"),
    (tainted("b", "ToBeDeletedByClusterAutoscaler", "NoExecute"),
     "is tainted ToBeDeletedByClusterAutoscaler:NoExecute (to be removed)"),
    (tainted("b", "eks.amazonaws.com/nodegroup", value="unschedulable"),
     "is tainted eks.amazonaws.com/nodegroup=unschedulable:NoSchedule (to be removed)"),
    (deleted("b"), "is being deleted"),
])
def test_a_node_being_emptied_is_announced_as_a_drain(body: dict, why: str) -> None:
    assert node_draining(body) == why
    assert not node_schedulable(body, hyperpod=False)
    nodes = dict(NODES, b=body)
    pods = [pod("h", "a", "head"), pod("w1", "b")]
    h = node_health(pods, nodes, hyperpod=True, drain=True, since=SINCE, expected_pods=2)
    assert h.first_issue() == (Reason.NODE_DRAIN, "b", f"node b {why}")
    assert [(i.node, i.pods) for i in h.announced] == [("b", ("w1",))]
    assert h.bad_pods == ("w1",) and not h.lost_pods and not h.lost_nodes
    # checkpointOnDrain false: training goes on there (no issue), but recovery would still move the pod
    off = node_health(pods, nodes, hyperpod=True, drain=False, since=SINCE, expected_pods=2)
    assert off.first_issue() is None and off.bad_pods == ("w1",)


def test_what_is_not_a_drain() -> None:
    # the scheduler's soft hint, a taint of another key, and a node without pods of the job
    assert node_draining(tainted("b", "DeletionCandidateOfClusterAutoscaler", "PreferNoSchedule")) is None
    assert node_draining(tainted("b", "nvidia.com/gpu")) is None and node_draining(node("b")) is None
    # the EKS node group key with another value is a user's taint, not an update's
    assert node_draining(tainted("b", "eks.amazonaws.com/nodegroup", value="gpu")) is None
    h = node_health([pod("h", "a", "head"), pod("w1", "b")], dict(NODES, c=node("c", cordoned=True)), hyperpod=True,
                    drain=True, since=SINCE, expected_pods=2)
    assert h.first_issue() is None and h.bad_pods == ()


def test_drain_gives_way_to_hyperpod_and_to_a_lost_node_and_ends_once_the_pods_go() -> None:
    hp = node("b", "UnschedulablePendingReboot", cordoned=True)
    h = node_health([pod("h", "a", "head"), pod("w1", "b")], dict(NODES, b=hp), hyperpod=True, drain=True,
                    since=SINCE, expected_pods=2)
    assert [i.reason for i in h.announced] == [Reason.NODE_REBOOT]
    gone = node("b", ready="Unknown", cordoned=True)
    h = node_health([pod("h", "a", "head"), pod("w1", "b")], dict(NODES, b=gone), hyperpod=True, drain=True,
                    since=SINCE, expected_pods=2)
    assert h.announced == () and [i.reason for i in h.lost_nodes] == [Reason.NODE_LOST]
    # the operator deleted the pods there (recovery): nothing left to announce, the pod is lost as being deleted
    h = node_health([pod("h", "a", "head"), pod("w1", "b", deleting=True)], dict(NODES, b=node("b", cordoned=True)),
                    hyperpod=True, drain=True, since=SINCE, expected_pods=2)
    assert h.announced == () and h.bad_pods == () and [i.reason for i in h.lost_pods] == ["PodDeleting", "PodMissing"]


def test_node_not_ready_and_gone() -> None:
    nodes = {"a": NODES["a"], "b": node("b", ready="Unknown")}
    h = node_health([pod("h", "a", "head"), pod("w1", "b"), pod("w2", "zz")], nodes, hyperpod=True, since=SINCE,
                    expected_pods=3)
    assert [(i.node, i.reason) for i in h.lost_nodes] == [("b", Reason.NODE_LOST), ("zz", Reason.NODE_LOST)]
    assert h.first_issue()[0] == Reason.NODE_LOST and "Ready=Unknown" in h.first_issue()[2]
    assert h.bad_pods == ("w1", "w2")


def test_worker_replaced_missing_failed_deleting() -> None:
    pods = [pod("h", "a", "head"), pod("w-new", "c", created=SINCE + dt.timedelta(seconds=1)),
            pod("w-failed", "b", phase="Failed", ready=False, terminated="OOMKilled"), pod("w-del", "b", deleting=True)]
    h = node_health(pods, NODES, hyperpod=True, since=SINCE, expected_pods=4)  # head + 3 workers
    reasons = sorted((i.pod, i.reason) for i in h.lost_pods)
    assert reasons == [("", "PodMissing"), ("w-del", "PodDeleting"), ("w-failed", "PodFailed"),
                       ("w-new", "PodReplaced")]
    assert "OOMKilled" in next(i.message for i in h.lost_pods if i.pod == "w-failed")
    assert h.first_issue()[0] == Reason.WORKER_LOST
    assert h.bad_pods == ("w-failed",)  # w-del is already going away
    assert not h.head_lost


def test_head_missing_or_replaced_is_head_lost() -> None:
    h = node_health([pod("w1", "b")], NODES, hyperpod=True, since=SINCE, expected_pods=2)
    assert h.head_lost and h.first_issue()[0] == Reason.HEAD_LOST
    h = node_health([pod("h2", "a", "head", created=SINCE + dt.timedelta(seconds=5)), pod("w1", "b")], NODES,
                    hyperpod=True, since=SINCE, expected_pods=2)
    assert h.head_lost


def test_head_created_is_the_newest_live_head_even_without_an_attempt() -> None:
    """Recovering plans with ``since=None``; the head's creation time still tells a new Ray cluster from the old."""
    new = SINCE + dt.timedelta(seconds=5)
    h = node_health([pod("h1", "a", "head", deleting=True, created=new + dt.timedelta(seconds=9)),
                     pod("h2", "a", "head", created=new), pod("w1", "b", created=new + dt.timedelta(seconds=30))],
                    NODES, hyperpod=True, since=None)
    assert h.head_created == new
    assert node_health([pod("w1", "b")], NODES, hyperpod=True).head_created is None
    body = {"metadata": {"name": "c", "namespace": "n", "creationTimestamp": format_time(new)}}
    assert read_cluster(body).created == new


def test_a_pod_not_ready_on_a_ready_node_gets_a_grace_from_its_ready_transition() -> None:
    """PodNotReady on a Ready node carries the Ready condition's lastTransitionTime; within_grace drops it until it is
    older than the grace (seconds) and says when the first grace ends. On a NotReady or gone node: no grace."""
    flipped = SINCE + dt.timedelta(seconds=100)
    blinking = pod("h", "a", "head", ready=False)
    blinking["status"]["conditions"][0]["lastTransitionTime"] = format_time(flipped)
    h = node_health([blinking, pod("w1", "b")], NODES, hyperpod=True, since=SINCE, expected_pods=2)
    [issue] = h.lost_pods
    assert (issue.reason, issue.not_ready_since) == ("PodNotReady", flipped) and h.head_lost and h.only_not_ready
    assert "not Ready since" in issue.message and h.bad_pods == ()
    graced, left = h.within_grace(flipped + dt.timedelta(seconds=5), 60.0)
    assert graced.first_issue() is None and left == 55.0 and not graced.head_lost
    assert graced.ready_pods == h.ready_pods  # still counted as not Ready (no new submission onto it)
    for now, grace in ((flipped + dt.timedelta(seconds=61), 60.0), (flipped, 0.0)):
        after, left = h.within_grace(now, grace)
        assert after is h and left is None and after.first_issue()[0] == Reason.HEAD_LOST
    # the same pod on a NotReady node, on a node that is gone, or without a transition time: lost at once
    for nodes, node_name in (({**NODES, "a": node("a", ready="False")}, "a"), (NODES, "zz")):
        on_bad = dict(blinking, spec={"nodeName": node_name})
        h = node_health([on_bad, pod("w1", "b")], nodes, hyperpod=True, since=SINCE, expected_pods=2)
        issue = next(i for i in h.lost_pods)
        assert issue.not_ready_since is None and not h.only_not_ready
        assert h.within_grace(flipped + dt.timedelta(seconds=5), 60.0)[0].head_lost
    h = node_health([pod("h", "a", "head", ready=False), pod("w1", "b")], NODES, hyperpod=True, since=SINCE,
                    expected_pods=2)
    assert h.lost_pods[0].not_ready_since is None and h.within_grace(flipped, 60.0)[0].head_lost
    # a failed pod next to a blinking one: the failed one is lost at once and no checkpoint is asked for
    failed = pod("w1", "b", phase="Failed", ready=False)
    h = node_health([blinking, failed], NODES, hyperpod=True, since=SINCE, expected_pods=2)
    graced, left = h.within_grace(flipped + dt.timedelta(seconds=5), 60.0)
    assert [i.pod for i in graced.lost_pods] == ["w1"] and left == 55.0 and not h.only_not_ready


def test_containers_that_cannot_start_are_quoted_with_the_kubelet_s_reason() -> None:
    """Containers waiting for another reason than their creation are listed with the kubelet's reason (status shapes
    as the kubelet writes them): a root image under runAsNonRoot (with its message), an image that cannot be pulled in
    a worker's init container, a crash loop (how the container last ended). Creating and initialising containers,
    failed and deleted pods are not listed."""
    image = "registry.example/daedalus-trainer:0.1.O"

    def waiting(p: dict, key: str, container: str, reason: str, message: str | None = None, **extra) -> dict:
        state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        p["status"].setdefault(key, []).append({"name": container, "image": image, "ready": False,
                                                "restartCount": 0, "state": state, **extra})
        return p

    root = "container has runAsNonRoot and image will run as root (pod: \"j-ray-head-x_ml(0b1c)\", container: ray-head)"
    head = waiting(pod("j-ray-head-x", "a", "head", phase="Pending", ready=False), "containerStatuses", "ray-head",
                   "CreateContainerConfigError", root)
    worker = pod("j-ray-p5-worker-y", "b", phase="Pending", ready=False)
    waiting(worker, "initContainerStatuses", "wait-gcs-ready", "ImagePullBackOff", f'Back-off pulling image "{image}"')
    waiting(worker, "containerStatuses", "ray-worker", "PodInitializing")
    crashing = waiting(pod("j-ray-p5-worker-z", "c", ready=False), "containerStatuses", "ray-worker",
                       "CrashLoopBackOff", "back-off 40s restarting failed container=ray-worker pod=j-ray-p5-worker-z",
                       lastState={"terminated": {"reason": "OOMKilled", "exitCode": 137}})
    creating = waiting(pod("j-ray-p5-worker-w", "c", phase="Pending", ready=False), "containerStatuses",
                       "ray-worker", "ContainerCreating")
    failed = waiting(pod("j-ray-p5-worker-f", "c", phase="Failed", ready=False), "containerStatuses", "ray-worker",
                     "ErrImagePull", "x")
    gone = waiting(pod("j-ray-p5-worker-g", "c", deleting=True), "containerStatuses", "ray-worker", "ErrImagePull")
    bare = waiting(pod("j-ray-p5-worker-v", "c", phase="Pending", ready=False), "containerStatuses", "ray-worker",
                   "InvalidImageName")
    h = node_health([head, worker, crashing, creating, failed, gone, bare], NODES, hyperpod=True)
    pull = f'pod j-ray-p5-worker-y: init container wait-gcs-ready: ImagePullBackOff: cannot pull image "{image}"'
    assert h.not_starting == (
        f"pod j-ray-head-x: container ray-head: CreateContainerConfigError: {root}",
        "pod j-ray-p5-worker-v: container ray-worker: InvalidImageName",
        pull,
        "pod j-ray-p5-worker-z: container ray-worker: CrashLoopBackOff: last ended OOMKilled, exit code 137",
    )
    # the words stay the same while the cause does: a pull between two back-offs, a longer back-off
    worker["status"]["initContainerStatuses"][0]["state"] = {"waiting": {
        "reason": "ErrImagePull", "message": f'rpc error: code = NotFound desc = failed to pull and unpack image "{image}"'}}
    crashing["status"]["containerStatuses"][0]["state"]["waiting"]["message"] = "back-off 5m0s restarting failed"
    assert node_health([head, worker, crashing, creating, failed, gone, bare], NODES, hyperpod=True).not_starting \
        == h.not_starting
    long = waiting(pod("p", "a", phase="Pending", ready=False), "containerStatuses", "c", "RunContainerError", "m" * 999)
    assert node_health([long], NODES, hyperpod=True).not_starting == (
        f"pod p: container c: RunContainerError: {'m' * 300}",)
    assert node_health([pod("h", "a", "head"), creating], NODES, hyperpod=True).not_starting == ()


def test_no_attempt_no_loss_checks() -> None:
    h = node_health([pod("h", "a", "head", phase="Pending", ready=False)], NODES, hyperpod=True, since=None,
                    expected_pods=2)
    assert h.lost_pods == () and (h.pods, h.ready_pods) == (1, 0)


def test_node_schedulable() -> None:
    assert node_schedulable(node("a"), hyperpod=True)
    assert node_schedulable(node("a", None), hyperpod=True)  # not a HyperPod node
    assert not node_schedulable(node("a", "Unschedulable"), hyperpod=True)
    assert node_schedulable(node("a", "Unschedulable"), hyperpod=False)
    assert not node_schedulable(node("a", ready="False"), hyperpod=False)
    assert not node_schedulable(node("a", cordoned=True), hyperpod=False)


def test_read_cluster() -> None:
    assert not read_cluster(None).exists
    body = {"metadata": {"name": "j-ray", "namespace": "ml"},
            "status": {"state": "ready", "head": {"serviceIP": "10.1.2.3", "podIP": "10.9.9.9"},
                       "endpoints": {"dashboard": "18265", "trainer-metrics": "19400", "client": "10001"}}}
    c = read_cluster(body)
    assert (c.exists, c.ready, c.head_host) == (True, True, "10.1.2.3")
    assert c.dashboard_url == "http://10.1.2.3:18265" and c.control_url == "http://10.1.2.3:19400"
    cond_only = {"metadata": {"name": "j-ray", "namespace": "ml"}, "status": {"conditions": [
        {"type": "HeadPodReady", "status": "True"}, {"type": "RayClusterProvisioned", "status": "True"}]}}
    c = read_cluster(cond_only, control_port=9555)
    assert c.ready and c.head_host == "j-ray-head-svc.ml.svc" and c.control_port == 9555
    provisioning = {"metadata": {"name": "j-ray", "namespace": "ml"}, "status": {"conditions": [
        {"type": "HeadPodReady", "status": "False", "message": "pending"}]}}
    c = read_cluster(provisioning)
    assert c.exists and not c.ready and "HeadPodReady: pending" in c.message and c.reported
    # as created, before any KubeRay reconciled it (or with none running): no status at all
    unreported = read_cluster({"metadata": {"name": "j-ray", "namespace": "ml"}, "spec": {}})
    assert unreported.exists and not unreported.ready and not unreported.reported
    deleting = dict(body, metadata=dict(body["metadata"], deletionTimestamp="2026-01-01T00:00:00Z"))
    assert read_cluster(deleting).deleting and not read_cluster(deleting).ready
    # What KubeRay publishes after the head pod is lost: `state` stays "ready" (until suspend) and the service IP
    # stays; only HeadPodReady turns False. The head does not answer: not ready (a Submit there would be lost).
    head_lost = {"metadata": {"name": "j-ray", "namespace": "ml"}, "status": {
        "state": "ready", "head": {"serviceIP": "10.1.2.3", "serviceName": "j-ray-head-svc"},
        "conditions": [{"type": "HeadPodReady", "status": "False", "reason": "HeadPodNotFound"},
                       {"type": "RayClusterProvisioned", "status": "True"}]}}
    c = read_cluster(head_lost)
    assert c.exists and not c.ready and c.head_host == "10.1.2.3" and "HeadPodReady: HeadPodNotFound" in c.message


def test_a_pod_kuberay_could_not_create_is_quoted_from_replica_failure() -> None:
    """KubeRay's ReplicaFailure condition is True when creating a pod failed (here Pod Security admission refusing
    a baseline job's head in a restricted namespace, as KubeRay writes it): no pod exists, so no kubelet says why,
    and the message must come from the RayCluster. A False ReplicaFailure is not a problem; True conditions are not
    quoted otherwise."""
    refused = ('failed to create head Pod: pods "j-ray-head-x2" is forbidden: violates PodSecurity '
               '"restricted:latest": allowPrivilegeEscalation != false (container "ray-head" must set '
               'securityContext.allowPrivilegeEscalation=false)')
    body = {"metadata": {"name": "j-ray", "namespace": "ml"}, "status": {"conditions": [
        {"type": "RayClusterProvisioned", "status": "False", "reason": "RayClusterPodsProvisioning",
         "message": "RayCluster Pods are being provisioned for first time"},
        {"type": "HeadPodReady", "status": "False", "reason": "HeadPodNotFound", "message": "Head Pod not found"},
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreateHeadPod", "message": refused}]}}
    c = read_cluster(body)
    assert not c.ready and c.message == (
        "RayClusterProvisioned: RayCluster Pods are being provisioned for first time; HeadPodReady: Head Pod not "
        f"found; ReplicaFailure: {refused}")
    body["status"]["conditions"][2]["status"] = "False"
    assert "ReplicaFailure" not in read_cluster(body).message
    body["status"]["conditions"][0]["status"] = "True"
    assert read_cluster(body).message == "HeadPodReady: Head Pod not found"


def test_read_cluster_counts_the_pods_its_spec_asks_for() -> None:
    """head + replicas x numOfHosts per worker group (KubeRay's CRD defaults: replicas 0, numOfHosts 1); a suspended
    group asks for none."""
    body = {"metadata": {"name": "j-ray", "namespace": "ml"}, "spec": {"workerGroupSpecs": [
        {"groupName": "gpu", "replicas": 3}, {"groupName": "tpu", "replicas": 2, "numOfHosts": 4},
        {"groupName": "off", "replicas": 5, "suspend": True}, {"groupName": "none"}]}}
    assert read_cluster(body).expected_pods == 1 + 3 + 8
    assert read_cluster({"metadata": {"name": "j-ray"}}).expected_pods == 1
    assert read_cluster(None).expected_pods is None


def test_names_respect_limits() -> None:
    long = "a" * 63
    assert len(api.raycluster_name(long)) == 53 and api.is_dns_label(api.raycluster_name(long))
    assert len(api.rayservice_name(long)) == 36 and api.is_dns_label(api.rayservice_name(long))
    for fn in (api.config_map_name, api.secret_name, api.network_policy_name):
        assert len(fn(long)) == 63 and api.is_dns_label(fn(long))
    assert api.raycluster_name("local-tiny") == "local-tiny-ray"
    assert api.raycluster_name(long) != api.raycluster_name("a" * 62 + "b")
    # deterministic across operator restarts (another process must find the same RayCluster): the suffix is the
    # name's SHA-256, computed here independently, not a per-process salted hash()
    import hashlib

    assert api.raycluster_name(long) == "a" * 44 + "-" + hashlib.sha256(("a" * 63 + "-ray").encode()).hexdigest()[:8]
    x = "x-" * 40
    assert api.fit_name(x, 20) == "x-x-x-x-x-x" + "-" + hashlib.sha256(x.encode()).hexdigest()[:8]
    assert "--" not in api.fit_name(x, 20)
    with pytest.raises(ValueError):
        api.fit_name("abc", 5)


def test_submission_id() -> None:
    assert api.submission_id("job", "0f1e2d3c-4b5a-6978", 2) == "job-0f1e2d3c-a2"
    with pytest.raises(ValueError):
        api.submission_id("job", "0f1e", 0)
    with pytest.raises(ValueError):
        api.submission_id("job", "", 1)


def _not_ready(p: dict, flipped: dt.datetime | None, started: dt.datetime | None) -> dict:
    """``p`` not Ready since ``flipped`` (its Ready condition's lastTransitionTime), its container running since
    ``started``."""
    cond = p["status"]["conditions"][0]
    if flipped is not None:
        cond["lastTransitionTime"] = format_time(flipped)
    if started is not None:
        p["status"]["containerStatuses"] = [{"name": "ray-worker", "state": {"running": {
            "startedAt": format_time(started)}}}]
    return p


def test_not_ready_pods_on_good_nodes_are_listed_with_the_later_of_the_flip_and_the_container_start() -> None:
    """``not_ready`` is what the planner times while recovering (no attempt: ``since`` None): Running pods, not Ready,
    on a Ready node that may run them. A container that started after the Ready condition flipped (an image pulled
    for minutes, a restart) counts from its start; Pending pods, pods on bad nodes (``bad_pods`` already) and pods
    without any time are not listed."""
    t_flip, t_start = T0, T0 + dt.timedelta(seconds=300)
    nodes = dict(NODES, c=node("c", ready="False"), d=node("d", cordoned=True))
    pods = [pod("h", "a", "head"),
            _not_ready(pod("w-flip", "a", ready=False), t_flip, None),
            _not_ready(pod("w-started", "b", ready=False), t_flip, t_start),
            _not_ready(pod("w-pending", "b", phase="Pending", ready=False), t_flip, None),
            _not_ready(pod("w-bad-node", "c", ready=False), t_flip, None),
            _not_ready(pod("w-cordoned", "d", ready=False), t_flip, None),
            pod("w-no-time", "b", ready=False)]
    h = node_health(pods, nodes, hyperpod=True, since=None, expected_pods=8)
    assert h.not_ready == (("w-flip", t_flip), ("w-started", t_start))
    assert h.bad_pods == ("w-bad-node", "w-cordoned") and h.lost_pods == ()
    now = t_start + dt.timedelta(seconds=30)
    assert h.stale_not_ready(now, 60.0) == (("w-flip",), 30.0)  # w-started: 30 s of its 60 left
    assert h.stale_not_ready(now, 0.0) == ((), None)  # 0: never (a recreated pod is not Ready at once)


@pytest.mark.parametrize("value", ["2026-11-30T08:00:00Z", "2026-11-30t08:00:00z", "2026-11-30T08:00:00z",
                                   "2026-11-30t08:00:00.5z", "2026-11-30T09:30:00+01:30"])
def test_parse_time_reads_every_rfc_3339_form_the_api_server_stores(value) -> None:
    """RFC 3339 allows a lower-case ``t`` and ``z``, and the API server's ``format: date-time`` check stores them
    (kube-apiserver 1.20, tests/cluster): a status time edited to one must not fail every reconcile."""
    from daedalus_operator.nodes import parse_time

    assert parse_time(value).replace(microsecond=0) == dt.datetime(2026, 11, 30, 8, 0, tzinfo=dt.timezone.utc)
