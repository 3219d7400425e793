"""The operator running for real (kopf's operator in a thread, ``daedalus_operator.main.run``) against the honest
kmock API: children with owner references, the stable control token, an invalid spec, deletion through the
finalizer (bounded), API faults (409 on the status write, 500 on create, failed deletes), watch timeouts, metrics and
the liveness endpoint. No Ray here (the RayCluster never becomes ready); see test_operator_e2e.py for real Ray jobs."""

from __future__ import annotations

import base64
import json
import logging
import time
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from fake_kuberay import wait_for
from interference import InterferingIndex
from kuberay import KUBERAY_CRDS
from operator_env import RLTJ, OperatorEnv

from daedalus_operator import api

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = KUBERAY_CRDS
CHILDREN = [("v1/configmaps", "local-tiny-config"), ("v1/secrets", "local-tiny-control"),
            ("networking.k8s.io/v1/networkpolicies", "local-tiny-ray"),
            ("policy/v1/poddisruptionbudgets", "local-tiny-ray"), ("ray.io/v1/rayclusters", "local-tiny-ray")]


@pytest.fixture()
def env(tmp_path: Path, request):
    extra = getattr(request, "param", ())
    e = OperatorEnv(tmp_path, None, poll=0.3, extra_args=tuple(extra))
    e.start(fake_kuberay=False)
    yield e
    e.stop()


def children(env: OperatorEnv) -> dict[str, dict | None]:
    return {name + "/" + key.split("/")[-1]: env.kube.get(key, "ml", name) for key, name in CHILDREN}


@pytest.mark.parametrize("env", [("--poll-budget", "0")], indirect=True)  # every tick reconciles, quiet or not
def test_children_owner_refs_token_metrics_liveness(env: OperatorEnv) -> None:
    job = env.apply(env.job_manifest())
    st = env.wait_phase("Provisioning", timeout=30)
    assert st["rayClusterName"] == "local-tiny-ray" and st["observedGeneration"] == 1
    made = wait_for(lambda: (lambda c: c if all(c.values()) else None)(children(env)), timeout=30,
                    message="all children")
    for key, obj in made.items():
        meta = obj["metadata"]
        assert meta["labels"][api.JOB_LABEL] == "local-tiny", key
        assert meta["ownerReferences"] == [{"apiVersion": "daedalus.dev/v1alpha1", "kind": "RLTrainingJob",
                                            "name": "local-tiny", "uid": job["metadata"]["uid"], "controller": True,
                                            "blockOwnerDeletion": True}], key
    # the RayCluster as created on the server validates against KubeRay v1.7.0 (server fields aside)
    rc = made["local-tiny-ray/rayclusters"]
    crd = yaml.load((KUBERAY / "ray.io_rayclusters.yaml").read_text(), Loader=getattr(yaml, "CSafeLoader",
                                                                                       yaml.SafeLoader))
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    jsonschema.Draft4Validator(schema).validate({k: v for k, v in rc.items() if k != "metadata"})
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in head["ports"]}["trainer-metrics"] == env.control_port
    config = json.loads(made["local-tiny-config/configmaps"]["data"]["config.json"])
    assert config["metadata"] == {"name": "local-tiny", "namespace": "ml", "uid": job["metadata"]["uid"]}
    assert config["spec"]["checkpoint"]["path"] == str(env.checkpoints)
    token = base64.b64decode(made["local-tiny-control/secrets"]["data"]["token"])
    assert len(token) >= 40
    # the finalizer is ours; the status has conditions with observedGeneration
    body = env.get_job()
    assert api.FINALIZER in body["metadata"]["finalizers"]
    assert {c["type"]: c["status"] for c in body["status"]["conditions"]}["Reconciling"] == "True"
    # reconciles keep going (poll 0.3 s) but the token is never rotated and, once kopf's own bookkeeping settled
    # (its annotations after a retried handler), the job is not rewritten: ~7 reconciles leave it untouched
    def steady() -> str | None:
        rv = env.get_job()["metadata"]["resourceVersion"]
        time.sleep(2.0)
        return rv if env.get_job()["metadata"]["resourceVersion"] == rv else None

    wait_for(steady, timeout=20, interval=0, message="no writes to the job for 2 s while polling every 0.3 s")
    again = env.kube.get("v1/secrets", "ml", "local-tiny-control")
    assert base64.b64decode(again["data"]["token"]) == token
    assert again["metadata"]["resourceVersion"] == made["local-tiny-control/secrets"]["metadata"]["resourceVersion"]
    assert "Provisioning" in env.wait_event_reasons("Provisioning")
    text = env.metrics_text()
    assert 'daedalus_operator_job_phase{job="local-tiny",namespace="ml",phase="Provisioning"} 1.0' in text
    assert 'daedalus_operator_jobs{phase="Provisioning"} 1.0' in text
    from prometheus_client.parser import text_string_to_metric_families

    values = {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
              for fam in text_string_to_metric_families(text) for smp in fam.samples}
    requeues = values[("daedalus_operator_reconciles_total", (("result", "requeue"),))]
    assert requeues >= 5  # the polls of the 2 s steady window (every 0.3 s) alone
    assert values[("daedalus_operator_reconcile_seconds_count", ())] >= requeues
    with urllib.request.urlopen(f"http://127.0.0.1:{env.liveness_port}/healthz", timeout=10) as r:
        assert r.status == 200 and json.loads(r.read())["api"] == "ok"


