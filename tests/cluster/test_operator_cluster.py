"""The Daedalus operator against a real kube-apiserver 1.20 + etcd + kube-controller-manager, installed by the Helm
chart and running **with the chart's ServiceAccount token** (``cluster_support.ChartOperator``), so every call it
makes is judged by the real RBAC authorizer against the chart's rules.

What kmock cannot show and these tests do: the examples through the real CRD (defaulting, validation); every status
field surviving structural-schema pruning (a pruned field would be rewritten on every poll); a status write with a
stale resourceVersion refused by the server and retried; owner-reference garbage collection by the real
kube-controller-manager; the finalizer released when the Ray dashboard does not answer; one full job with a HyperPod
node replacement driven by the fake KubeRay and a real local Ray head (slow), with what ``kubectl get rltj`` and
``kubectl describe rltj`` print on the way (the printer columns and the events; ``DAEDALUS_KUBECTL_DOC=<file>`` writes
the captured output there, as in docs/operator-kubectl.md).
"""

from __future__ import annotations

import enum
import itertools
import json
import logging
import os
import re
import time
import types
import typing
from pathlib import Path

import kopf
import pytest
from cluster_support import (
    ChartOperator,
    ClusterKubeRay,
    Jobs,
    KubeREST,
    example,
    find_kubectl,
    free_port,
    gc_discovery_wait,
    kubectl,
    missing_paths,
    status_writes,
    steady_status,
    wait_for,
)
from interference import InterferingIndex
from daedalus_trainer.config import RLTrainingJobStatus
from pydantic import BaseModel

from daedalus_operator import api, kube
from daedalus_operator.handlers import Runtime, reconcile
from daedalus_operator.metrics import OperatorMetrics
from daedalus_operator.settings import OperatorSettings


TINY = "local-tiny.yaml"
HYPERPOD = "hyperpod-qwen3vl-8b.yaml"
#: The four children of a job: (group/version/plural, name helper).
CHILDREN = [("v1/configmaps", api.config_map_name), ("v1/secrets", api.secret_name),
            ("networking.k8s.io/v1/networkpolicies", api.network_policy_name),
            ("ray.io/v1/rayclusters", api.raycluster_name)]


@pytest.fixture
def jobs(admin, namespace):
    j = Jobs(admin, namespace)
    yield j
    j.release_finalizers()  # no operator may be left to do it; the namespace can then be deleted


@pytest.fixture
def operator(release, tmp_path, request):
    """The operator as the chart runs it (params: `ChartOperator` keyword arguments)."""
    op = ChartOperator(release, tmp_path, **getattr(request, "param", {})).start()
    yield op
    op.stop()


@pytest.fixture
def fake_kuberay(admin, namespace, request):
    """The fake KubeRay/scheduler/kubelet against the real server; nodes ``<namespace>-a`` and ``-b`` are removed
    afterwards. Param: the dashboard port it publishes (default: a port nothing listens on)."""
    made: list[ClusterKubeRay] = []

    def start(dashboard_port: int, volume_root: Path) -> ClusterKubeRay:
        fake = ClusterKubeRay(admin, dashboard_port=dashboard_port, volume_root=volume_root).start()
        made.append(fake)
        return fake

    yield start
    for fake in made:
        fake.stop()
    for pod in admin.list("v1/pods", namespace):  # no kubelet: complete their deletion so the namespace can go
        admin.force_delete("v1/pods", namespace, pod["metadata"]["name"])
    for node in admin.list("v1/nodes"):
        if node["metadata"]["name"].startswith(namespace):
            admin.delete("v1/nodes", None, node["metadata"]["name"])


def children(admin: KubeREST, namespace: str, job: str) -> dict[str, dict | None]:
    """``plural/name`` -> the stored object (``None`` when absent) for the four children of ``job``."""
    return {f"{key.split('/')[-1]}/{fn(job)}": admin.get(key, namespace, fn(job)) for key, fn in CHILDREN}


