"""The operator in the chart's namespaced mode (``operator.watchNamespaces``) against a real kube-apiserver 1.20,
running with exactly the credentials of that release's ServiceAccount: one Role per watched namespace and the
ClusterRole of cluster-scoped reads, judged by the real RBAC authorizer.

What this shows and the cluster-wide tests (``test_operator_cluster.py``) cannot: a job in each watched namespace is
reconciled through the Roles alone (children, status, events, the kopf indexes of pods, nodes and RayClusters with
the fake KubeRay, the finalizer on deletion); a job in a namespace not watched is not touched; and no call the
operator makes is refused: the API server's audit log has no 403 answer to it, and the
operator's log has no ERROR line and no line about a refused call. (kopf observes namespaces whenever it is not
cluster-wide, even for exact names: it lists and watches ``namespaces`` cluster-wide, and a 403 there is retried
nine times over ~54 s, each an ERROR line, before it falls back to the names given; the chart grants that list/watch
in namespaced mode, ``charts/daedalus/templates/rbac.yaml``.)
"""

from __future__ import annotations

import collections
import logging
import re
import time
import uuid

import pytest
from cluster_support import (
    ChartOperator,
    ClusterKubeRay,
    Jobs,
    KubeREST,
    chart_for_1_20,
    example,
    free_port,
    helm,
    helm_install,
    may,
    wait_for,
)
from kubernetes import client

from daedalus_operator import api, kube

TINY = "local-tiny.yaml"
#: The four children of a job: (group/version/plural, name helper).
CHILDREN = [("v1/configmaps", api.config_map_name), ("v1/secrets", api.secret_name),
            ("networking.k8s.io/v1/networkpolicies", api.network_policy_name),
            ("ray.io/v1/rayclusters", api.raycluster_name)]
#: Loggers of the test harness, not the operator (``fake_kuberay.log``).
HARNESS_LOGGERS = ("fake-kuberay",)
#: A log line about a refused call: kopf's "Not enough permissions to ...", an APIForbiddenError or "403 Forbidden".
REFUSAL = re.compile(r"forbidden|permission|\b403\b", re.IGNORECASE)


def children(admin: KubeREST, namespace: str, job: str) -> dict[str, dict | None]:
    return {f"{key.split('/')[-1]}/{fn(job)}": admin.get(key, namespace, fn(job)) for key, fn in CHILDREN}


@pytest.fixture
def more_namespaces(control_plane, kube_api):
    """``make(n)``: ``n`` more fresh namespaces like conftest's ``namespace`` (deleted afterwards)."""
    core = client.CoreV1Api(kube_api)
    made: list[str] = []

    def make(n: int) -> list[str]:
        names = [f"t-{uuid.uuid4().hex[:8]}" for _ in range(n)]
        for name in names:
            core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
            made.append(name)
        for name in names:
            control_plane.wait_default_service_account(name, time.monotonic() + 30)
        return names

    yield make
    for name in made:
        core.delete_namespace(name)