def test_invalid_spec_is_stalled_without_children_then_fixed(env: OperatorEnv) -> None:
    bad = env.job_manifest(environment__size=8)  # kmock has no CEL: the operator's own validation must catch it
    env.apply(bad)
    st = env.wait_phase("Failed", timeout=30)
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Stalled"]["status"] == "True" and conds["Stalled"]["reason"] == "InvalidSpec"
    assert "spec.environment.size" in conds["Stalled"]["message"]
    assert st["lastFailure"]["reason"] == "InvalidSpec"
    time.sleep(1.0)
    assert all(v is None for v in children(env).values())
    assert "InvalidSpec" in env.wait_event_reasons("InvalidSpec")
    env.kube.patch("daedalus.dev/v1alpha1/rltrainingjobs", "ml", "local-tiny", {"spec": {"environment": {"size": 7}}})
    st = env.wait_phase("Provisioning", timeout=30)
    assert st["observedGeneration"] == 2 and "lastFailure" not in st
    wait_for(lambda: all(children(env).values()), timeout=30, message="children after the fix")


def test_deletion_releases_the_finalizer_and_deletes_children(env: OperatorEnv) -> None:
    env.apply(env.job_manifest())
    wait_for(lambda: all(children(env).values()), timeout=30, message="children")
    env.kube.delete("daedalus.dev/v1alpha1/rltrainingjobs", "ml", "local-tiny")
    wait_for(lambda: env.get_job() is None, timeout=30, message="the job to be gone")
    assert all(v is None for v in children(env).values())
    text = env.metrics_text()
    assert 'job="local-tiny"' not in text  # the job's series are dropped


@pytest.mark.parametrize("env", [("--poll-budget", "0")], indirect=True)  # every tick reconciles
def test_a_deletion_during_a_timer_reconcile_releases_the_job_within_seconds(env: OperatorEnv) -> None:
    """The poll timer's reconcile runs in a worker thread: a deletion that lands while one runs cannot stop the timer
    at once, and kopf checks again before releasing the finalizer only after ``cancellation_polling`` (60 s by
    default; the cluster tier saw a job still there 40 s after its delete). Here the timer's GET of the job is held
    2 s by the API server when the job is deleted: the job must be gone within seconds of the GET's answer."""
    env.apply(env.job_manifest())
    wait_for(lambda: all(children(env).values()), timeout=30, message="children")
    held = env.api.fault("GET", "rltrainingjobs", name="local-tiny", status=0, delay=2.0, times=1)
    wait_for(lambda: held.hits, timeout=10, interval=0.01, message="a reconcile's GET of the job to be held")
    deleted = time.monotonic()
    env.kube.delete("daedalus.dev/v1alpha1/rltrainingjobs", "ml", "local-tiny")
    wait_for(lambda: env.get_job() is None, timeout=90, message="the job to be gone")
    took = time.monotonic() - deleted
    assert took < 15.0, f"the job went {took:.1f} s after its delete"


@pytest.mark.parametrize("env", [("--deletion-timeout", "3")], indirect=True)
def test_deletion_is_bounded_when_cleanup_keeps_failing(env: OperatorEnv) -> None:
    env.apply(env.job_manifest())
    wait_for(lambda: all(children(env).values()), timeout=30, message="children")
    fault = env.api.fault("DELETE", "configmaps", status=500, times=10_000)
    # reading the RayCluster fails too (403): before, that escaped the bound and kopf retried for ever. Its owner
    # unknown, the finalizer does not delete it blind (it leaves it to the garbage collector)
    forbidden = env.api.fault("GET", "rayclusters", status=403, times=10_000)
    t0 = time.monotonic()
    env.kube.delete("daedalus.dev/v1alpha1/rltrainingjobs", "ml", "local-tiny")
    wait_for(lambda: env.get_job() is None, timeout=40, message="the finalizer to be released")
    took = time.monotonic() - t0
    assert fault.hits >= 2 and forbidden.hits >= 2 and 3.0 <= took < 30, (fault.hits, forbidden.hits, took)
    forbidden.times = 0  # lift the injected 403 for the check below, which GETs the RayCluster itself
    # the operator's own deletes failed or were not tried; owner-reference GC removed them once the job was gone
    assert env.kube.get("ray.io/v1/rayclusters", "ml", "local-tiny-ray") is None
    fault.times = 0
    assert env.kube.get("v1/configmaps", "ml", "local-tiny-config") is None


def test_api_faults_409_on_status_and_500_on_create(env: OperatorEnv) -> None:
    conflict = env.api.fault("PATCH", "rltrainingjobs", subresource="status", status=409, times=2)
    boom = env.api.fault("POST", "configmaps", status=500, times=2)
    env.apply(env.job_manifest())
    st = env.wait_phase("Provisioning", timeout=40)
    wait_for(lambda: all(children(env).values()), timeout=40, message="children despite faults")
    assert conflict.hits == 2 and boom.hits == 2
    assert st["rayClusterName"] == "local-tiny-ray"
    # after the faults the condition is clean again and nothing was created twice
    st = env.wait_status(lambda s: {c["type"]: c for c in s["conditions"]}["Reconciling"]["reason"] == "Provisioning",
                         timeout=20)
    assert len(env.kube.list("ray.io/v1/rayclusters", "ml")) == 1
    assert len(env.kube.list("v1/secrets", "ml")) == 1
    text = env.metrics_text()
    errors = float(text.split('daedalus_operator_reconciles_total{result="error"} ')[1].split()[0])
    assert errors >= 2