def wait_children(admin: KubeREST, jobs: Jobs, name: str, timeout: float = 30.0) -> dict[str, dict]:
    """Wait until the four children of job ``name`` exist; on timeout the message names the missing ones and the
    job's ``Reconciling`` condition (where the operator reports a refused call, e.g. a 403)."""
    try:
        return wait_for(lambda: (lambda c: c if all(c.values()) else None)(children(admin, jobs.namespace, name)),
                        timeout=timeout, message=f"the children of {name}")
    except AssertionError as e:
        missing = [k for k, v in children(admin, jobs.namespace, name).items() if v is None]
        reconciling = jobs.conditions(name).get("Reconciling", {})
        raise AssertionError(f"{e}; missing {missing}; Reconciling: {reconciling.get('reason')}: "
                             f"{reconciling.get('message')}") from None


def owner_ref(job: dict) -> list[dict]:
    """The ownerReferences every child must carry: the job as controller, blocking its deletion."""
    return [{"apiVersion": "daedalus.dev/v1alpha1", "kind": "RLTrainingJob", "name": job["metadata"]["name"],
             "uid": job["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]


# ------------------------------------------------------------------------------------------------ the examples
def test_examples_reach_their_documented_state_with_the_charts_service_account(operator, jobs, admin, namespace,
                                                                             control_plane):
    tiny = jobs.create(example(TINY, namespace))
    hyper = jobs.create(example(HYPERPOD, namespace))
    # the real CRD defaulted what the examples leave out (structural-schema defaulting)
    assert tiny["spec"]["checkpoint"]["path"] == "/checkpoints"
    assert tiny["spec"]["cluster"]["rayVersion"] == "2.60.0"
    assert hyper["spec"]["resilience"]["checkpointTimeoutSeconds"] == 300
    for job in (tiny, hyper):
        name = job["metadata"]["name"]
        st = jobs.wait_status(name, lambda s: s.get("phase") == "Provisioning" and s.get("rayClusterName"),
                              timeout=60, message="Provisioning with a RayCluster name")
        assert st["rayClusterName"] == api.raycluster_name(name)
        assert st["totalSteps"] == job["spec"]["algorithm"]["steps"] and st["observedGeneration"] == 1
        conds = {c["type"]: c for c in st["conditions"]}
        assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "Provisioning")
        assert (conds["Reconciling"]["status"], conds["Reconciling"]["message"]) == (
            "True", "waiting for the RayCluster to become ready")
        made = wait_children(admin, jobs, name)
        for key, obj in made.items():
            assert obj["metadata"]["ownerReferences"] == owner_ref(job), key
            assert obj["metadata"]["labels"][api.JOB_LABEL] == name, key
        assert api.FINALIZER in jobs.get(name)["metadata"]["finalizers"]
        assert "Provisioning" in [e["reason"] for e in jobs.events(name)]
    # the HyperPod job: GPU/EFA workers never on HyperPod-unschedulable nodes; no GPUs here, so it waits for KubeRay
    cluster = admin.get("ray.io/v1/rayclusters", namespace, api.raycluster_name(hyper["metadata"]["name"]))
    (workers,) = cluster["spec"]["workerGroupSpecs"]
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert (limits["nvidia.com/gpu"], limits["vpc.amazonaws.com/efa"]) == (8, 32)
    terms = workers["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": api.HYPERPOD_HEALTH_LABEL, "operator": "DoesNotExist"}]},
                     {"matchExpressions": [{"key": api.HYPERPOD_HEALTH_LABEL, "operator": "In",
                                            "values": ["Schedulable"]}]}]
    # steady state: nothing is rewritten, so every status field the operator wrote came back unpruned
    steady_status(admin, jobs, [tiny["metadata"]["name"], hyper["metadata"]["name"]], seconds=6 * operator.poll,
                  plane=control_plane)
    # deletion with the operator running: the finalizer deletes the children and lets go
    admin.delete(kube.RLTJ, namespace, "local-tiny")
    wait_for(lambda: jobs.get("local-tiny") is None, timeout=30, message="local-tiny to be deleted")
    assert not any(children(admin, namespace, "local-tiny").values())
    assert jobs.status(hyper["metadata"]["name"])["phase"] == "Provisioning"  # the other job is untouched