def test_a_namespaced_operator_reconciles_only_its_namespaces_with_the_charts_roles(
        helm_binary, control_plane, admin, namespace, more_namespaces, tmp_path, caplog):
    """``operator.watchNamespaces=[A, B]``, the operator with that release's ServiceAccount token; jobs in A, B and
    C. A's and B's are reconciled (A's deleted through its finalizer, B's taken to a submitted Ray job by the fake
    KubeRay), C's is not touched, the API server refused none of the operator's requests, and its log is clean."""
    watched_b, unwatched = more_namespaces(2)
    watched = [namespace, watched_b]
    name = "daedalus-ns-mode"
    jobs = {ns: Jobs(admin, ns) for ns in (*watched, unwatched)}
    fake: ClusterKubeRay | None = None
    operator: ChartOperator | None = None
    node = f"{namespace}-a"
    try:
        rel = helm_install(helm_binary, control_plane, chart_for_1_20(tmp_path / "chart"), release=name,
                           namespace=name, values={"operator": {"watchNamespaces": watched}})
        # the chart's namespaced mode as stored: exact names, a Role and RoleBinding per watched namespace only
        assert [a for a in rel.args if a.startswith("--namespace")] == [f"--namespace={ns}" for ns in watched]
        assert "--all-namespaces" not in rel.args
        roles = {(d["kind"], d["metadata"].get("namespace")) for d in rel.manifest if d["kind"] in ("Role",
                                                                                                  "RoleBinding")}
        assert roles == {(k, ns) for k in ("Role", "RoleBinding") for ns in watched}
        with control_plane.api_client(rel.kubeconfig) as sa:  # the real authorizer: jobs only where watched
            assert [may(sa, "list", "daedalus.dev", "rltrainingjobs", "", ns) for ns in (*watched, unwatched)] == [
                True, True, False]
            # kopf's namespace observation: list and watch, nothing more (see the chart's rbac.yaml)
            assert [may(sa, verb, "", "namespaces", "", None) for verb in ("list", "watch", "get", "patch")] == [
                True, True, False, False]
        caplog.set_level(logging.INFO)
        started = time.monotonic()
        operator = ChartOperator(rel, tmp_path).start()
        fake = ClusterKubeRay(admin, dashboard_port=free_port(), volume_root=operator.volumes).start()
        made = {ns: jobs[ns].create(example(TINY, ns)) for ns in (*watched, unwatched)}
        for ns in watched:
            # provisioned through the Role: children owned by the job, the finalizer, an Event, the status
            st = jobs[ns].wait_status("local-tiny", lambda s: s.get("phase") == "Provisioning" and
                                      s.get("rayClusterName"), timeout=90, message="Provisioning")
            if ns == namespace:
                first_status = time.monotonic() - started
            assert st["rayClusterName"] == api.raycluster_name("local-tiny") and st["observedGeneration"] == 1
            got = wait_for(lambda: (lambda c: c if all(c.values()) else None)(children(admin, ns, "local-tiny")),
                           timeout=30, message=f"the children of {ns}/local-tiny")
            for key, obj in got.items():
                assert obj["metadata"]["ownerReferences"][0]["uid"] == made[ns]["metadata"]["uid"], key
            assert api.FINALIZER in jobs[ns].get("local-tiny")["metadata"]["finalizers"]
            assert "Provisioning" in [e["reason"] for e in jobs[ns].events("local-tiny")]
        logging.getLogger(__name__).warning("namespaced operator: first job status %.1f s after the start",
                                            first_status)
        # 2 s here; kopf refused the namespace list served nothing for its ~54 s of retries (57 s measured)
        assert first_status < 30.0, first_status
        # deletion in a watched namespace (no Ray job submitted yet: no node for its pods): the finalizer deletes
        # the children through the Role and lets go
        admin.delete(kube.RLTJ, namespace, "local-tiny")
        wait_for(lambda: jobs[namespace].get("local-tiny") is None, timeout=40, message="the job to be deleted")
        assert not any(children(admin, namespace, "local-tiny").values())
        # the other watched job: a node for its pods; the pods, nodes and RayClusters indexes (kopf watches through
        # the Role and the ClusterRole) show the cluster ready, and the Ray job's submission id is recorded
        fake.add_node(node)
        jobs[watched_b].wait_status("local-tiny", lambda s: s.get("submissionId"), timeout=60,
                                    message="a submission id")
        # the job outside the watched namespaces: untouched (no status, finalizer, kopf annotation, child, event)
        other = jobs[unwatched].get("local-tiny")
        assert other["metadata"]["resourceVersion"] == made[unwatched]["metadata"]["resourceVersion"]
        assert not other.get("status") and not other["metadata"].get("finalizers")
        assert not any(children(admin, unwatched, "local-tiny").values())
        assert jobs[unwatched].events("local-tiny") == []
        operator.stop()
        operator = None
        # no call the operator made was refused (kube-apiserver's audit log of its requests) ...
        user = f"system:serviceaccount:{name}:{rel.service_account}"
        audited = control_plane.audit_events(user)
        # the audit log does see the operator's requests: its status writes are there
        assert any(e["verb"] == "patch" and e["objectRef"].get("subresource") == "status" for e in audited), audited
        refused = collections.Counter(f'{e["verb"]} {e["requestURI"].split("?")[0]}' for e in audited
                                      if e["responseStatus"]["code"] == 403)
        assert refused == {}, f"requests of {user} refused with 403 (how many): {dict(refused)}"
        # ... and its log says nothing is wrong. Every record but the test's own and the fake KubeRay's is the
        # operator's (kopf, daedalus_operator, its HTTP clients). The fake plays KubeRay for the whole cluster: in a
        # namespace of an earlier test still being deleted it is refused new pods (403 "being terminated").
        lines = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in caplog.records
                 if r.levelno >= logging.WARNING and r.name not in (HARNESS_LOGGERS + (__name__,))]
        errors = [line for line in lines if line.startswith(("ERROR", "CRITICAL"))]
        refusals = [line for line in lines if REFUSAL.search(line)]
        assert errors == [] and refusals == [], "\n".join(lines)
    finally:
        if operator is not None:
            operator.stop()
        if fake is not None:
            fake.stop()
        for ns in (*watched, unwatched):
            jobs[ns].release_finalizers()
            # No operator runs now, so the job goes at once. Left to the namespace's deletion it would linger, and
            # the next file's cluster-wide operator would adopt it (its status writes break that file's quiet
            # window; df9f8aa, test_chart_cluster.py).
            admin.delete("daedalus.dev/v1alpha1/rltrainingjobs", ns, "local-tiny")
            wait_for(lambda ns=ns: jobs[ns].get("local-tiny") is None, timeout=10, message=f"the job in {ns} to go")
            for pod in admin.list("v1/pods", ns):  # no kubelet: complete their deletion so the namespace can go
                admin.force_delete("v1/pods", ns, pod["metadata"]["name"])
        if admin.get("v1/nodes", None, node):
            admin.delete("v1/nodes", None, node)
        helm(helm_binary, control_plane, "uninstall", name, "--namespace", name)
        with control_plane.api_client() as api_client:
            client.CoreV1Api(api_client).delete_namespace(name)