@pytest.mark.parametrize("env", [("--watch-timeout", "1")], indirect=True)
def test_watch_timeout_is_sent_and_streams_restart(env: OperatorEnv) -> None:
    time.sleep(3.5)  # several server-side timeouts pass
    watches = [r for r in env.api._requests if r.params.get("watch") == "true"
               and r.url.path.endswith("/rltrainingjobs")]
    assert len(watches) >= 2 and all(r.params.get("timeoutSeconds") == "1" for r in watches)
    env.apply(env.job_manifest())  # still served after the restarts
    env.wait_phase("Provisioning", timeout=30)


def test_raycluster_deleted_by_hand_is_recreated(env: OperatorEnv) -> None:
    env.apply(env.job_manifest())
    first = wait_for(lambda: env.kube.get("ray.io/v1/rayclusters", "ml", "local-tiny-ray"), timeout=30,
                     message="the RayCluster")
    token = env.kube.get("v1/secrets", "ml", "local-tiny-control")["data"]["token"]
    env.kube.delete("ray.io/v1/rayclusters", "ml", "local-tiny-ray")
    again = wait_for(lambda: (lambda rc: rc if rc and rc["metadata"]["uid"] != first["metadata"]["uid"] else None)(
        env.kube.get("ray.io/v1/rayclusters", "ml", "local-tiny-ray")), timeout=30, message="a new RayCluster")
    assert again["spec"] == first["spec"]
    assert env.kube.get("v1/secrets", "ml", "local-tiny-control")["data"]["token"] == token


def test_api_timeouts_are_retried(env: OperatorEnv) -> None:
    # the operator's API calls time out after 2 x --request-timeout = 6 s; the job's GET hangs 7 s twice
    slow = env.api.fault("GET", "rltrainingjobs", name="local-tiny", status=200, delay=7.0, times=2)
    env.apply(env.job_manifest())
    st = env.wait_phase("Provisioning", timeout=60)
    assert slow.hits == 2 and st["rayClusterName"] == "local-tiny-ray"
    wait_for(lambda: all(children(env).values()), timeout=30, message="children after the timeouts")
    text = env.metrics_text()
    assert float(text.split('daedalus_operator_reconciles_total{result="error"} ')[1].split()[0]) >= 1


@pytest.mark.parametrize("env", [("--poll-budget", "0")], indirect=True)  # every tick reconciles, quiet or not
def test_each_child_is_created_once(env: OperatorEnv) -> None:
    """``EnsureChildren`` is decided again while kopf's index has not seen the new RayCluster yet and again at every
    submission; the operator remembers what it created (handlers.Children), so the API sees one create per child and
    no 409 AlreadyExists (bench/operator_scale.py measured half of all creates answered 409 before)."""
    start = len(env.api._requests)
    env.apply(env.job_manifest())
    wait_for(lambda: all(children(env).values()), timeout=30, message="all children")
    time.sleep(10 * env.poll)  # ten more polls (Provisioning: the cluster never becomes ready without KubeRay)
    creates: dict[str, int] = {}
    for r in list(env.api._requests)[start:]:
        if str(getattr(r.method, "value", r.method)) == "POST" and r.resource is not None and \
                not (r.headers or {}).get("User-Agent", "").startswith("python-requests"):
            creates[r.resource.plural] = creates.get(r.resource.plural, 0) + 1
    assert {k: v for k, v in creates.items() if k != "events"} == {
        "configmaps": 1, "secrets": 1, "networkpolicies": 1, "poddisruptionbudgets": 1, "rayclusters": 1}, creates
    assert env.status()["phase"] == "Provisioning"