def test_a_container_the_kubelet_cannot_start_is_quoted_in_the_job_s_conditions(operator, jobs, admin, namespace,
                                                                                 control_plane):
    """The RayCluster's head pod, made from its template as KubeRay makes it (with the restricted securityContext the
    operator built, which the real server stores), and given the status a kubelet writes for a root image under
    ``runAsNonRoot``: the Provisioning job's Reconciling and Ready conditions quote the kubelet, and say it once (no
    status rewrite on every poll)."""
    from pod_security import kuberay_pod_spec, restricted_violations

    name = jobs.create(example(TINY, namespace))["metadata"]["name"]
    rc_name = api.raycluster_name(name)
    cluster = wait_for(lambda: admin.get("ray.io/v1/rayclusters", namespace, rc_name), timeout=60,
                       message="the RayCluster")
    template = cluster["spec"]["headGroupSpec"]["template"]
    pod_name = f"{rc_name}-head-x1"
    labels = {**template["metadata"]["labels"], "ray.io/cluster": rc_name, "ray.io/node-type": "head"}
    stored = admin.create("v1/pods", namespace, {"apiVersion": "v1", "kind": "Pod",
                                                 "metadata": {"name": pod_name, "labels": labels},
                                                 "spec": kuberay_pod_spec(template["spec"], worker=False)})
    try:
        assert restricted_violations(stored["spec"]) == []
        refused = (f'container has runAsNonRoot and image will run as root (pod: "{pod_name}_{namespace}'
                   f'({stored["metadata"]["uid"]})", container: ray-head)')
        admin.patch("v1/pods", namespace, pod_name, {"status": {"phase": "Pending", "containerStatuses": [
            {"name": "ray-head", "image": template["spec"]["containers"][0]["image"], "imageID": "", "ready": False,
             "restartCount": 0, "started": False,
             "state": {"waiting": {"reason": "CreateContainerConfigError", "message": refused}}}]}}, status=True)
        quoted = f"pod {pod_name}: container ray-head: CreateContainerConfigError: {refused}"
        st = jobs.wait_status(name, lambda s: quoted in {c["type"]: c for c in s.get("conditions", [])}.get(
            "Reconciling", {}).get("message", ""), timeout=60, message="the kubelet's reason in Reconciling")
        assert st["phase"] == "Provisioning"
        assert quoted in {c["type"]: c for c in st["conditions"]}["Ready"]["message"]
        # a reconcile that planned from the body before that write may still send its own (answered 409); then quiet
        time.sleep(4 * operator.poll)
        steady_status(admin, jobs, [name], seconds=4 * operator.poll, plane=control_plane)
    finally:
        admin.force_delete("v1/pods", namespace, pod_name)


# ------------------------------------------------------------------------------------------------ status pruning
_counter = itertools.count(1)


