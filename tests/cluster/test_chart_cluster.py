"""The Helm chart on a real kube-apiserver 1.20: ``helm install`` with the real helm binary, the objects the server
stored, the chart's RBAC judged by the real RBAC authorizer for every call the operator makes, and the RBAC
demonstration: a chart with one verb removed from its ClusterRole makes the operator report the 403.

The chart is installed from a copy with ``kubeVersion`` relaxed (it requires >= 1.29) and ``--skip-crds`` (the
RLTrainingJob CRD is installed stripped of its CEL rules, which 1.20 does not know; see ``cluster_support``)."""

from __future__ import annotations

import json
import logging
import subprocess

import kopf
import pytest
import yaml
from cluster_support import (
    CHART,
    RELEASE,
    RELEASE_NAMESPACE,
    ChartOperator,
    Jobs,
    chart_for_1_20,
    example,
    helm,
    helm_install,
    may,
)
from daedalus_trainer.config import RLTrainingJobStatus, parse_job
from fake_kuberay import wait_for
from kubernetes import client

from daedalus_operator import api, resources
from daedalus_operator.plan import JobView
from daedalus_operator.settings import OperatorSettings

#: kind -> (group/version/plural key, namespaced) for the objects the chart renders with default values.
KINDS = {
    "ServiceAccount": ("v1/serviceaccounts", True),
    "ConfigMap": ("v1/configmaps", True),
    "Service": ("v1/services", True),
    "Deployment": ("apps/v1/deployments", True),
    "ClusterRole": ("rbac.authorization.k8s.io/v1/clusterroles", False),
    "ClusterRoleBinding": ("rbac.authorization.k8s.io/v1/clusterrolebindings", False),
}

#: Every (verb, group, resource, subresource) the operator needs, with where it comes from. Cluster-wide mode: the
#: chart's ClusterRole must grant each in any namespace.
OPERATOR_CALLS = [
    # kopf: watching the jobs (clusterwide list/watch), finalizer and progress annotations, events.
    ("list", "daedalus.dev", "rltrainingjobs", ""),
    ("watch", "daedalus.dev", "rltrainingjobs", ""),
    ("patch", "daedalus.dev", "rltrainingjobs", ""),
    ("create", "", "events", ""),
    # handlers.register: kopf indexes of pods, nodes, RayClusters and RayServices.
    *[(verb, group, resource, "") for verb in ("list", "watch")
      for group, resource in (("", "pods"), ("", "nodes"), ("ray.io", "rayclusters"), ("ray.io", "rayservices"))],
    # handlers.reconcile: fresh GET of the job, the status write (the liveness probe reads /version only).
    ("get", "daedalus.dev", "rltrainingjobs", ""),
    ("patch", "daedalus.dev", "rltrainingjobs", "status"),
    # handlers.ensure_children / execute: the children, the token read-back, the ConfigMap update.
    *[("create", group, resource, "") for group, resource in (
        ("", "configmaps"), ("", "secrets"), ("networking.k8s.io", "networkpolicies"),
        ("policy", "poddisruptionbudgets"), ("ray.io", "rayclusters"), ("ray.io", "rayservices"))],
    ("get", "", "configmaps", ""),
    ("patch", "", "configmaps", ""),
    ("get", "", "secrets", ""),
    # handlers.disruption_budget_once, execute(EnsureServing), handlers.finalize: an existing budget or RayService
    # is read back to check it is the job's.
    ("get", "policy", "poddisruptionbudgets", ""),
    ("get", "ray.io", "rayservices", ""),
    # handlers.ensure_network_policy: an existing policy's digest is read and, when outdated, patched.
    ("get", "networking.k8s.io", "networkpolicies", ""),
    ("patch", "networking.k8s.io", "networkpolicies", ""),
    # execute(DeleteCluster), execute(DeletePods): recovery deletes the cluster or the pods on replaced nodes.
    ("delete", "ray.io", "rayclusters", ""),
    ("delete", "", "pods", ""),
    # handlers.finalize: every child.
    *[("delete", group, resource, "") for group, resource in (
        ("ray.io", "rayservices"), ("networking.k8s.io", "networkpolicies"), ("policy", "poddisruptionbudgets"),
        ("", "configmaps"), ("", "secrets"))],
    ("get", "ray.io", "rayclusters", ""),
]
#: Calls the operator never makes and the chart must not grant (least privilege; also shows the review can say no).
NOT_GRANTED = [
    ("create", "daedalus.dev", "rltrainingjobs", ""),
    ("delete", "daedalus.dev", "rltrainingjobs", ""),
    ("create", "", "pods", ""),
    ("patch", "", "nodes", ""),
    ("create", "rbac.authorization.k8s.io", "clusterrolebindings", ""),
    ("patch", "ray.io", "rayclusters", "status"),
    # Secrets and ConfigMaps are read by name only: no listing or watching other workloads' credentials.
    *[(verb, "", resource, "") for verb in ("list", "watch") for resource in ("secrets", "configmaps")],
    ("patch", "", "secrets", ""),
    *[(verb, "", "services", "") for verb in ("get", "list", "watch", "create", "patch", "delete")],
    ("list", "networking.k8s.io", "networkpolicies", ""),
    # The PodDisruptionBudget is only created, read by name and deleted; recovery deletes pods, it never evicts them.
    *[(verb, "policy", "poddisruptionbudgets", "") for verb in ("list", "patch")],
    ("create", "", "pods", "eviction"),
    # Nothing PUTs (kopf and the operator's client write with PATCH), reads a /status subresource, patches a Ray
    # object, GETs a pod or node, patches an Event or uses events.k8s.io.
    ("update", "daedalus.dev", "rltrainingjobs", ""),
    ("update", "daedalus.dev", "rltrainingjobs", "status"),
    ("get", "daedalus.dev", "rltrainingjobs", "status"),
    *[(verb, "ray.io", resource, "") for verb in ("patch", "update") for resource in ("rayclusters", "rayservices")],
    ("get", "ray.io", "rayclusters", "status"),
    ("get", "", "pods", ""),
    ("get", "", "nodes", ""),
    ("patch", "", "events", ""),
    ("create", "events.k8s.io", "events", ""),
    ("get", "apiextensions.k8s.io", "customresourcedefinitions", ""),
]