def test_the_disruption_budget_follows_checkpoint_on_drain_while_the_job_lives(env: OperatorEnv) -> None:
    """``spec.resilience.checkpointOnDrain`` is editable: false deletes the PodDisruptionBudget at the next reconcile,
    true creates it again; nothing else of the job changes."""
    key, name = "policy/v1/poddisruptionbudgets", "local-tiny-ray"
    env.apply(env.job_manifest())
    pdb = wait_for(lambda: env.kube.get(key, "ml", name), timeout=30, message="the PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 2  # the head and the one worker of local-tiny
    assert pdb["spec"]["selector"]["matchLabels"] == {api.JOB_LABEL: "local-tiny", api.RAY_CLUSTER_LABEL: name}
    env.kube.patch(RLTJ, "ml", "local-tiny", {"spec": {"resilience": {"checkpointOnDrain": False}}})
    wait_for(lambda: env.kube.get(key, "ml", name) is None, timeout=30, message="the budget deleted")
    env.kube.patch(RLTJ, "ml", "local-tiny", {"spec": {"resilience": {"checkpointOnDrain": True}}})
    wait_for(lambda: env.kube.get(key, "ml", name), timeout=30, message="the budget created again")
    assert env.kube.get("ray.io/v1/rayclusters", "ml", name) is not None
    assert env.status()["phase"] == "Provisioning"
    assert [e["reason"] for e in env.events() if e.get("type") == "Warning"] == []


def test_a_refused_disruption_budget_does_not_hold_the_job_back(env: OperatorEnv) -> None:
    """The budget is a safety net: while its create is refused (here 403, as with a Role not updated, a quota or a
    policy webhook) the other children and the RayCluster are still made, and the budget follows once it is let."""
    refused = env.api.fault("POST", "poddisruptionbudgets", status=403, times=10_000)
    env.apply(env.job_manifest())
    wait_for(lambda: env.kube.get("ray.io/v1/rayclusters", "ml", "local-tiny-ray"), timeout=30,
             message="the RayCluster despite the refused budget")
    assert env.status()["phase"] == "Provisioning" and refused.hits >= 1
    assert env.kube.get("policy/v1/poddisruptionbudgets", "ml", "local-tiny-ray") is None
    refused.times = 0  # the server lets it now: the next reconcile makes it
    wait_for(lambda: env.kube.get("policy/v1/poddisruptionbudgets", "ml", "local-tiny-ray"), timeout=30,
             message="the budget once the server takes it")


def test_a_job_waiting_for_its_raycluster_is_looked_at_when_the_raycluster_changes(env: OperatorEnv) -> None:
    """The default poll budget: a Provisioning job whose RayCluster is not ready and that has nothing to do is quiet;
    the timer's ticks skip it (no requests) until the RayCluster changes, then the next tick reconciles it."""
    from prometheus_client.parser import text_string_to_metric_families

    def counts() -> tuple[float, float]:
        values = {smp.name: smp.value for fam in text_string_to_metric_families(env.metrics_text())
                  for smp in fam.samples if smp.name in ("daedalus_operator_poll_skips_total",)}
        reconciles = sum(smp.value for fam in text_string_to_metric_families(env.metrics_text())
                         for smp in fam.samples if smp.name == "daedalus_operator_reconciles_total")
        return reconciles, values.get("daedalus_operator_poll_skips_total", 0.0)

    def wakes() -> dict[str, float]:  # what woke the quiet job early, by reason (the failure message says it)
        return {smp.labels["reason"]: smp.value for fam in text_string_to_metric_families(env.metrics_text())
                for smp in fam.samples if smp.name == "daedalus_operator_poll_wakes_total" and smp.value}

    env.apply(env.job_manifest())
    wait_for(lambda: all(children(env).values()), timeout=30, message="all children")
    wait_for(lambda: counts()[1] >= 2, timeout=30, message="the timer to skip the waiting job")

    def settled() -> bool:  # three ticks in a row skipped, none reconciled
        r0, s0 = counts()
        time.sleep(3 * env.poll)
        r1, s1 = counts()
        return r1 == r0 and s1 - s0 >= 2

    # Any late change of what the job depends on (say the fake KubeRay touching a pod after the job went quiet)
    # rightly wakes it; make test at 60f6bbc once saw two reconciles in the window below (cause not identified), so
    # the window starts only after three skipped ticks in a row.
    wait_for(settled, timeout=30, message="three ticks in a row that skip the waiting job")
    reconciles0, skips0 = counts()
    wakes0 = wakes()
    requests0 = len(env.api._requests)
    time.sleep(10 * env.poll)
    reconciles1, skips1 = counts()
    assert skips1 - skips0 >= 7 and reconciles1 == reconciles0, (reconciles0, reconciles1, skips0, skips1, wakes0,
                                                                 wakes())
    # no reconcile, so no request about the job (each reconcile starts with a GET of it; the watches began before)
    ours = [(str(getattr(r.method, "value", r.method)), r.resource.plural) for r in list(env.api._requests)[requests0:]
            if r.resource is not None and not (r.headers or {}).get("User-Agent", "").startswith("python-requests")]
    assert [r for r in ours if r[1] == "rltrainingjobs"] == [], ours
    env.kube.patch("ray.io/v1/rayclusters", "ml", "local-tiny-ray", {"metadata": {"labels": {"touched": "yes"}}})
    wait_for(lambda: counts()[0] > reconciles1, timeout=5, message="a reconcile after the RayCluster changed")
    assert wakes().get("raycluster", 0) == wakes0.get("raycluster", 0) + 1, (wakes0, wakes())
    assert env.status()["phase"] == "Provisioning"


def test_an_operator_restart_writes_each_job_status_without_a_409(env: OperatorEnv, caplog) -> None:
    """At every operator start kopf runs on.resume and the timer's first tick of each job together. The one that
    waited for the other's per-job lock used to plan from the job as read before the wait: stale by the other's
    status write, so its own guarded write was answered 409 Conflict (an ERROR "Handler 'reconcile' failed
    temporarily", a retry, and kopf's progress annotations written on the job, which raced the next tick's write in
    turn). Here the world changed while the operator was down (each RayCluster says something new), so each first
    reconcile writes the status; the API answers each job's first GET 0.2 s late and its status writes 0.3 s late,
    as a loaded server would, so the two handlers overlap (without the delays the race is lost in about 1 of 9
    job-restarts here). Measured with the read before the lock: 6 409s and 6 such ERROR lines over these 3 jobs x 3
    restarts in each of 4 runs (without the delays 0, 1 and 2 in 3 runs); with the read under the lock: none."""
    names = ["local-tiny", "job-b", "job-c"]
    for n in names:
        env.apply(env.job_manifest(name=n))
    for n in names:
        env.wait_phase("Provisioning", timeout=30, name=n)
        wait_for(lambda n=n: env.kube.get("ray.io/v1/rayclusters", "ml", f"{n}-ray"), timeout=30, message="RayCluster")
    caplog.set_level(logging.INFO)
    before = len(env.api.conflicts)
    failed: list[str] = []
    for k in range(3):
        env.stop_operator()
        for n in names:  # KubeRay has news while the operator is down: the job's Ready message will change
            env.kube.patch("ray.io/v1/rayclusters", "ml", f"{n}-ray", {"status": {"reason": f"news {k}"}},
                           status=True)
        env.api.fault("PATCH", "rltrainingjobs", subresource="status", status=200, delay=0.3, times=len(names))
        for n in names:
            env.api.fault("GET", "rltrainingjobs", name=n, status=200, delay=0.2, times=1)
        caplog.clear()
        env.start_operator()
        for n in names:
            env.wait_status(lambda st, k=k: f"news {k}" in {c["type"]: c for c in st["conditions"]}["Ready"][
                "message"], timeout=30, message=f"{n} after restart {k}", name=n)
        time.sleep(1.5)  # the other handler's reconcile, and kopf's retry of it had it failed
        failed += [f"restart {k}: {r.getMessage()[:120]}" for r in caplog.records
                   if "failed temporarily" in r.getMessage() and "409" in r.getMessage()]
    conflicts = [c for c in env.api.conflicts[before:] if c.key == RLTJ]
    assert (len(conflicts), len(failed)) == (0, 0), (conflicts, failed)


def _provisioning_job_and_runtime(tmp_path: Path) -> tuple[OperatorEnv, Any]:
    """A kmock API server (no operator, no fake KubeRay) holding the example job as one the operator already looked
    at (Provisioning: no phase change, so no event to post outside kopf), and a :class:`Runtime` to call
    ``reconcile`` with by hand. The caller stops the env."""
    from daedalus_operator import kube
    from daedalus_operator.handlers import Runtime
    from daedalus_operator.metrics import OperatorMetrics
    from daedalus_operator.settings import OperatorSettings

    e = OperatorEnv(tmp_path, None, poll=0.3)
    e.start(operator=False, fake_kuberay=False)
    e.apply(e.job_manifest())
    e.kube.patch(RLTJ, "ml", "local-tiny", {"status": {"phase": "Provisioning", "rayClusterName": "local-tiny-ray",
                                                      "observedGeneration": 1}}, status=True)
    rt = Runtime(settings=OperatorSettings(control_port=e.control_port, config_dir=str(tmp_path / "etc")),
                 metrics=OperatorMetrics(), kube=kube.KubeAPI(kube.api_client_from_environment(str(e.kubeconfig))))
    return e, rt


KOPF_DIFF_BASE = {"metadata": {"annotations": {"kopf.daedalus.dev/last-handled-configuration": '{"spec": {}}'}}}


@pytest.mark.parametrize("writer, path, patch, retried", [
    ("kopf's diff-base", None, KOPF_DIFF_BASE, True),
    ("kopf's progress", None, {"metadata": {"annotations": {"kopf.daedalus.dev/reconcile": '{"retries": 1}'}}}, True),
    ("kopf's finalizer", None, {"metadata": {"finalizers": [api.FINALIZER]}}, True),
    ("another annotation", None, {"metadata": {"annotations": {"touched-by": "someone"}}}, False),
    ("another status", "status", {"status": {"phase": "Suspended", "attempt": 7}}, False),
    ("the spec", None, {"spec": {"suspend": True}}, False),
], ids=["diff-base", "progress", "finalizer", "annotation", "status", "spec"])
def test_a_status_write_refused_for_kopfs_own_write_alone_is_sent_again(tmp_path: Path, writer: str,
                                                                           path: str | None, patch: dict,
                                                                           retried: bool) -> None:
    """kopf writes its finalizer, progress and diff-base annotations on the job itself, between a reconcile's GET and
    its status write at times (a job's creation; around a retried handler): the guarded write is answered 409 though
    nothing the reconcile planned from changed. Such a write is sent again with the fresh resourceVersion, once;
    a write by anyone else (an annotation, the status, the spec) still makes the reconcile fail for kopf's retry to
    re-plan, and the other writer's status is never overwritten."""
    import kopf

    from daedalus_operator.handlers import reconcile

    e, rt = _provisioning_job_and_runtime(tmp_path)
    try:
        interfering = InterferingIndex(lambda: e.kube.patch(RLTJ, "ml", "local-tiny", patch, status=path == "status"))
        before = len(e.api.conflicts)
        logger = logging.getLogger("test.reconcile")
        if retried:
            last = reconcile(rt, "ml", "local-tiny", {"clusters_by_job": interfering}, logger)
            assert last is not None and last.phase.value == "Provisioning"
            st = e.status()
            assert "conditions" in st and st["phase"] == "Provisioning"  # the planned status, written
        else:
            with pytest.raises(kopf.TemporaryError, match="409 Conflict"):
                reconcile(rt, "ml", "local-tiny", {"clusters_by_job": interfering}, logger)
            st = e.status()
            assert "conditions" not in st  # nothing of the stale plan was written
            if path == "status":
                assert (st["phase"], st["attempt"]) == ("Suspended", 7)  # the other writer's status stands
        assert interfering.writes == 1
        assert len(e.api.conflicts) - before == 1, e.api.conflicts[before:]  # the one refused write
    finally:
        e.stop()


def test_a_failed_action_is_recorded_in_the_status_without_overwriting_a_newer_one(tmp_path: Path) -> None:
    """After its guarded status write a reconcile runs the actions; one that fails is recorded in the Reconciling
    condition by a second status write. That one carried no resourceVersion: conditions another writer set between
    the two writes were overwritten (a merge patch replaces a list whole). It is guarded like the first now."""
    import threading

    from daedalus_operator.handlers import reconcile

    e, rt = _provisioning_job_and_runtime(tmp_path)
    try:
        logger = logging.getLogger("test.reconcile")
        # EnsureChildren's first create is answered 500, 0.5 s late; meanwhile another writer sets the conditions
        held = e.api.fault("POST", "configmaps", status=500, delay=0.5, times=1)
        theirs = [{"type": "Ready", "status": "False", "reason": "SetByHand", "message": "another writer",
                   "lastTransitionTime": "2026-01-01T00:00:00Z"}]

        def other_writer() -> None:
            wait_for(lambda: held.hits, timeout=10, interval=0.01, message="the create to be held")
            e.kube.patch(RLTJ, "ml", "local-tiny", {"status": {"conditions": theirs}}, status=True)

        writer = threading.Thread(target=other_writer)
        writer.start()
        before = len(e.api.conflicts)
        reconcile(rt, "ml", "local-tiny", {}, logger)
        writer.join()
        assert e.status()["conditions"] == theirs  # the newer status stands
        assert len(e.api.conflicts) - before == 1  # the failure's write, refused
        # nobody in between: the failure is recorded
        e.api.fault("POST", "configmaps", status=500, times=1)
        reconcile(rt, "ml", "local-tiny", {}, logger)
        reconciling = {c["type"]: c for c in e.status()["conditions"]}["Reconciling"]
        assert reconciling["reason"] == "APIError" and "EnsureChildren" in reconciling["message"], reconciling
        assert len(rt.locks) == 0  # the job's reconcile lock goes with its last reconcile
    finally:
        e.stop()


def test_hyperpod_job_schedules_on_plain_eks_nodes_and_says_why_while_it_cannot(tmp_path: Path) -> None:
    """``resilience.hyperPod: true`` (the default) on a cluster whose nodes carry no HyperPod label (plain EKS): the
    Ray pods must schedule there. While no node fits, the Provisioning condition repeats the scheduler's reason
    instead of waiting silently; a node HyperPod marked Unschedulable is never used."""
    e = OperatorEnv(tmp_path, None, poll=0.3)
    e.start()
    try:
        e.fake.add_node("retired", health="Unschedulable")
        e.apply(e.job_manifest(resilience__hyperPod=True))

        def reconciling(st: dict) -> str:
            return {c["type"]: c for c in st.get("conditions") or []}.get("Reconciling", {}).get("message", "")

        st = e.wait_status(lambda s: "0 nodes are available" in reconciling(s), timeout=30,
                           message="the scheduler's reason in the Reconciling condition")
        assert st["phase"] == "Provisioning", st
        assert "Unschedulable" in reconciling(st)
        e.fake.add_node("plain-eks", health=None)  # no sagemaker.amazonaws.com/node-health-status label
        e.wait_status(lambda s: s.get("phase") not in ("Pending", "Provisioning"), timeout=30,
                      message="the job to leave Provisioning")
        pods = e.kube.list("v1/pods", "ml")
        assert pods and {p["spec"].get("nodeName") for p in pods} == {"plain-eks"}
    finally:
        e.stop()


def test_a_network_policy_from_other_operator_settings_is_brought_up_to_date(tmp_path: Path) -> None:
    """The job's NetworkPolicy exists from an operator that ran without ``--metrics-namespace`` (and an older
    operator that wrote no digest); the operator now runs with ``--metrics-namespace monitoring`` (new chart values):
    it patches the policy so Prometheus may scrape port 9400, and leaves an up-to-date policy alone."""
    from daedalus_operator import resources
    from daedalus_operator.handlers import job_view
    from daedalus_operator.settings import OperatorSettings

    e = OperatorEnv(tmp_path, None, poll=0.3, extra_args=("--metrics-namespace", "monitoring"))
    e.start(operator=False, fake_kuberay=False)
    try:
        job = e.apply(e.job_manifest())
        old = resources.build_network_policy(job_view(job), OperatorSettings(control_port=e.control_port))
        del old["metadata"]["annotations"]
        e.kube.create("networking.k8s.io/v1/networkpolicies", "ml", old)
        e.start_operator()

        def scraped(np: dict | None) -> dict | None:
            peers = [p for rule in ((np or {}).get("spec") or {}).get("ingress") or [] for p in rule.get("from", [])]
            ok = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}} in peers
            return np if ok else None

        np = wait_for(lambda: scraped(e.kube.get("networking.k8s.io/v1/networkpolicies", "ml", "local-tiny-ray")),
                      timeout=30, message="the NetworkPolicy to admit the monitoring namespace")
        digest = np["metadata"]["annotations"][api.SPEC_DIGEST_ANNOTATION]
        assert digest == resources.spec_digest(np["spec"])
        # Again for a job past its first EnsureChildren (its RayCluster exists, so no EnsureChildren is planned):
        # the old policy is back when a new operator process starts; it is patched at its first reconcile.
        e.stop_operator()
        e.kube.patch("networking.k8s.io/v1/networkpolicies", "ml", "local-tiny-ray",
                     {"metadata": {"annotations": None}, "spec": old["spec"]})
        assert scraped(e.kube.get("networking.k8s.io/v1/networkpolicies", "ml", "local-tiny-ray")) is None
        assert e.kube.get("ray.io/v1/rayclusters", "ml", "local-tiny-ray") is not None
        e.start_operator()
        np = wait_for(lambda: scraped(e.kube.get("networking.k8s.io/v1/networkpolicies", "ml", "local-tiny-ray")),
                      timeout=30, message="the NetworkPolicy of a live job to admit the monitoring namespace")
        rv = np["metadata"]["resourceVersion"]
        e.stop_operator()
        e.start_operator()  # a new process: the create is answered 409, the digest matches, no patch
        time.sleep(2.0)  # several reconciles at poll 0.3 s
        again = e.kube.get("networking.k8s.io/v1/networkpolicies", "ml", "local-tiny-ray")
        assert again["metadata"]["resourceVersion"] == rv
    finally:
        e.stop()