def sample(annotation: typing.Any, name: str) -> typing.Any:
    """A valid, distinct, non-default value of a pydantic field type (RFC 3339 strings for time fields)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # config.Timestamp: a str with format date-time in the CRD
        return sample(args[0], name)
    if origin in (typing.Union, types.UnionType):
        return sample(next(a for a in args if a is not type(None)), name)
    if origin is list:
        return [sample(args[0], name)]
    if origin is typing.Literal:
        return args[-1]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return list(annotation)[-1]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return populated(annotation)
    n = next(_counter)
    if annotation is bool:
        return True
    if annotation is int:
        return n
    if annotation is float:
        return n + 0.25
    if annotation is str:
        if name.endswith(("time", "_at", "since", "before")):
            return f"2026-11-30T08:{n // 60 % 60:02d}:{n % 60:02d}Z"
        return f"{name}-{n}"
    raise TypeError(f"no sample for {name}: {annotation!r}")


def populated(model: type[BaseModel]) -> BaseModel:
    """An instance of ``model`` with every field (recursively) set to a non-default value."""
    return model(**{name: sample(field.annotation, name) for name, field in model.model_fields.items()})


def leaf_count(model: type[BaseModel]) -> int:
    """Number of scalar fields of ``model``, nested models expanded (a list of models counts one item)."""
    total = 0
    for field in model.model_fields.values():
        inner = [a for a in typing.get_args(field.annotation) or (field.annotation,) if a is not type(None)]
        inner = [typing.get_args(a)[0] if typing.get_origin(a) is list else a for a in inner]
        sub = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), None)
        total += leaf_count(sub) if sub else 1
    return total


def leaves(doc: typing.Any) -> int:
    """Number of scalar values in a JSON document."""
    if isinstance(doc, dict):
        return sum(leaves(v) for v in doc.values())
    if isinstance(doc, list):
        return sum(leaves(v) for v in doc)
    return 1


def test_every_status_field_the_operator_can_write_survives_structural_pruning(jobs, admin, namespace):
    """compute_status writes ``RLTrainingJobStatus.model_dump(by_alias=True, mode="json")``: every field of that
    model, set at once, goes through the status subresource and comes back unchanged."""
    jobs.create(example(TINY, namespace))
    status = populated(RLTrainingJobStatus).model_dump(by_alias=True, mode="json", exclude_none=True)
    assert leaves(status) == leaf_count(RLTrainingJobStatus)  # every field, nested ones included, is set
    admin.patch(kube.RLTJ, namespace, "local-tiny", {"status": status}, status=True)
    stored = jobs.status("local-tiny")
    assert missing_paths(status, stored) == []
    assert stored == status
    # the control: a field the schema does not know is pruned, silently; writing it changes nothing stored (not even
    # the resourceVersion) but the server counts the write, which is what steady_status relies on
    rv, writes = jobs.get("local-tiny")["metadata"]["resourceVersion"], status_writes(admin)
    admin.patch(kube.RLTJ, namespace, "local-tiny", {"status": {"notInTheSchema": 1}}, status=True)
    after = jobs.get("local-tiny")
    assert "notInTheSchema" not in after["status"] and after["metadata"]["resourceVersion"] == rv
    assert status_writes(admin) == writes + 1


def test_a_status_time_that_is_not_a_time_is_refused_by_the_api_server(jobs, admin, namespace):
    """The status times are ``format: date-time`` in the CRD (config.Timestamp), as metav1.Time is: a hand edit of
    the status (`kubectl edit --subresource=status`) cannot store a value the operator would fail to parse on every
    reconcile; the operator's own format is accepted, and every other form the check accepts is one the operator
    parses (lower-case ``z`` was not)."""
    from kmock_api import ApiError

    from daedalus_operator.nodes import parse_time

    jobs.create(example(TINY, namespace))
    ok = {"attemptStartTime": "2026-11-30T08:00:00Z", "recovery": {"detectedAt": "2026-11-30T08:00:01Z"}}
    admin.patch(kube.RLTJ, namespace, "local-tiny", {"status": ok}, status=True)
    assert jobs.status("local-tiny")["attemptStartTime"] == "2026-11-30T08:00:00Z"
    # what the check lets through, the operator reads: RFC 3339's lower-case t and z, fractions, offsets
    for other in ("2026-11-30t08:00:00z", "2026-11-30T08:00:00.123456789Z", "2026-11-30T09:30:00+01:30"):
        admin.patch(kube.RLTJ, namespace, "local-tiny", {"status": {"attemptStartTime": other}}, status=True)
        stored = jobs.status("local-tiny")["attemptStartTime"]
        assert parse_time(stored).replace(microsecond=0) == parse_time("2026-11-30T08:00:00Z"), stored
    admin.patch(kube.RLTJ, namespace, "local-tiny", {"status": ok}, status=True)
    for bad in ({"attemptStartTime": "yesterday"}, {"recovery": {"detectedAt": "30/11/2026 08:00"}},
                {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "now"}]}):
        with pytest.raises(ApiError) as info:
            admin.patch(kube.RLTJ, namespace, "local-tiny", {"status": bad}, status=True)
        assert info.value.status == 422 and "date-time" in str(info.value), info.value
    assert jobs.status("local-tiny")["attemptStartTime"] == "2026-11-30T08:00:00Z"


# ------------------------------------------------------------------------------------------------ 409 and retry
def test_a_status_write_with_a_stale_resource_version_is_refused_and_retried(release, jobs, admin, namespace,
                                                                           tmp_path):
    jobs.create(example(TINY, namespace))
    settings = OperatorSettings(kubeconfig=str(release.kubeconfig), operator_namespace=release.namespace,
                                config_dir=str(tmp_path / "etc"))
    rt = Runtime(settings=settings, metrics=OperatorMetrics(),
                 kube=kube.KubeAPI(kube.api_client_from_environment(str(release.kubeconfig))))
    logger = logging.getLogger("test.reconcile")
    interfering = InterferingIndex(lambda: admin.patch(kube.RLTJ, namespace, "local-tiny",
                                                       {"metadata": {"annotations": {"touched-by": "someone"}}}))
    before = jobs.get("local-tiny")["metadata"]["resourceVersion"]
    with pytest.raises(kopf.TemporaryError, match="409 Conflict"):
        reconcile(rt, namespace, "local-tiny", {"clusters_by_job": interfering}, logger)
    assert interfering.writes == 1
    after = jobs.get("local-tiny")
    assert int(after["metadata"]["resourceVersion"]) > int(before)  # only the other writer's change landed
    assert "status" not in after and not any(children(admin, namespace, "local-tiny").values())  # nothing executed
    assert 'daedalus_operator_reconciles_total{result="error"} 1.0' in _metrics(rt)
    # kopf retries a TemporaryError; here the retry is the operator's next reconcile, planned from the fresh object
    operator = ChartOperator(release, tmp_path).start()
    try:
        st = jobs.wait_phase("local-tiny", "Provisioning", timeout=60)
        assert st["observedGeneration"] == 1 and st["rayClusterName"] == api.raycluster_name("local-tiny")
        wait_children(admin, jobs, "local-tiny")
    finally:
        operator.stop()


def _metrics(rt: Runtime) -> str:
    """The runtime's Prometheus exposition text (its own registry)."""
    from prometheus_client import generate_latest

    return generate_latest(rt.metrics.registry).decode()