def rule_verbs(role: dict, group: str, resource: str) -> set[str]:
    """Every verb a (Cluster)Role grants on ``group/resource``."""
    return {v for r in role["rules"] if group in r.get("apiGroups", []) and resource in r.get("resources", [])
            for v in r.get("verbs", [])}


def test_helm_install_stores_every_rendered_object(helm_binary, control_plane, release, admin):
    status = helm(helm_binary, control_plane, "status", RELEASE, "--namespace", RELEASE_NAMESPACE, "-o", "json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["info"]["status"] == "deployed"
    kinds = sorted(d["kind"] for d in release.manifest)
    assert set(kinds) == set(KINDS), kinds  # default values: no monitors, no peering objects
    for doc in release.manifest:
        key, namespaced = KINDS[doc["kind"]]
        stored = admin.get(key, RELEASE_NAMESPACE if namespaced else None, doc["metadata"]["name"])
        assert stored is not None, f"{doc['kind']}/{doc['metadata']['name']} not on the server"
        assert stored["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        if doc["kind"] == "ClusterRole":
            assert stored["rules"] == doc["rules"]  # nothing of the rules dropped by the server
    account = admin.get("v1/serviceaccounts", RELEASE_NAMESPACE, release.service_account)
    assert account["automountServiceAccountToken"] is False
    # cluster-scoped names carry the release's namespace: one release name may be installed in several namespaces
    binding = admin.get("rbac.authorization.k8s.io/v1/clusterrolebindings", None, f"daedalus-{RELEASE_NAMESPACE}")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": release.service_account,
                                    "namespace": RELEASE_NAMESPACE}]
    # the operator's arguments as stored: cluster-wide, its own namespace and pod labels for the NetworkPolicy
    assert "--all-namespaces" in release.args and "--standalone" in release.args
    assert f"--operator-namespace={RELEASE_NAMESPACE}" in release.args
    assert "--operator-pod-label=app.kubernetes.io/name=daedalus" in release.args


def test_chart_rbac_authorises_every_call_the_operator_makes_and_nothing_more(control_plane, release, namespace):
    with control_plane.api_client(release.kubeconfig) as sa:
        denied = [call for call in OPERATOR_CALLS if not may(sa, *call, namespace)]
        granted = [call for call in NOT_GRANTED if may(sa, *call, namespace)]
    assert denied == [], f"the chart's ServiceAccount may not: {denied}"
    assert granted == [], f"the chart's ServiceAccount may, without need: {granted}"