def test_a_new_control_secret_replaces_the_token_the_operator_cached(tmp_path: Path) -> None:
    """Token rotation as documented: the Secret is deleted, the RayCluster goes (suspend) and the children are ensured
    again. The new head starts with the new Secret's token, so the operator's next checkpoint request must carry that
    one, not the token it cached for the first cluster (a 401 there cost the checkpoint before a stop)."""
    from daedalus_operator import handlers as h
    from daedalus_operator import kube, resources
    from daedalus_operator.handlers import Runtime, job_view
    from daedalus_operator.metrics import OperatorMetrics
    from daedalus_operator.settings import OperatorSettings

    e = OperatorEnv(tmp_path, None, poll=0.3)
    e.start(operator=False, fake_kuberay=False)
    try:
        job = job_view(e.apply(e.job_manifest()))
        rt = Runtime(settings=OperatorSettings(control_port=e.control_port), metrics=OperatorMetrics(),
                     kube=kube.KubeAPI(kube.api_client_from_environment(str(e.kubeconfig))))
        secret = lambda: e.kube.get("v1/secrets", "ml", api.secret_name(job.name))  # noqa: E731
        h.ensure_children(rt, job)
        first = resources.secret_token(secret())
        assert h._token(rt, job) == first
        e.kube.delete("v1/secrets", "ml", api.secret_name(job.name))
        made = rt.children(job.uid)
        made.note_cluster(True)
        made.note_cluster(False)  # seen, then gone: every child is ensured again
        h.ensure_children(rt, job)
        second = resources.secret_token(secret())
        assert second != first and h._token(rt, job) == second
        # a Secret that exists already (409) and may have been replaced behind this process: read it again
        e.kube.delete("v1/secrets", "ml", api.secret_name(job.name))
        e.kube.create("v1/secrets", "ml", resources.build_secret(job, token="by-hand"))
        made.note_cluster(True)
        made.note_cluster(False)
        h.ensure_children(rt, job)
        assert h._token(rt, job) == "by-hand"
    finally:
        e.stop()