# ------------------------------------------------------------------------------------------------ deletion
def test_deleting_a_job_garbage_collects_its_children(control_plane, release, jobs, admin, namespace, tmp_path):
    """The operator creates the children and stops; the job is deleted and its finalizer removed by hand, so only the
    real garbage collector (kube-controller-manager) can delete the children, by their owner references."""
    operator = ChartOperator(release, tmp_path).start()
    try:
        job = jobs.create(example(TINY, namespace))
        made = wait_children(admin, jobs, "local-tiny", timeout=60)
    finally:
        operator.stop()
    for key, obj in made.items():
        assert obj["metadata"]["ownerReferences"] == owner_ref(job), key
    delay = gc_discovery_wait(control_plane)
    if delay:
        logging.getLogger(__name__).warning("waiting %.0f s for the garbage collector to discover the CRD", delay)
        time.sleep(delay)
    admin.delete(kube.RLTJ, namespace, "local-tiny")
    assert jobs.get("local-tiny")["metadata"]["deletionTimestamp"]  # held by our finalizer; no operator runs
    time.sleep(1.0)
    assert all(children(admin, namespace, "local-tiny").values())  # the owner still exists: nothing collected
    jobs.release_finalizers()
    wait_for(lambda: jobs.get("local-tiny") is None, timeout=10, message="the job to go")
    left = wait_for(lambda: (lambda c: c if not any(c.values()) else None)(children(admin, namespace, "local-tiny")),
                    timeout=60, message="garbage collection of the children")
    assert set(left) == {f"{key.split('/')[-1]}/{fn('local-tiny')}" for key, fn in CHILDREN}


@pytest.mark.parametrize("operator", [{"extra_args": ("--deletion-timeout=4",)}], indirect=True)
def test_the_finalizer_is_released_when_the_ray_dashboard_is_unreachable(operator, fake_kuberay, jobs, admin,
                                                                        namespace, caplog):
    dead = free_port()  # nothing listens there: the RayCluster's dashboard never answers
    fake = fake_kuberay(dead, operator.volumes)
    fake.add_node(f"{namespace}-a")
    jobs.create(example(TINY, namespace))
    # the cluster comes up; the operator records the submission id, then cannot reach the dashboard to submit
    st = jobs.wait_status("local-tiny", lambda s: s.get("submissionId"), timeout=60, message="a submission id")
    sid = st["submissionId"]
    assert st["dashboardUrl"] == f"http://127.0.0.1:{dead}"
    caplog.set_level(logging.INFO)
    started = time.monotonic()
    admin.delete(kube.RLTJ, namespace, "local-tiny")
    wait_for(lambda: jobs.get("local-tiny") is None, timeout=40, message="the finalizer to be released")
    took = time.monotonic() - started
    assert took < 20.0, took
    # this job's records only: a previous test's job, its namespace being deleted, may be finalized meanwhile
    messages = [r.getMessage() for r in caplog.records if r.name == "kopf.objects"
                and (getattr(r, "k8s_ref", None) or {}).get("namespace") == namespace]
    failed = [m for m in messages if m.startswith("Handler 'finalize' failed temporarily")]
    # the first pass could not stop the Ray job (and deleted the children); the retry found no cluster left to
    # reach and released the finalizer (bounded in any case by --deletion-timeout)
    assert failed and f"stop {sid}: Ray dashboard http://127.0.0.1:{dead} unreachable" in failed[0], messages
    assert messages.index(failed[0]) < messages.index("Handler 'finalize' succeeded.")
    assert not any(children(admin, namespace, "local-tiny").values())  # the children went all the same


