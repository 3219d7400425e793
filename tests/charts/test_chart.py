"""The Helm chart, rendered by the real `helm` binary: lint, schema, RBAC, security, monitors, CRD identity.

Every rendered built-in object is checked with `kubernetes-validate --strict` (unknown fields rejected) against the
oldest and newest Kubernetes minor the chart claims (Chart.yaml kubeVersion >= 1.29; EKS 1.35). prometheus-operator
objects (ServiceMonitor, PodMonitor, PrometheusRule) are validated with the typed models of
`cloudcoil-models-prometheus-operator` plus a round-trip check that catches unknown fields; kopf's peering objects
(kopf.dev) have a schema-less CRD and are only checked for their identity fields.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from chartlib import CHART, REPO, Helm, by_kind, missing_tool, one

import kubernetes_validate  # noqa: E402  (test extra)

K8S_VERSIONS = ("1.29.0", "1.35.0")
NAMESPACES = ["team-a", "team-b"]
MONITORING = {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
              "prometheusRule": {"enabled": True}}
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced": {"operator": {"watchNamespaces": NAMESPACES}},
    "cluster-all-on": {"operator": {"peering": {"enabled": True}}, **MONITORING,
                       "dashboards": {"annotations": {"grafana_folder": "Daedalus"}}},
    "namespaced-all-on": {"operator": {"watchNamespaces": NAMESPACES, "peering": {"enabled": True, "priority": 10},
                                       "logLevel": "debug", "extraArgs": ["--poll-interval=5"]},
                          "metrics": {**MONITORING["metrics"], "prometheusNamespaces": ["monitoring"]},
                          "prometheusRule": {"enabled": True},
                          "image": {"digest": "sha256:" + "ab" * 32},
                          "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}},
                          "tolerations": [{"key": "sagemaker.amazonaws.com/node-health-status",
                                           "operator": "Exists", "effect": "NoSchedule"}]},
}

# The operator's API footprint (issue 6; keep in sync with operator/daedalus_operator). (group, resource) -> verbs.
# kopf lists, watches, PATCHes and POSTs core/v1 Events; the operator's client GETs, POSTs, PATCHes and DELETEs.
# Nothing PUTs (update), reads a /status subresource, GETs a pod or node, or uses events.k8s.io.
NAMESPACED_RULES = {
    ("daedalus.dev", "rltrainingjobs"): {"get", "list", "watch", "patch"},
    ("daedalus.dev", "rltrainingjobs/status"): {"patch"},
    ("daedalus.dev", "rltrainingjobs/finalizers"): {"update"},   # blockOwnerDeletion (OwnerReferencesPermission...)
    ("ray.io", "rayclusters"): {"get", "list", "watch", "create", "delete"},
    ("ray.io", "rayservices"): {"get", "list", "watch", "create", "delete"},
    ("", "configmaps"): {"get", "create", "patch", "delete"},
    ("", "secrets"): {"get", "create", "delete"},
    ("", "pods"): {"list", "watch", "delete"},
    ("", "events"): {"create"},
    ("networking.k8s.io", "networkpolicies"): {"get", "create", "patch", "delete"},
    ("policy", "poddisruptionbudgets"): {"get", "create", "delete"},
}
CLUSTER_RULES = {
    ("", "nodes"): {"list", "watch"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
}
# Namespaced mode only: kopf lists and watches namespaces at the cluster scope whenever it is not cluster-wide, exact
# names included (refused, it retries each 403 for ~54 s, an ERROR line each, before serving the names given;
# tests/cluster/test_namespaced_operator_cluster.py). A cluster-wide kopf never asks.
NAMESPACE_OBSERVATION = {("", "namespaces"): {"list", "watch"}}
PEERING_VERBS = {"get", "list", "watch", "patch"}


@pytest.fixture(scope="module")
def rendered(chart: Helm) -> dict[str, list[dict[str, Any]]]:
    return {name: chart.template(values) for name, values in VARIANTS.items()}


def rule_table(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    """Flatten a Role/ClusterRole's rules to {(apiGroup, resource): verbs}; rejects wildcards and name/URL rules."""
    table: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {field}: {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                table.setdefault((group, resource), set()).update(rule["verbs"])
    return table


# --- lint and schema --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_helm_lint_strict(chart: Helm, variant: str) -> None:
    proc = chart.run("lint", "--strict", str(CHART), values=VARIANTS[variant])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def _schema_node(schema: dict[str, Any], path: list[str]) -> dict[str, Any] | None:
    node = schema
    for key in path:
        props = node.get("properties", {})
        if key in props:
            node = props[key]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return None
    return node


def _leaf_paths(value: Any, prefix: list[str]) -> list[list[str]]:
    if isinstance(value, dict) and value:
        return [p for k, v in value.items() for p in _leaf_paths(v, prefix + [k])]
    return [prefix]


def test_schema_covers_every_value_and_forbids_unknown_keys() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = [".".join(p) for p in _leaf_paths(values, []) if _schema_node(schema, p) is None]
    assert not missing, f"values without a schema: {missing}"

    def walk(node: dict[str, Any], where: str) -> None:
        if "properties" in node:
            assert node.get("additionalProperties") is False, f"{where or '<root>'} allows unknown keys"
            for key, sub in node["properties"].items():
                walk(sub, f"{where}.{key}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key], f"{where}[{key}]")
        for key in ("oneOf", "anyOf"):
            for i, sub in enumerate(node.get(key, [])):
                walk(sub, f"{where}<{key}{i}>")

    walk(schema, "")
    # Every value in values.yaml is valid under the schema (helm also checks this when rendering).
    import jsonschema
    jsonschema.validate(values, schema)


@pytest.mark.parametrize("values, message", [
    ({"operatr": {}}, "operatr"),                                           # misspelt top-level key
    ({"operator": {"watchNamespace": ["a"]}}, "watchNamespace"),            # misspelt nested key
    ({"operator": {"watchNamespaces": ["Team_A"]}}, "watchNamespaces"),     # not a DNS-1123 label
    ({"operator": {"watchNamespaces": ["ml-*"]}}, "watchNamespaces"),       # a Role needs an exact namespace
    ({"operator": {"logLevel": "trace"}}, "logLevel"),
    ({"securityContext": {"runAsUser": 0}}, "runAsUser"),                   # root is not allowed
    ({"metrics": {"serviceMonitor": {"interval": "30 seconds"}}}, "interval"),
    ({"prometheusRule": {"alerts": {"DaedalusJobFaild": {"for": "5m"}}}}, "DaedalusJobFaild"),
    ({"prometheusRule": {"alerts": {"DaedalusJobFailed": {"severity": "page"}}}}, "severity"),
    ({"image": {"digest": "latest"}}, "digest"),
])
def test_schema_rejects_bad_values(chart: Helm, values: dict[str, Any], message: str) -> None:
    assert message in chart.template_error(values)


def test_the_health_and_metrics_ports_must_differ(chart: Helm) -> None:
    """kopf's liveness endpoint and the metrics server bind separately: one port for both fails at the operator's
    start (address in use), so the chart refuses it when rendering."""
    err = chart.template_error({"operator": {"healthPort": 9090, "metricsPort": 9090}})
    assert "operator.healthPort and operator.metricsPort are both 9090" in err
    chart.template({"operator": {"healthPort": 9091, "metricsPort": 9090}})  # distinct ports render


def test_servicemonitor_requires_the_service(chart: Helm) -> None:
    err = chart.template_error({"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}})
    assert "needs metrics.service.enabled" in err


# --- Kubernetes validity ----------------------------------------------------------------------------------------

def _validate_monitoring(doc: dict[str, Any]) -> None:
    try:
        from cloudcoil.models.prometheus_operator import v1
    except ImportError:
        missing_tool("cloudcoil-models-prometheus-operator not installed: cannot validate "
                     f"{doc['kind']} (pip install cloudcoil-models-prometheus-operator==0.80.1.0)")
    model = getattr(v1, doc["kind"]).model_validate(doc)
    # The models ignore unknown fields; a lossless round trip proves there were none (and no type coercion).
    assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == doc


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_objects_are_valid(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    docs = rendered[variant]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service", "ConfigMap"} <= kinds
    for doc in docs:
        group = doc["apiVersion"].rpartition("/")[0]
        if group == "monitoring.coreos.com":
            _validate_monitoring(doc)
        elif group == "kopf.dev":
            # kopf's peering CRD is schema-less (x-kubernetes-preserve-unknown-fields): nothing more to validate.
            assert doc["apiVersion"] == "kopf.dev/v1" and doc["kind"] in {"ClusterKopfPeering", "KopfPeering"}
            assert set(doc) == {"apiVersion", "kind", "metadata"}
        else:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)


def test_every_namespaced_object_has_a_namespace(rendered: dict[str, list[dict[str, Any]]]) -> None:
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering", "CustomResourceDefinition"}
    for docs in rendered.values():
        for doc in docs:
            if doc["kind"] not in cluster_scoped:
                assert doc["metadata"].get("namespace"), f"{doc['kind']} {doc['metadata']['name']}"


# --- CRD ---------------------------------------------------------------------------------------------------------

def test_chart_crd_is_the_generated_crd(chart: Helm) -> None:
    source = REPO / "crds" / "rltrainingjob.yaml"
    copy = CHART / "crds" / "rltrainingjob.yaml"
    assert copy.exists(), "charts/daedalus/crds/rltrainingjob.yaml missing: run `make crds`"
    assert copy.read_bytes() == source.read_bytes(), "chart CRD differs from crds/rltrainingjob.yaml: run `make crds`"
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == ["rltrainingjob.yaml"]
    docs = chart.template({}, "--include-crds")
    crd = one(docs, "CustomResourceDefinition")
    assert crd["metadata"]["name"] == "rltrainingjobs.daedalus.dev"
    assert crd["spec"]["group"] == "daedalus.dev"
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(crd, version, strict=True)
    # Without --include-crds the CRD is not a template (Helm installs crds/ once and never upgrades it).
    assert not by_kind(chart.template({}), "CustomResourceDefinition")


# --- operator Deployment -------------------------------------------------------------------------------------------

def test_deployment_defaults(rendered: dict[str, list[dict[str, Any]]]) -> None:
    dep = one(rendered["defaults"], "Deployment")
    spec = dep["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert pod["serviceAccountName"] == one(rendered["defaults"], "ServiceAccount")["metadata"]["name"]

    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/daedalus-rl/daedalus-operator:0.1.0"     # tag defaults to appVersion
    assert container["command"] == ["daedalus", "operator"]
    assert container["args"] == ["--liveness=http://0.0.0.0:8080/healthz", "--metrics-port=9090",
                                 "--standalone", "--all-namespaces", "--operator-namespace=daedalus",
                                 "--operator-pod-label=app.kubernetes.io/component=operator",
                                 "--operator-pod-label=app.kubernetes.io/instance=rel",
                                 "--operator-pod-label=app.kubernetes.io/name=daedalus"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": 8080, "metrics": 9090}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["resources"]["requests"] == {"cpu": "100m", "memory": "384Mi"}
    assert container["resources"]["limits"] == {"cpu": "1", "memory": "1Gi"}

    # Pod Security Standards "restricted".
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    csc = container["securityContext"]
    assert csc["runAsNonRoot"] is True
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["privileged"] is False
    assert csc["capabilities"] == {"drop": ["ALL"]}
    assert csc["seccompProfile"] == {"type": "RuntimeDefault"}
    # The read-only root filesystem needs a writable /tmp.
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}} in pod["volumes"]


def test_deployment_args_follow_values(rendered: dict[str, list[dict[str, Any]]]) -> None:
    dep = one(rendered["namespaced-all-on"], "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["--liveness=http://0.0.0.0:8080/healthz", "--metrics-port=9090",
                                 "--peering=daedalus", "--priority=10", "--namespace=team-a", "--namespace=team-b",
                                 "--operator-namespace=daedalus",
                                 "--operator-pod-label=app.kubernetes.io/component=operator",
                                 "--operator-pod-label=app.kubernetes.io/instance=rel",
                                 "--operator-pod-label=app.kubernetes.io/name=daedalus",
                                 "--metrics-namespace=monitoring", "--verbose", "--poll-interval=5"]
    assert container["image"] == "ghcr.io/daedalus-rl/daedalus-operator@sha256:" + "ab" * 32
    assert dep["spec"]["template"]["spec"]["tolerations"][0]["key"] == "sagemaker.amazonaws.com/node-health-status"
    sa = one(rendered["namespaced-all-on"], "ServiceAccount")
    assert sa["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}


def test_api_wait_ends_inside_the_liveness_probe_window(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """An unreachable API server: the operator gives up after --api-wait seconds and logs why. That must happen before
    the kubelet, probing /healthz (served only once kopf runs), restarts the container, or the reason is never
    logged. The kubelet restarts it at the failure threshold's probe: initial delay + (threshold - 1) x period; the
    operator's last try can add one API request timeout (2 x --request-timeout)."""
    from daedalus_operator import main
    dep = one(rendered["defaults"], "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    probe = container["livenessProbe"]
    restart_after = probe["initialDelaySeconds"] + (probe["failureThreshold"] - 1) * probe["periodSeconds"]
    assert restart_after == 50  # 10 + 2 x 20 s with the chart's defaults
    args = main.build_parser().parse_args(container["args"])
    assert args.api_wait == main.API_WAIT_SECONDS == 30.0
    assert args.api_wait + 2 * args.request_timeout < restart_after


def test_the_liveness_check_answers_inside_the_probe_timeout(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Both probes GET /healthz, whose check waits up to LIVENESS_API_TIMEOUT for the API server; with a server that
    drops packets, a check slower than the probe's timeoutSeconds would fail every probe and restart the pod after
    ~60 s, long before --liveness-stale (120 s) means it to. kopf adds its own handler overhead: keep 2 s spare."""
    from daedalus_operator.handlers import LIVENESS_API_TIMEOUT

    dep = one(rendered["defaults"], "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz"
        assert LIVENESS_API_TIMEOUT + 2 <= container[probe]["timeoutSeconds"], probe


def _container_env(container: dict[str, Any], pod_name: str, namespace: str) -> dict[str, str]:
    """The container's environment as the kubelet resolves it (values, and the pod's name and namespace)."""
    fields = {"metadata.name": pod_name, "metadata.namespace": namespace}
    env = {}
    for var in container["env"]:
        env[var["name"]] = var["value"] if "value" in var else fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def test_kopf_names_the_operator_after_its_pod_whatever_uid_it_runs_as(rendered: dict[str, list[dict[str, Any]]],
                                                                      tmp_path: Path) -> None:
    """kopf builds the operator's identity (peering, logs) from $POD_ID, else from getpass.getuser(), which raises
    KeyError for a uid without a passwd entry. securityContext.runAsUser may be any non-root uid, not only the
    image's 10001: kopf's identity detection, run in the container's environment as a uid the system does not know
    (a user namespace), must name the pod."""
    import shutil
    import subprocess
    import sys

    unshare = shutil.which("unshare")
    if not unshare:
        pytest.skip("unshare (util-linux) not installed")
    uid = 54321
    probe = subprocess.run([unshare, "--user", f"--map-user={uid}", f"--map-group={uid}", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no user namespaces here: {probe.stderr.strip()}")
    import pwd
    with pytest.raises(KeyError):
        pwd.getpwuid(uid)  # the point: a uid without a passwd entry
    dep = one(rendered["defaults"], "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    env = _container_env(container, "rel-daedalus-5d8f7c9b6-x2k4q", "daedalus")
    env["HOME"] = str(tmp_path)
    code = "from kopf._core.engines import peering; print(peering.detect_own_id(manual=False))"
    proc = subprocess.run([unshare, "--user", f"--map-user={uid}", f"--map-group={uid}", sys.executable, "-c", code],
                          env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "rel-daedalus-5d8f7c9b6-x2k4q"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_deployment_args_parse_with_the_operator_cli(rendered: dict[str, list[dict[str, Any]]], variant: str) -> None:
    """The rendered command line is accepted by the operator's own argument parser and means what the values say;
    the pod labels it passes are the operator pod's, so each job's NetworkPolicy admits this operator."""
    from daedalus_operator import main
    dep = one(rendered[variant], "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["daedalus", "operator"]
    args = main.build_parser().parse_args(container["args"])
    values = VARIANTS[variant]
    operator_values = values.get("operator", {})
    assert args.namespace == operator_values.get("watchNamespaces", [])
    assert args.all_namespaces is (not operator_values.get("watchNamespaces"))
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    assert args.metrics_port == 9090
    peering = operator_values.get("peering", {}).get("enabled", False)
    assert (args.peering, args.standalone) == (("daedalus", False) if peering else (None, True))
    assert args.operator_namespace == dep["metadata"]["namespace"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    selector = dict(label.split("=", 1) for label in args.operator_pod_label)
    assert selector and selector.items() <= pod_labels.items()
    assert selector == dep["spec"]["selector"]["matchLabels"]
    assert args.metrics_namespace == values.get("metrics", {}).get("prometheusNamespaces", [])
    assert args.verbose is (operator_values.get("logLevel") == "debug")


# --- RBAC -----------------------------------------------------------------------------------------------------------

def test_rbac_cluster_wide(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["defaults"]
    assert not by_kind(docs, "Role") and not by_kind(docs, "RoleBinding")
    role = one(docs, "ClusterRole")
    assert rule_table(role) == {**NAMESPACED_RULES, **CLUSTER_RULES}
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    sa = one(docs, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}]


def test_rbac_namespaced_keeps_only_cluster_scoped_reads_cluster_wide(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["namespaced"]
    assert rule_table(one(docs, "ClusterRole")) == {**CLUSTER_RULES, **NAMESPACE_OBSERVATION}
    roles = by_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == NAMESPACES
    for role in roles:
        assert rule_table(role) == NAMESPACED_RULES
    bindings = {b["metadata"]["namespace"]: b for b in by_kind(docs, "RoleBinding")}
    assert sorted(bindings) == NAMESPACES
    sa = one(docs, "ServiceAccount")["metadata"]
    for role in roles:
        binding = bindings[role["metadata"]["namespace"]]
        assert binding["roleRef"]["kind"] == "Role" and binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": "daedalus"}]


def test_rbac_peering(rendered: dict[str, list[dict[str, Any]]]) -> None:
    cluster = rendered["cluster-all-on"]
    assert rule_table(one(cluster, "ClusterRole")) == {
        **NAMESPACED_RULES, **CLUSTER_RULES, ("kopf.dev", "clusterkopfpeerings"): PEERING_VERBS}
    assert one(cluster, "ClusterKopfPeering")["metadata"]["name"] == "daedalus"
    namespaced = rendered["namespaced-all-on"]
    assert rule_table(one(namespaced, "ClusterRole")) == {**CLUSTER_RULES, **NAMESPACE_OBSERVATION}
    for role in by_kind(namespaced, "Role"):
        assert rule_table(role) == {**NAMESPACED_RULES, ("kopf.dev", "kopfpeerings"): PEERING_VERBS}
    assert sorted(p["metadata"]["namespace"] for p in by_kind(namespaced, "KopfPeering")) == NAMESPACES
    assert not by_kind(rendered["defaults"], "ClusterKopfPeering")


def test_two_releases_of_one_name_in_two_namespaces_claim_no_common_object(chart: Helm) -> None:
    """One namespaced operator per team, each `helm install daedalus -n <team>`: every cluster-scoped object the two
    releases create has a name of its own (helm refuses to adopt an object another release owns)."""
    names = {}
    for team in ("team-a", "team-b"):
        docs = chart.template({"operator": {"watchNamespaces": [team]}}, namespace=team)
        names[team] = {(d["kind"], d["metadata"]["name"]) for d in docs
                       if d["kind"] in ("ClusterRole", "ClusterRoleBinding")}
        role = one(docs, "ClusterRole")["metadata"]["name"]
        assert role == f"rel-daedalus-{team}"
        assert one(docs, "ClusterRoleBinding")["roleRef"]["name"] == role
    assert len(names["team-a"]) == 2 and not names["team-a"] & names["team-b"]


def test_a_63_character_fullname_gives_valid_distinct_names(chart: Helm) -> None:
    """`fullnameOverride` may have 63 characters (the values schema's limit): the objects named after it with a
    suffix (the metrics Service, the trainers' PodMonitor, one ConfigMap per dashboard) are cut to fit a DNS label
    without losing the suffix, so they stay distinct."""
    full = "daedalus-operator-ml-platform-production-us-west-2-cluster-aaaa"
    assert len(full) == 63
    docs = chart.template({"fullnameOverride": full, "metrics": {"podMonitor": {"enabled": True}}})
    named = [(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] != "CustomResourceDefinition"]
    assert all(len(n) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", n) for k, n in named
               if k not in ("ClusterRole", "ClusterRoleBinding")), named
    assert len(set(named)) == len(named)
    service = one(docs, "Service")["metadata"]["name"]
    assert service.endswith("-metrics") and service.startswith(full[:40])
    dashboards = [n for k, n in named if k == "ConfigMap" and "-dashboard-" in n]
    assert len(dashboards) >= 2 and len(set(dashboards)) == len(dashboards)
    assert one(docs, "PodMonitor")["metadata"]["name"].endswith("-trainers")


def test_rbac_can_be_left_to_the_platform(chart: Helm) -> None:
    docs = chart.template({"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "ops"}})
    assert not {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount"} & {d["kind"] for d in docs}
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    assert "serviceAccount.name is required" in chart.template_error({"serviceAccount": {"create": False}})


# --- metrics, monitors, rules, dashboards --------------------------------------------------------------------------

def test_metrics_service_selects_the_operator(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["defaults"]
    svc = one(docs, "Service")
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert not {"ServiceMonitor", "PodMonitor", "PrometheusRule"} & {d["kind"] for d in docs}


def test_servicemonitor_and_podmonitor(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["cluster-all-on"]
    svc = one(docs, "Service")
    sm = one(docs, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True
    assert {"action": "replace", "targetLabel": "job", "replacement": "daedalus-operator"} in endpoint["relabelings"]

    pm = one(docs, "PodMonitor")
    assert pm["spec"]["selector"] == {"matchExpressions": [{"key": "daedalus.dev/job", "operator": "Exists"}]}
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "trainer-metrics" and endpoint["honorLabels"] is True
    namespaced = one(rendered["namespaced-all-on"], "PodMonitor")
    assert namespaced["spec"]["namespaceSelector"] == {"matchNames": NAMESPACES}


def test_prometheusrule_is_rules_yaml(rendered: dict[str, list[dict[str, Any]]]) -> None:
    source = yaml.safe_load((CHART / "files" / "rules.yaml").read_text())
    rule = one(rendered["cluster-all-on"], "PrometheusRule")
    assert rule["spec"] == source


def test_prometheusrule_overrides(chart: Helm) -> None:
    values = {
        "prometheusRule": {"enabled": True, "alerts": {
            "DaedalusJobFailed": {"enabled": False},
            "DaedalusJobNoProgress": {"for": "55m", "severity": "critical", "labels": {"team": "ml"}},
            "DaedalusJobRestartingOften": {"expr": "max by (namespace, job) (increase(daedalus_operator_job_restarts[1h])) > 5",
                                           "annotations": {"runbook_url": "https://runbooks.example/restarts"}},
        }},
        "metrics": {"serviceMonitor": {"jobLabel": "ops/daedalus"}},
    }
    spec = one(chart.template(values), "PrometheusRule")["spec"]
    alerts = {r["alert"]: r for g in spec["groups"] for r in g["rules"] if "alert" in r}
    assert "DaedalusJobFailed" not in alerts
    assert alerts["DaedalusJobNoProgress"]["for"] == "55m"
    assert alerts["DaedalusJobNoProgress"]["labels"] == {"severity": "critical", "team": "ml"}
    assert alerts["DaedalusJobRestartingOften"]["expr"].endswith("> 5")
    assert alerts["DaedalusJobRestartingOften"]["annotations"]["runbook_url"] == "https://runbooks.example/restarts"
    assert "summary" in alerts["DaedalusJobRestartingOften"]["annotations"]
    # The operator's scrape job name follows metrics.serviceMonitor.jobLabel.
    assert 'up{job="ops/daedalus"}' in alerts["DaedalusOperatorDown"]["expr"]
    assert "daedalus-operator" not in alerts["DaedalusOperatorDown"]["expr"]


def test_dashboard_configmaps(rendered: dict[str, list[dict[str, Any]]]) -> None:
    files = sorted((CHART / "dashboards").glob("*.json"))
    assert [f.name for f in files] == ["operator.json", "training.json"]
    cms = by_kind(rendered["cluster-all-on"], "ConfigMap")
    assert len(cms) == len(files)
    for cm, path in zip(sorted(cms, key=lambda c: c["metadata"]["name"]), files):
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "Daedalus"}
        (key, text), = cm["data"].items()
        assert key == f"daedalus-{path.stem}.json"
        assert json.loads(text) == json.loads(path.read_text())


def test_operator_dashboard_follows_the_scrape_job_label(chart: Helm) -> None:
    """The "Operator up" panel queries the scrape job the chart's ServiceMonitor names (jobLabel), like the alert."""
    docs = chart.template({"dashboards": {"enabled": True}, "metrics": {"serviceMonitor": {"jobLabel": "ops/daedalus"}}})
    cm = next(c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard-operator"))
    exprs = [t["expr"] for p in json.loads(cm["data"]["daedalus-operator.json"])["panels"] for t in p.get("targets", [])]
    assert 'sum(up{job="ops/daedalus"})' in exprs
    assert not any('job="daedalus-operator"' in e for e in exprs)


def test_dashboards_can_go_to_grafanas_namespace(chart: Helm) -> None:
    docs = chart.template({"dashboards": {"namespace": "monitoring"}})
    assert {cm["metadata"]["namespace"] for cm in by_kind(docs, "ConfigMap")} == {"monitoring"}
    assert not by_kind(chart.template({"dashboards": {"enabled": False}}), "ConfigMap")


def test_notes_render(chart: Helm) -> None:
    proc = chart.run("install", "rel", str(CHART), "--dry-run=client", "--namespace", "daedalus",
                     values={"operator": {"watchNamespaces": NAMESPACES}, **MONITORING})
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "watches RLTrainingJobs in: team-a, team-b" in notes
    assert "ServiceMonitor rel-daedalus scrapes the operator" in notes
    assert "resource.customizations.health.daedalus.dev_RLTrainingJob" in notes
    example = yaml.safe_load((REPO / "examples" / "hyperpod-qwen3vl-8b.yaml").read_text())["metadata"]
    assert f"kubectl -n {example['namespace']} get rltj -w" in notes  # the example's namespace, not the default
    assert f"kubectl -n {example['namespace']} describe rltj {example['name']}" in notes


@pytest.mark.parametrize("off, alert", [("serviceMonitor", "DaedalusOperatorDown"),
                                        ("podMonitor", "DaedalusJobNoProgress")])
def test_notes_warn_when_an_alert_has_nothing_scraped(chart: Helm, off: str, alert: str) -> None:
    """With the alerts on and a monitor off, the alert that reads that monitor's metrics fires for ever unless the
    user scrapes the target another way: the notes say so; with both monitors on they say nothing of it."""
    values = {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
              "prometheusRule": {"enabled": True}, "operator": {"watchNamespaces": NAMESPACES}}
    values["metrics"][off]["enabled"] = False
    values["metrics"]["prometheusNamespaces"] = ["monitoring"]

    def notes(v: dict) -> str:
        proc = chart.run("install", "rel", str(CHART), "--dry-run=client", "--namespace", "daedalus", values=v)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split("NOTES:", 1)[1]

    warned = [line for line in notes(values).splitlines() if "WARNING" in line]
    assert len(warned) == 1 and alert in warned[0], warned
    values["metrics"][off]["enabled"] = True
    assert "WARNING" not in notes(values)