def test_a_status_this_operator_cannot_read_leaves_the_job_alone_and_says_why(env: OperatorEnv) -> None:
    """A status written by another operator version (here a phase this one does not know, which a newer CRD would
    admit): the operator neither reads it as empty (the job would look new) nor crashes on it in a loop; it acts on
    nothing (the RayCluster stays the same object), keeps the status as it is, posts one StatusUnreadable warning
    naming the field, and takes the job up again once the status is readable; the same problem coming back later is
    said again."""
    env.apply(env.job_manifest())
    env.wait_phase("Provisioning", timeout=30)
    rc = wait_for(lambda: env.kube.get("ray.io/v1/rayclusters", "ml", "local-tiny-ray"), timeout=30,
                  message="the RayCluster")
    env.kube.patch(RLTJ, "ml", "local-tiny", {"status": {"phase": "Preempted", "restarts": 2}}, status=True)
    reasons = env.wait_event_reasons("StatusUnreadable")
    time.sleep(2.0)  # ~6 timer ticks at poll 0.3 s: still one event, nothing changed
    assert env.event_reasons().count("StatusUnreadable") == 1, env.event_reasons()
    warning = next(e for e in env.events() if e.get("reason") == "StatusUnreadable")
    assert warning["type"] == "Warning" and "status.phase" in warning["message"] and "'Preempted'" in warning["message"]
    st = env.status()
    assert (st["phase"], st["restarts"]) == ("Preempted", 2)
    assert env.kube.get("ray.io/v1/rayclusters", "ml", "local-tiny-ray")["metadata"]["uid"] == rc["metadata"]["uid"]
    assert "StatusUnreadable" in reasons
    env.kube.patch(RLTJ, "ml", "local-tiny", {"status": {"phase": "Provisioning"}}, status=True)
    st = env.wait_status(lambda s: s.get("phase") == "Provisioning" and s.get("restarts") == 2 and any(
        c["type"] == "Reconciling" and c["status"] == "True" for c in s.get("conditions", [])), timeout=30,
        message="the job taken up again")
    assert env.kube.get("ray.io/v1/rayclusters", "ml", "local-tiny-ray")["metadata"]["uid"] == rc["metadata"]["uid"]
    # the same problem again after a reconcile read the status (~6 timer ticks later): said again
    time.sleep(2.0)
    env.kube.patch(RLTJ, "ml", "local-tiny", {"status": {"phase": "Preempted"}}, status=True)
    wait_for(lambda: env.event_reasons().count("StatusUnreadable") == 2, timeout=30, message="a second warning")