# ------------------------------------------------------------------------------------------------ a full job
@pytest.fixture(scope="module")
def ray_head():
    from ray_head import start_ray_head

    head = start_ray_head(num_cpus=2)
    yield head
    head.stop()


@pytest.mark.slow
@pytest.mark.parametrize("operator", [{"step_seconds": 0.3}], indirect=True)
def test_a_full_job_succeeds_through_a_hyperpod_node_replacement(ray_head, operator, fake_kuberay, jobs, admin,
                                                                 namespace, control_plane):
    """Fake KubeRay + a real local Ray head + the stand-in trainer: the job runs, HyperPod marks the node under it
    ``UnschedulablePendingReplacement``, the operator checkpoints, stops, moves the pods and resumes without losing a
    step, and the job ends Succeeded; the real server stores every status field on the way, and its printer columns
    and the job's events are what ``kubectl get`` / ``kubectl describe`` show (real kubectl when there is one)."""
    shown = KubectlCapture(control_plane.kubeconfig, namespace)
    fake = fake_kuberay(ray_head.dashboard_port, operator.volumes)
    node_a, node_b = f"{namespace}-a", f"{namespace}-b"
    fake.add_node(node_a)
    jobs.create(example(TINY, namespace, algorithm__steps=24, checkpoint__intervalSteps=5,
                        checkpoint__path=str(operator.checkpoints), resilience__hyperPod=True,
                        resilience__restartBackoffSeconds=1))
    jobs.wait_status("local-tiny", lambda s: s.get("phase") == "Running" and s.get("currentStep", 0) >= 3,
                     timeout=120, message="Running at step 3")
    columns, rows = admin.table(kube.RLTJ, namespace)  # the server-side table kubectl prints
    assert columns == ["Name", "Phase", "Step", "Total", "Success", "Restarts", "Age"], columns
    ((name, phase, step, total, _success, restarts, _age),) = rows
    assert (name, phase, total, restarts) == ("local-tiny", "Running", 24, 0) and 3 <= step < 24, rows
    shown.get("while Running")
    fake.add_node(node_b)  # the replacement capacity
    pods = admin.list("v1/pods", namespace, selector=f"{api.JOB_LABEL}=local-tiny")
    assert {p["spec"]["nodeName"] for p in pods} == {node_a}
    fake.set_node_health(node_a, api.NodeHealthStatus.PENDING_REPLACEMENT.value)
    # both recreated (fake KubeRay makes one pod at a time: a list between the two shows only the first)
    moved = wait_for(lambda: (lambda ps: ps if len(ps) >= 2 and all(p["spec"].get("nodeName") == node_b for p in ps)
                              else None)(admin.list("v1/pods", namespace, selector=f"{api.JOB_LABEL}=local-tiny")),
                     timeout=90, message="the head and worker pods to move to the replacement node")
    assert len(moved) == 2  # head and one worker, recreated by (fake) KubeRay after the operator deleted them
    st = jobs.wait_phase("local-tiny", "Succeeded", timeout=90)
    assert st["attempt"] == 2 and st["restarts"] == 1
    assert st["lastFailure"]["reason"] == "NodeReplacement" and st["lastFailure"]["node"] == node_a
    rec = st["lastRecovery"]
    assert rec["reason"] == "NodeReplacement" and rec["lostSteps"] == 0, rec
    assert st["currentStep"] == 24 and st["latestCheckpoint"]["step"] >= rec["resumedFromStep"]
    assert st["adapterPath"].endswith("/exports/adapter")
    conds = {c["type"]: c["status"] for c in st["conditions"]}
    assert conds == {"Ready": "True", "Reconciling": "False", "Stalled": "False", "Succeeded": "True",
                     "Failed": "False", "Suspended": "False"}
    # the trainer's own record: attempt 2 resumed exactly after the checkpoint, no step ran twice or went missing
    by_attempt: dict[int, list[int]] = {}
    for r in operator_steps(operator, namespace):
        by_attempt.setdefault(int(r["attempt"]), []).append(int(r["step"]))
    assert sorted(by_attempt) == [1, 2], by_attempt
    last = max(by_attempt[1])
    assert by_attempt[1] == list(range(1, last + 1)), by_attempt  # attempt 1 stopped after its checkpoint
    assert by_attempt[2] == list(range(last + 1, 25)), by_attempt  # attempt 2 went on from there, nothing twice
    # the RayCluster is freed after success (its pods, on the replacement node, go with it)
    wait_for(lambda: admin.get("ray.io/v1/rayclusters", namespace, api.raycluster_name("local-tiny")) is None,
             timeout=30, message="the RayCluster to be deleted after success")
    jobs.wait_status("local-tiny", lambda s: "dashboardUrl" not in s, timeout=10, message="no dashboard URL")
    reasons = [e["reason"] for e in jobs.events("local-tiny")]
    for reason in ("Provisioning", "Submitted", "NodeReplacement", "Resubmitted", "Recovered", "Succeeded"):
        assert reason in reasons, reasons
    steady_status(admin, jobs, ["local-tiny"], seconds=6 * operator.poll, plane=control_plane)
    columns, rows = admin.table(kube.RLTJ, namespace)
    assert [r[:4] + r[5:6] for r in rows] == [["local-tiny", "Succeeded", 24, 24, 1]], rows
    shown.get("after Succeeded")
    story = ["Provisioning", "Submitted", "NodeReplacement", "CheckpointTaken", "Recovering", "Resubmitted",
             "Recovered", "Succeeded"]
    ordered = [e["reason"] for e in jobs.events("local-tiny")]  # oldest first (resourceVersion)
    assert [r for r in ordered if r in story] == story, ordered  # each once, in this order
    shown.describe("local-tiny", story)
    shown.write()