def test_a_verb_removed_from_the_cluster_role_is_reported_as_a_403_condition(
        helm_binary, control_plane, release, admin, namespace, tmp_path):
    """The RBAC demonstration as a test: the chart without ``create`` on rayclusters. The operator, running with that
    chart's ServiceAccount, creates what it may (ConfigMap, Secret, NetworkPolicy), is refused the RayCluster, and
    says so in the ``Reconciling`` condition (reason ``APIError``) instead of failing silently."""
    broken = chart_for_1_20(tmp_path / "chart", drop_verbs=(("rayclusters", "create"),))
    name = "daedalus-rbac-check"
    rel = helm_install(helm_binary, control_plane, broken, release=name, namespace=name)
    jobs = Jobs(admin, namespace)
    try:
        good = admin.get("rbac.authorization.k8s.io/v1/clusterroles", None, f"daedalus-{RELEASE_NAMESPACE}")
        bad = admin.get("rbac.authorization.k8s.io/v1/clusterroles", None, f"{name}-{name}")
        assert rule_verbs(good, "ray.io", "rayclusters") - rule_verbs(bad, "ray.io", "rayclusters") == {"create"}
        operator = ChartOperator(rel, tmp_path).start()
        try:
            jobs.create(example("local-tiny.yaml", namespace))
            st = jobs.wait_status("local-tiny", lambda s: {c["type"]: c for c in s.get("conditions") or []}
                                  .get("Reconciling", {}).get("reason") == "APIError", timeout=60,
                                  message="Reconciling=APIError")
            message = {c["type"]: c for c in st["conditions"]}["Reconciling"]["message"]
            logging.getLogger(__name__).warning("RBAC demonstration, Reconciling condition: %s", message)
            assert message.startswith("EnsureChildren: 403 Forbidden"), message
            assert f"system:serviceaccount:{name}:{rel.service_account}" in message
            assert 'cannot create resource "rayclusters"' in message
            assert st["phase"] == "Provisioning"
            for key, child in (("v1/configmaps", api.config_map_name("local-tiny")),
                               ("v1/secrets", api.secret_name("local-tiny")),
                               ("networking.k8s.io/v1/networkpolicies", api.network_policy_name("local-tiny"))):
                assert admin.get(key, namespace, child) is not None, child
            assert admin.get("ray.io/v1/rayclusters", namespace, api.raycluster_name("local-tiny")) is None
        finally:
            operator.stop()
    finally:
        jobs.release_finalizers()
        # No operator runs now, so the job goes at once. Left to the namespace's deletion, it lingered while the
        # namespace controller worked, and the next test's cluster-wide operator adopted it (finalizer, reconciles
        # refused in a terminating namespace, status writes that test_operator_cluster's quiet window counted).
        admin.delete("daedalus.dev/v1alpha1/rltrainingjobs", namespace, "local-tiny")
        wait_for(lambda: jobs.get("local-tiny") is None, timeout=10, message="the job to go")
        helm(helm_binary, control_plane, "uninstall", name, "--namespace", name)
        with control_plane.api_client() as api_client:
            client.CoreV1Api(api_client).delete_namespace(name)
    assert admin.get("rbac.authorization.k8s.io/v1/clusterroles", None, f"{name}-{name}") is None  # uninstalled


def test_a_namespaced_operator_with_no_jobs_stays_live(helm_binary, control_plane, namespace, tmp_path):
    """``operator.watchNamespaces``: the chart grants the jobs only in the watched namespace (a Role), so any
    cluster-wide call about them is 403. The liveness check, run with that release's ServiceAccount and no job to
    reconcile for longer than ``--liveness-stale``, must still pass: the API server answers, so a restart would not
    help (before, a cluster-wide list of jobs made it fail forever and the pod restart-looped)."""
    from daedalus_operator import kube
    from daedalus_operator.handlers import Runtime, liveness
    from daedalus_operator.metrics import OperatorMetrics

    name = "daedalus-namespaced"
    rel = helm_install(helm_binary, control_plane, chart_for_1_20(tmp_path / "chart"), release=name, namespace=name,
                       values={"operator": {"watchNamespaces": [namespace]}})
    try:
        assert f"--namespace={namespace}" in rel.args and "--all-namespaces" not in rel.args
        with control_plane.api_client(rel.kubeconfig) as sa:
            assert may(sa, "list", "daedalus.dev", "rltrainingjobs", "", namespace)
            assert not may(sa, "list", "daedalus.dev", "rltrainingjobs", "", None)
        settings = OperatorSettings(kubeconfig=str(rel.kubeconfig), liveness_stale=1.0)
        rt = Runtime(settings=settings, metrics=OperatorMetrics(),
                     kube=kube.KubeAPI(kube.api_client_from_environment(str(rel.kubeconfig))))
        rt.last_api_ok -= 600  # nothing answered for ten minutes: no job, so no reconcile refreshed it
        assert liveness(rt) == "ok"
        # and a server that does not answer at all still fails it
        nowhere = client.Configuration()
        nowhere.host = "https://127.0.0.1:1"  # nothing listens on port 1
        rt_down = Runtime(settings=settings, metrics=OperatorMetrics(),
                          kube=kube.KubeAPI(client.ApiClient(nowhere), timeout=2))
        rt_down.last_api_ok -= 600
        with pytest.raises(kopf.PermanentError):
            liveness(rt_down)
    finally:
        helm(helm_binary, control_plane, "uninstall", name, "--namespace", name)
        with control_plane.api_client() as api_client:
            client.CoreV1Api(api_client).delete_namespace(name)


def test_the_pod_monitor_scrapes_a_port_the_operator_gives_the_ray_head(helm_binary):
    """No server needed: the chart's PodMonitor names the trainer's port by name; that name must be one the
    operator puts on the head container (a renamed port would leave Prometheus with no target)."""
    proc = subprocess.run([helm_binary, "template", "rel", str(CHART), "--set", "metrics.podMonitor.enabled=true"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    job = parse_job(example("local-tiny.yaml", "ml"))
    view = JobView(name="local-tiny", namespace="ml", uid="6a1b2c3d-0000-4000-8000-000000000001", generation=1,
                   spec=job.spec, status=RLTrainingJobStatus())
    cluster = resources.build_raycluster(view, OperatorSettings())
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert endpoint["port"] in ports, (endpoint["port"], sorted(ports))
    assert ports[endpoint["port"]] == api.CONTROL_PORT