@pytest.mark.parametrize("phase", ["Preempted", ["Running"]], ids=["unknown-phase", "phase-not-a-string"])
def test_deleting_a_job_whose_phase_cannot_be_read_warns_and_is_not_held(env: OperatorEnv, phase: Any) -> None:
    """A job whose status phase this operator cannot read (a newer version's phase, which its CRD would admit; or a
    value of the wrong type, which only a status without schema could hold) is deleted at once: the finalizer does not
    know whether a trainer runs, so it asks none, says so in a Warning NoCheckpointBeforeDeletion naming the value,
    and deletes the children. Before, the unknown phase was logged at info as "no trainer runs" with no event, and the
    list raised TypeError in the finalizer, which kopf retried without end (the job never went)."""
    env.apply(env.job_manifest())
    wait_for(lambda: all(children(env).values()), timeout=30, message="children")
    env.kube.patch(RLTJ, "ml", "local-tiny", {"status": {"phase": phase, "submissionId": "local-tiny-x-a1",
                                                         "submissionConfirmed": True}}, status=True)
    env.wait_event_reasons("StatusUnreadable")  # the reconcile left it alone, as before
    t0 = time.monotonic()
    env.kube.delete(RLTJ, "ml", "local-tiny")
    wait_for(lambda: env.get_job() is None, timeout=30, message="the job to be gone")
    assert time.monotonic() - t0 < 15.0
    assert all(v is None for v in children(env).values())
    env.wait_event_reasons("NoCheckpointBeforeDeletion")
    warning = [e for e in env.events() if e.get("reason") == "NoCheckpointBeforeDeletion"]
    assert len(warning) == 1 and warning[0]["type"] == "Warning", warning
    assert "status.phase" in warning[0]["message"] and repr(phase) in warning[0]["message"], warning[0]["message"]