class KubectlCapture:
    """Runs the real ``kubectl get rltj -A`` / ``kubectl describe rltj`` against the test API server, checks what it
    prints (columns, phase, event reasons in order) and keeps the output verbatim for ``DAEDALUS_KUBECTL_DOC``.

    Without a kubectl binary the calls do nothing (the server-side table is still checked by the caller), unless
    ``DAEDALUS_REQUIRE_TOOLS=1``: then the test fails.
    """

    HEADER = ["NAMESPACE", "NAME", "PHASE", "STEP", "TOTAL", "SUCCESS", "RESTARTS", "AGE"]

    def __init__(self, kubeconfig: Path, namespace: str):
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.binary = find_kubectl()
        if self.binary is None and os.environ.get("DAEDALUS_REQUIRE_TOOLS") == "1":
            pytest.fail("DAEDALUS_REQUIRE_TOOLS=1 but no kubectl (scripts/fetch-helm.sh caches one; or set "
                        "DAEDALUS_KUBECTL or put kubectl on PATH)")
        self.blocks: list[tuple[str, str]] = []
        self.version = ""
        if self.binary:
            client = json.loads(kubectl(self.binary, kubeconfig, "version", "-o", "json"))
            self.version = f"kubectl {client['clientVersion']['gitVersion']}, server {client['serverVersion']['gitVersion']}"

    def get(self, when: str) -> None:
        if not self.binary:
            return
        out = kubectl(self.binary, self.kubeconfig, "get", "rltj", "-A")
        lines = [line.split() for line in out.strip().splitlines()]
        mine = [line for line in lines[1:] if line[0] == self.namespace]
        assert lines[0] == self.HEADER, out
        assert len(mine) == 1 and mine[0][1] == "local-tiny", out
        phase = {"while Running": "Running", "after Succeeded": "Succeeded"}[when]
        assert mine[0][2] == phase and mine[0][4] == "24", out
        if phase == "Succeeded":
            assert mine[0][3] == "24" and mine[0][6] == "1", out
        # only this test's job, so other tests' leftovers never reach the document
        self.blocks.append((f"$ kubectl get rltj -A    # {when}", "\n".join([out.splitlines()[0]] + [
            line for line in out.splitlines()[1:] if line.split()[0] == self.namespace])))

    def describe(self, name: str, reasons: list[str]) -> None:
        if not self.binary:
            return
        out = kubectl(self.binary, self.kubeconfig, "describe", "rltj", name, "-n", self.namespace)
        assert re.search(r"^Name:\s+local-tiny$", out, re.M) and re.search(r"^\s+Phase:\s+Succeeded$", out, re.M), out
        events = out.split("\nEvents:", 1)[1]
        seen = [line.split()[1] for line in events.strip().splitlines()[2:] if line.split()]
        # kubectl sorts events by their timestamps (one-second resolution): same-second events may print in either
        # order, so here only presence (each once); the order is checked from the API by resourceVersion.
        assert sorted(r for r in seen if r in reasons) == sorted(reasons), seen
        self.blocks.append((f"$ kubectl describe rltj {name} -n {self.namespace}", out.rstrip()))

    def write(self) -> None:
        target = os.environ.get("DAEDALUS_KUBECTL_DOC")
        if not target or not self.blocks:
            return
        body = "\n\n".join(f"```console\n{cmd}\n{out}\n```" for cmd, out in self.blocks)
        Path(target).write_text(
            "# `kubectl get` and `kubectl describe` for an RLTrainingJob\n\n"
            "Real output, captured verbatim by `DAEDALUS_KUBECTL_DOC=docs/operator-kubectl.md .venv/bin/python -m "
            "pytest tests/cluster/test_operator_cluster.py -k full_job` (" + self.version + "): the project's "
            "test control plane (kube-apiserver + etcd + kube-controller-manager built from Debian's kubernetes "
            "1.20.2 source), the operator installed by the Helm chart and running with its ServiceAccount, the fake "
            "KubeRay scheduling pods on Node objects, a real local Ray head and the stand-in trainer (24 steps, "
            "checkpoint every 5), through a HyperPod node replacement (the node under the job labelled "
            "`UnschedulablePendingReplacement` at step >= 3). The job's namespace is the test's random one. The CRD "
            "has no priority printer columns, so `-o wide` prints the same columns.\n\n" + body + "\n")