def test_a_child_name_held_by_another_object_is_reported_and_the_object_left_alone(tmp_path: Path) -> None:
    """The job's ConfigMap name is held by the ConfigMap of an earlier job of the same name (deleted and created
    again before the garbage collector caught up), its RayCluster name by someone's RayCluster without an owner:
    neither is changed or used (an object of another owner is never patched, nor submitted to). The job's
    Reconciling condition says what holds the name; once each is gone, the job's own children are made."""
    from daedalus_operator import resources
    from daedalus_operator.handlers import job_view
    from daedalus_operator.settings import OperatorSettings

    e = OperatorEnv(tmp_path, None, poll=0.3)
    e.start(operator=False, fake_kuberay=False)
    try:
        job = e.apply(e.job_manifest())
        uid = job["metadata"]["uid"]
        earlier = {"apiVersion": "daedalus.dev/v1alpha1", "kind": "RLTrainingJob", "name": "local-tiny",
                   "uid": "0f1e2d3c-0000-0000-0000-000000000000", "controller": True, "blockOwnerDeletion": True}
        e.kube.create("v1/configmaps", "ml", {"apiVersion": "v1", "kind": "ConfigMap", "data": {"old": "run"},
                                              "metadata": {"name": "local-tiny-config", "namespace": "ml",
                                                           "ownerReferences": [earlier]}})
        theirs = resources.build_raycluster(job_view(job), OperatorSettings(control_port=e.control_port))
        del theirs["metadata"]["ownerReferences"], theirs["metadata"]["labels"]
        e.kube.create("ray.io/v1/rayclusters", "ml", theirs)
        e.start_operator()

        def reconciling(fragment: str) -> dict | None:
            conds = {c["type"]: c for c in e.status().get("conditions") or []}
            c = conds.get("Reconciling")
            return c if c and fragment in c["message"] else None

        cond = wait_for(lambda: reconciling("ConfigMap ml/local-tiny-config"), timeout=30,
                        message="the condition naming the earlier job's ConfigMap")
        assert cond["status"] == "True" and cond["reason"] == "APIError"
        assert cond["message"] == (
            "EnsureChildren: ConfigMap ml/local-tiny-config belongs to an earlier RLTrainingJob local-tiny (uid "
            "0f1e2d3c-0000-0000-0000-000000000000) that Kubernetes' garbage collector has not deleted yet; waiting "
            "for it to go")
        time.sleep(1.0)  # a few more reconciles at poll 0.3 s
        assert e.kube.get("v1/configmaps", "ml", "local-tiny-config")["data"] == {"old": "run"}
        e.kube.delete("v1/configmaps", "ml", "local-tiny-config")  # the garbage collector's part

        cond = wait_for(lambda: reconciling("RayCluster ml/local-tiny-ray"), timeout=30,
                        message="the condition naming the foreign RayCluster")
        assert cond["message"] == (
            "EnsureChildren: RayCluster ml/local-tiny-ray exists and is not this job's (no owner reference): the "
            "operator neither changes nor uses another object; delete or rename it, or give the job another name")
        config = e.kube.get("v1/configmaps", "ml", "local-tiny-config")
        assert [r["uid"] for r in config["metadata"]["ownerReferences"]] == [uid]  # the job's own now
        time.sleep(1.0)
        still = e.kube.get("ray.io/v1/rayclusters", "ml", "local-tiny-ray")
        assert "ownerReferences" not in still["metadata"] and "labels" not in still["metadata"]
        assert e.status().get("submissionId") is None
        e.kube.delete("ray.io/v1/rayclusters", "ml", "local-tiny-ray")

        made = wait_for(lambda: (lambda c: c if all(c.values()) else None)(children(e)), timeout=30,
                        message="the job's own children")
        assert all([r["uid"] for r in obj["metadata"]["ownerReferences"]] == [uid] for obj in made.values())
        wait_for(lambda: None if reconciling("EnsureChildren") else True, timeout=30,
                 message="the condition to move on from the conflict")
    finally:
        e.stop()