def operator_steps(operator: ChartOperator, namespace: str) -> list[dict]:
    """The stand-in trainer's ``steps.jsonl`` of the job: one ``{attempt, step, time}`` per completed step."""
    import json

    path = operator.checkpoints / namespace / "local-tiny" / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]



def test_the_documented_uninstall_order_and_finalizer_removal_work(control_plane, jobs, admin, namespace):
    """docs/deploy.md section 8: jobs are deleted before the operator and the CRD, and its by-hand finalizer removal
    (run with the real kubectl against the real API server) frees a job whose deletion no operator will finish."""
    import shlex

    text = (Path(__file__).resolve().parents[2] / "docs" / "deploy.md").read_text()
    section = text[text.index("## 8. Suspend, resume, delete, uninstall"):]
    order = [section.index(s) for s in ("kubectl delete rltj --all", "helm uninstall daedalus",
                                        "kubectl delete crd rltrainingjobs.daedalus.dev")]
    assert order == sorted(order), "uninstall: delete the jobs while the operator runs, then the chart, then the CRD"
    assert f"`{api.FINALIZER}`" in section
    (line,) = [ln for ln in section.splitlines() if ln.startswith("kubectl -n ml-training patch rltj maze-qwen3vl-8b")
               and "finalizers" in ln]
    binary = find_kubectl()
    if binary is None:
        from chartlib import missing_tool

        missing_tool("no kubectl binary (scripts/fetch-helm.sh caches one; or set DAEDALUS_KUBECTL)")
    manifest = example(TINY, namespace)
    manifest["metadata"]["finalizers"] = [api.FINALIZER]  # as the operator leaves it on every job
    jobs.create(manifest)
    admin.delete(kube.RLTJ, namespace, "local-tiny")
    time.sleep(1.0)
    assert jobs.get("local-tiny")["metadata"]["deletionTimestamp"]  # held: no operator runs
    words = shlex.split(re.sub(r"\s+#.*$", "", line))
    words = [namespace if w == "ml-training" else "local-tiny" if w == "maze-qwen3vl-8b" else w for w in words]
    assert words[0] == "kubectl"
    kubectl(binary, control_plane.kubeconfig, *words[1:])
    wait_for(lambda: jobs.get("local-tiny") is None, timeout=10, message="the job to go after the documented patch")
