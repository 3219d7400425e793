"""Manifest builders against the real schemas: KubeRay v1.7.0 RayCluster/RayService CRDs (jsonschema on
openAPIV3Schema, with unknown fields rejected as the API server's strict field validation does) and the built-in kinds
with kubernetes-validate --strict."""

from __future__ import annotations

import base64
import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from daedalus_trainer.config import RLTrainingJobStatus, parse_job
from jobs import set_spec_fields
from kuberay import KUBERAY_CRDS

from daedalus_operator import api, resources as r
from daedalus_operator.plan import JobView
from daedalus_operator.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = KUBERAY_CRDS
K8S_VERSION = "1.30.0"
SETTINGS = OperatorSettings(operator_namespace="daedalus-system")


def strict(schema: Any) -> Any:
    """Reject unknown fields like ``kubectl apply --validate=strict``: every object schema that lists properties and
    does not preserve unknown fields gets ``additionalProperties: false``."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def kuberay_validator(filename: str) -> jsonschema.Draft4Validator:
    crd = yaml.load((KUBERAY / filename).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft4Validator(schema)


@pytest.fixture(scope="module")
def raycluster_schema() -> jsonschema.Draft4Validator:
    return kuberay_validator("ray.io_rayclusters.yaml")


@pytest.fixture(scope="module")
def rayservice_schema() -> jsonschema.Draft4Validator:
    return kuberay_validator("ray.io_rayservices.yaml")


def errors(validator: jsonschema.Draft4Validator, obj: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def view(example: str, name: str | None = None, **patch: Any) -> JobView:
    doc = yaml.safe_load((ROOT / "examples" / example).read_text())
    doc["metadata"].setdefault("namespace", "default")
    if name:
        doc["metadata"]["name"] = name
    set_spec_fields(doc["spec"], **patch)
    job = parse_job(doc)
    return JobView(name=job.metadata.name, namespace=job.metadata.namespace, uid="6a1b2c3d-0000-4000-8000-000000000001",
                   generation=3, spec=job.spec, status=RLTrainingJobStatus())


HYPERPOD = "hyperpod-qwen3vl-8b.yaml"
TINY = "local-tiny.yaml"
LONG = "x" * 62 + "y"


@pytest.mark.parametrize("example,name", [(TINY, None), (HYPERPOD, None), (HYPERPOD, LONG)])
def test_raycluster_validates_against_kuberay(raycluster_schema, example: str, name: str | None) -> None:
    rc = r.build_raycluster(view(example, name), SETTINGS)
    assert errors(raycluster_schema, rc) == []
    assert len(rc["metadata"]["name"]) <= 53 and api.is_dns_label(rc["metadata"]["name"])


#: core/v1 ContainerPort.name: an IANA_SVC_NAME (k8s.io/apimachinery/pkg/util/validation IsValidPortName): at most 15
#: lowercase letters, digits and single hyphens, at least one letter. The OpenAPI schema cannot say it; the API server
#: rejects the pod (a RayCluster is accepted, then KubeRay fails to create its pods).
IANA_SVC_NAME = re.compile(r"^(?=.{1,15}$)(?=.*[a-z])[a-z0-9]+(-[a-z0-9]+)*$")


def pod_templates(obj: dict) -> list[dict]:
    spec = obj["spec"].get("rayClusterConfig", obj["spec"])
    return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]


@pytest.mark.parametrize("example", [TINY, HYPERPOD])
def test_pod_templates_are_valid_pods(example: str) -> None:
    job = view(example, serving__enabled=True)
    for obj in (r.build_raycluster(job, SETTINGS), r.build_rayservice(job, "s3://b/exports")):
        for template in pod_templates(obj):
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": dict(template["metadata"], name="p"),
                   "spec": template["spec"]}
            kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
            for container in template["spec"]["containers"]:
                for port in container.get("ports", []):
                    assert IANA_SVC_NAME.match(port["name"]), port["name"]


def test_port_name_rule_is_real() -> None:
    assert not IANA_SVC_NAME.match("daedalus-metrics")  # 16 characters: the API server says "must be no more than 15"
    assert IANA_SVC_NAME.match("trainer-metrics") and not IANA_SVC_NAME.match("a--b") and not IANA_SVC_NAME.match("80")


def test_strict_schema_catches_a_misspelled_field(raycluster_schema) -> None:
    rc = r.build_raycluster(view(TINY), SETTINGS)
    bad = copy.deepcopy(rc)
    bad["spec"]["headGroupSpec"]["rayStartParam"] = bad["spec"]["headGroupSpec"].pop("rayStartParams")
    assert any("rayStartParam" in e for e in errors(raycluster_schema, bad))
    bad = copy.deepcopy(rc)
    bad["spec"]["workerGroupSpecs"][0]["replicas"] = "one"
    assert any("replicas" in e for e in errors(raycluster_schema, bad))


def test_raycluster_hyperpod_shape() -> None:
    job = view(HYPERPOD)
    rc = r.build_raycluster(job, SETTINGS)
    meta = rc["metadata"]
    assert meta["name"] == "maze-qwen3vl-8b-ray" and meta["namespace"] == "ml-training"
    assert meta["labels"][api.JOB_LABEL] == "maze-qwen3vl-8b"
    assert meta["ownerReferences"] == [{"apiVersion": "daedalus.dev/v1alpha1", "kind": "RLTrainingJob",
                                        "name": "maze-qwen3vl-8b", "uid": job.uid, "controller": True,
                                        "blockOwnerDeletion": True}]
    assert rc["spec"]["rayVersion"] == "2.60.0"
    head = rc["spec"]["headGroupSpec"]
    assert head["rayStartParams"] == {"num-cpus": "0", "dashboard-host": "0.0.0.0"}
    hpod = head["template"]["spec"]
    hc = hpod["containers"][0]
    assert api.GPU_RESOURCE not in hc["resources"]["limits"] and hc["resources"]["limits"]["cpu"] == "8"
    ports = {p["name"]: p["containerPort"] for p in hc["ports"]}
    assert ports["trainer-metrics"] == 9400 and ports["dashboard"] == 8265
    mounts = {m["name"]: m["mountPath"] for m in hc["volumeMounts"]}
    assert mounts == {"shared": "/fsx", "config": "/etc/daedalus"}
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in hc["env"]}
    assert env["DAEDALUS_CONTROL_TOKEN"] == {"secretKeyRef": {"name": "maze-qwen3vl-8b-control", "key": "token"}}
    assert "DAEDALUS_CONTROL_TOKEN_FILE" not in env
    # Ray token authentication in every Ray container, with the job Secret's token (the operator sends the same)
    secret = {"secretKeyRef": {"name": "maze-qwen3vl-8b-control", "key": "token"}}
    for pod in [hpod] + [g["template"]["spec"] for g in rc["spec"]["workerGroupSpecs"]]:
        ray_env = {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["containers"][0]["env"]}
        assert ray_env["RAY_AUTH_MODE"] == "token" and ray_env["RAY_AUTH_TOKEN"] == secret
    assert head["template"]["metadata"]["labels"] == {api.JOB_LABEL: "maze-qwen3vl-8b"}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "sagemaker.amazonaws.com/node-health-status", "operator": "DoesNotExist"}]},
        {"matchExpressions": [{"key": "sagemaker.amazonaws.com/node-health-status", "operator": "In",
                               "values": ["Schedulable"]}]}]}}}
    assert hpod["affinity"] == affinity

    (wg,) = rc["spec"]["workerGroupSpecs"]
    assert (wg["groupName"], wg["replicas"], wg["minReplicas"], wg["maxReplicas"]) == ("p5", 2, 2, 2)
    wpod = wg["template"]["spec"]
    wc = wpod["containers"][0]
    assert wc["resources"]["limits"] == {"cpu": "180", "memory": "1800Gi", "nvidia.com/gpu": 8,
                                         "vpc.amazonaws.com/efa": 32}
    assert wc["resources"]["requests"] == wc["resources"]["limits"]
    vols = {v["name"]: v for v in wpod["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "256Gi"}
    assert vols["shared"]["persistentVolumeClaim"] == {"claimName": "fsx-claim"}
    assert {m["name"]: m["mountPath"] for m in wc["volumeMounts"]} == {"shared": "/fsx", "dshm": "/dev/shm"}
    assert wpod["nodeSelector"] == {"node.kubernetes.io/instance-type": "ml.p5.48xlarge"}
    assert wpod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert wpod["affinity"] == affinity
    assert wg["template"]["metadata"]["labels"] == {api.JOB_LABEL: "maze-qwen3vl-8b"}


def test_raycluster_tiny_shape() -> None:
    rc = r.build_raycluster(view(TINY), SETTINGS)
    (wg,) = rc["spec"]["workerGroupSpecs"]
    wpod = wg["template"]["spec"]
    assert wpod["containers"][0]["resources"]["limits"] == {"cpu": "2", "memory": "8Gi"}
    assert "affinity" not in wpod and "nodeSelector" not in wpod  # hyperPod: false, no instance type
    assert {v["name"] for v in wpod["volumes"]} == {"dshm"}  # no checkpoint.volume: local paths


def test_shared_mount_path() -> None:
    assert r.shared_mount_path(view(HYPERPOD).spec) == "/fsx"
    assert r.shared_mount_path(view(HYPERPOD, model__path="/models/x", model__sftAdapter=None).spec) == \
        "/fsx/daedalus/checkpoints"


@pytest.mark.parametrize("example", [TINY, HYPERPOD])
def test_builtin_kinds_validate_strictly(example: str) -> None:
    job = view(example)
    for obj in (r.build_config_map(job), r.build_secret(job), r.build_network_policy(job, SETTINGS),
                r.build_disruption_budget(job)):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        assert obj["metadata"]["ownerReferences"][0]["uid"] == job.uid
        assert obj["metadata"]["labels"][api.JOB_LABEL] == job.name


def matches(selector: dict, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions In/NotIn/Exists/DoesNotExist) against a pod's labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if not {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[op]:
            return False
    return True


@pytest.mark.parametrize("example", [TINY, HYPERPOD])
def test_the_disruption_budget_holds_every_training_pod_and_no_serving_pod(example: str) -> None:
    """The PodDisruptionBudget's selector against the labels KubeRay gives the pods (the template's, plus
    ``ray.io/cluster`` with the RayCluster's name; a RayService's RayCluster is named ``<rayservice>-<suffix>``)."""
    job = view(example, serving__enabled=True)
    pdb = r.build_disruption_budget(job)
    rc = r.build_raycluster(job, SETTINGS)
    # every pod KubeRay makes of the RayCluster: the head and each worker group's replicas (local-tiny 1 + 1,
    # the HyperPod example 1 + 2)
    assert pdb["spec"]["minAvailable"] == 1 + sum(g["replicas"] for g in rc["spec"]["workerGroupSpecs"]) \
        == {TINY: 2, HYPERPOD: 3}[example]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert pdb["metadata"]["name"] == api.disruption_budget_name(job.name)
    training = [dict(t["metadata"]["labels"], **{api.RAY_CLUSTER_LABEL: rc["metadata"]["name"]})
                for t in pod_templates(rc)]
    rs = r.build_rayservice(job, "s3://b/exports")
    serving = [dict(t["metadata"]["labels"], **{api.RAY_CLUSTER_LABEL: rs["metadata"]["name"] + "-raycluster-x1"})
               for t in pod_templates(rs)]
    assert len(training) == 1 + len(rc["spec"]["workerGroupSpecs"]) and serving
    assert all(matches(pdb["spec"]["selector"], labels) for labels in training), training
    assert not any(matches(pdb["spec"]["selector"], labels) for labels in serving), serving
    # another job's pods in the same namespace are not held either
    other = r.build_raycluster(view(example, name="other"), SETTINGS)
    assert not any(matches(pdb["spec"]["selector"], dict(t["metadata"]["labels"],
                                                         **{api.RAY_CLUSTER_LABEL: other["metadata"]["name"]}))
                   for t in pod_templates(other))


def test_builtin_validation_is_real() -> None:
    cm = r.build_config_map(view(TINY))
    cm["data"]["config.json"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(cm, K8S_VERSION, strict=True)


def test_config_map_holds_the_resolved_job() -> None:
    job = view(TINY)
    cm = r.build_config_map(job)
    doc = json.loads(cm["data"]["config.json"])
    assert doc["metadata"] == {"name": "local-tiny", "namespace": "default", "uid": job.uid}
    assert doc["spec"]["algorithm"]["klCoef"] == 0.0  # a default the YAML does not spell
    assert doc["spec"]["checkpoint"]["intervalSteps"] == 5
    # the trainer reads back the same spec, but for the operator's fields, which it reads as their defaults: a field
    # the operator adds there never reaches an older trainer image (which would refuse it)
    assert sorted(doc["spec"]) == ["algorithm", "checkpoint", "environment", "lora", "model", "sft"]
    read = parse_job(doc).spec
    assert read.model_dump(exclude=set(r.OPERATOR_ONLY_FIELDS)) == job.spec.model_dump(
        exclude=set(r.OPERATOR_ONLY_FIELDS))
    assert read.cluster == type(job.spec.cluster)() and read.serving == type(job.spec.serving)()
    assert r.build_config_map(job) == cm  # stable bytes: no needless updates


def test_secret_token_is_random_and_round_trips() -> None:
    job = view(TINY)
    a, b = r.build_secret(job), r.build_secret(job)
    ta, tb = r.secret_token(a), r.secret_token(b)
    assert ta != tb and len(base64.urlsafe_b64decode(ta + "=")) == 32
    assert r.secret_token(r.build_secret(job, token="fixed")) == "fixed"
    assert a["type"] == "Opaque" and a["metadata"]["name"] == "local-tiny-control"


def test_network_policy_admits_only_the_operator_to_dashboard_and_control() -> None:
    job = view(TINY)
    settings = OperatorSettings(operator_namespace="ops", control_port=9400, metrics_namespaces=("monitoring",))
    np = r.build_network_policy(job, settings)
    spec = np["spec"]
    assert spec["podSelector"] == {"matchLabels": {api.JOB_LABEL: "local-tiny"}}
    assert spec["policyTypes"] == ["Ingress"]
    own, op, prom = spec["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {api.JOB_LABEL: "local-tiny"}}}]}
    assert op["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
                           "podSelector": {"matchLabels": {"app.kubernetes.io/name": "daedalus"}}}]
    assert sorted(p["port"] for p in op["ports"]) == [8265, 9400]
    assert [p["port"] for p in prom["ports"]] == [9400]
    kubernetes_validate.validate(np, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", [None, LONG])
def test_rayservice_validates_and_serves_the_adapter(rayservice_schema, name: str | None) -> None:
    job = view(HYPERPOD, name, serving__enabled=True)
    rs = r.build_rayservice(job, "s3://fsx-export/daedalus/checkpoints/ml-training/maze-qwen3vl-8b/exports/")
    assert errors(rayservice_schema, rs) == []
    assert len(rs["metadata"]["name"]) <= 36 and api.is_dns_label(rs["metadata"]["name"])
    app = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]
    assert app["import_path"] == "ray.serve.llm:build_openai_app"
    (llm,) = app["args"]["llm_configs"]
    assert llm["model_loading_config"] == {"model_id": "Qwen/Qwen3-VL-8B-Instruct",
                                           "model_source": "/fsx/models/Qwen3-VL-8B-Instruct"}
    assert llm["lora_config"]["dynamic_lora_loading_path"] == \
        "s3://fsx-export/daedalus/checkpoints/ml-training/maze-qwen3vl-8b/exports"
    assert llm["engine_kwargs"]["max_lora_rank"] == 32 and llm["engine_kwargs"]["enable_lora"] is True
    cluster = rs["spec"]["rayClusterConfig"]
    wpod = cluster["workerGroupSpecs"][0]["template"]["spec"]
    assert wpod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {m["mountPath"] for m in wpod["containers"][0]["volumeMounts"]} == {"/fsx", "/dev/shm"}
    # serving pods are not selected by the training job's NetworkPolicy
    assert api.JOB_LABEL not in cluster["headGroupSpec"]["template"]["metadata"]["labels"]
    assert r.serving_request_model(job) == "Qwen/Qwen3-VL-8B-Instruct:adapter"


def test_head_placement_and_service_account_reach_training_and_serving_pods(raycluster_schema,
                                                                            rayservice_schema) -> None:
    """cluster.head.nodeSelector/tolerations place both heads (on a cluster of tainted GPU nodes an untolerating head
    stays Pending); cluster.serviceAccountName reaches the serving pods too (they read the adapter from S3 through
    IRSA). Without the head fields, the head pods carry neither."""
    taint = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    job = view(HYPERPOD, serving__enabled=True, cluster__serviceAccountName="trainer-irsa",
               cluster__head__nodeSelector={"node.kubernetes.io/instance-type": "ml.m5.4xlarge"},
               cluster__head__tolerations=taint)
    rc = r.build_raycluster(job, SETTINGS)
    rs = r.build_rayservice(job, "s3://bucket/exports/")
    assert errors(raycluster_schema, rc) == [] and errors(rayservice_schema, rs) == []
    heads = [rc["spec"]["headGroupSpec"]["template"]["spec"],
             rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]]
    for pod in heads:
        assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "ml.m5.4xlarge"}
        assert pod["tolerations"] == taint and pod["serviceAccountName"] == "trainer-irsa"
    serve_worker = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert serve_worker["serviceAccountName"] == "trainer-irsa"
    assert serve_worker["nodeSelector"] == {"node.kubernetes.io/instance-type": "ml.p5.48xlarge"}  # the GPU group's
    plain = view(HYPERPOD, serving__enabled=True)
    for pod in (r.build_raycluster(plain, SETTINGS)["spec"]["headGroupSpec"]["template"]["spec"],
                r.build_rayservice(plain, "s3://b/e/")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]):
        assert not {"nodeSelector", "tolerations", "serviceAccountName"} & set(pod)


def test_rayservice_rejects_a_local_lora_path() -> None:
    with pytest.raises(ValueError, match="object storage only"):
        r.build_rayservice(view(HYPERPOD, serving__enabled=True), "/fsx/daedalus/checkpoints/exports")


def test_builders_refuse_an_invalid_spec() -> None:
    job = view(TINY)
    bad = JobView(name=job.name, namespace=job.namespace, uid=job.uid, generation=1, spec=None,
                  status=RLTrainingJobStatus(), spec_errors=(("spec.x", "bad"),))
    with pytest.raises(ValueError, match="invalid spec"):
        r.build_raycluster(bad, SETTINGS)


# ------------------------------------------------------------------------------------------------ the control token
TRAINER_USER = re.search(r"^USER (\d+):(\d+)", (ROOT / "Dockerfile.trainer").read_text(), re.M)


def _kubelet_start(pod: dict, container: dict, objects: dict[tuple[str, str], dict], root: Path) -> dict[str, str]:
    """Materialise ``container`` of ``pod`` as a kubelet does, under ``root``: Secret and ConfigMap volumes become files
    owned by root:root with the volume's ``defaultMode`` (0644 when unset; with ``securityContext.fsGroup`` the group
    is the fsGroup and group-read is added), mounted at ``root/<mountPath>``; ``env`` with ``valueFrom`` resolved from
    ``objects`` (``(kind, name) -> body``). Returns the container's environment (paths under a mount rewritten to
    ``root``)."""
    import os

    fs_group = (pod.get("securityContext") or {}).get("fsGroup")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {}
    for m in container.get("volumeMounts", []):
        vol = volumes[m["name"]]
        if "secret" in vol:
            src, files = vol["secret"], {k: base64.b64decode(v) for k, v in
                                         objects[("Secret", vol["secret"]["secretName"])]["data"].items()}
        elif "configMap" in vol:
            src, files = vol["configMap"], {k: v.encode() for k, v in
                                            objects[("ConfigMap", vol["configMap"]["name"])]["data"].items()}
        else:
            continue
        target = root / m["mountPath"].lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        for d in [target, *target.parents]:
            if d == root.parent:
                break
            d.chmod(0o755)
        mode = src.get("defaultMode", 0o644)
        for key, data in files.items():
            f = target / key
            f.write_bytes(data)
            os.chown(f, 0, fs_group if fs_group is not None else 0)
            f.chmod(mode | (0o040 if fs_group is not None else 0))
        mounts[m["mountPath"]] = str(target)
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            value = e["value"]
            for path, local in mounts.items():
                if value.startswith(path.rstrip("/") + "/"):
                    value = local + value[len(path.rstrip("/")):]
            env[e["name"]] = value
        else:
            ref = e["valueFrom"].get("secretKeyRef")
            assert ref, f"only secretKeyRef is emulated: {e}"
            env[e["name"]] = base64.b64decode(objects[("Secret", ref["name"])]["data"][ref["key"]]).decode()
    return env


def _as_user(uid: int, gid: int, env: dict[str, str], cwd: Path) -> str | None:
    """``load_control_token(env)`` in a forked child that dropped to ``uid:gid`` (no supplementary groups, so no
    capability overrides file modes); its answer comes back through a pipe."""
    import os

    from daedalus_trainer.server import load_control_token

    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(rfd)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.chdir(cwd)
            os.write(wfd, json.dumps(load_control_token(env)).encode())
        finally:
            os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() != 0,
                    reason="needs root to play the kubelet (root-owned files) and to run as the trainer's uid")
def test_the_trainer_process_can_read_the_control_token_as_the_image_user(tmp_path) -> None:
    """The head container as a kubelet would start it (files owned by root with the volume's mode, env resolved from
    the Secret), then the real ``load_control_token`` in a process running as the trainer image's ``USER`` (10001,
    no fsGroup in the pod): it must get the job's token, or every POST /checkpoint and /stop answers 503."""
    import tempfile

    assert TRAINER_USER, "Dockerfile.trainer has no numeric USER uid:gid"
    uid, gid = int(TRAINER_USER.group(1)), int(TRAINER_USER.group(2))
    job = view(HYPERPOD)
    secret = r.build_secret(job, token="tok-123")
    cm = r.build_config_map(job)
    hpod = r.build_raycluster(job, SETTINGS)["spec"]["headGroupSpec"]["template"]["spec"]
    root = Path(tempfile.mkdtemp(prefix="kubelet-", dir="/tmp"))
    try:
        root.chmod(0o755)
        env = _kubelet_start(hpod, hpod["containers"][0],
                             {("Secret", secret["metadata"]["name"]): secret,
                              ("ConfigMap", cm["metadata"]["name"]): cm}, root)
        assert _as_user(uid, gid, env, root) == "tok-123"
    finally:
        import shutil
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ node affinity
@pytest.mark.parametrize("health", [None, *[v.value for v in api.NodeHealthStatus], "Unknown", ""])
def test_ray_pods_may_go_exactly_where_the_operator_judges_a_node_schedulable(health: str | None) -> None:
    """The RayCluster's required node affinity (judged by the test scheduler's matchExpressions, Kubernetes
    semantics: terms ORed, expressions ANDed) agrees with ``nodes.node_schedulable`` for every HyperPod health value,
    a value HyperPod may add later (or an empty one) and a node without the label (plain EKS): a Ray pod must neither
    wait forever on a node the operator considers fine nor land on one it would move it off."""
    from fake_kuberay import fits, node_body

    from daedalus_operator.nodes import node_schedulable

    node = node_body("n1", health=health)
    rc = r.build_raycluster(view(HYPERPOD), SETTINGS)
    pods = [rc["spec"]["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in rc["spec"]["workerGroupSpecs"]]
    for spec in pods:
        spec = {**spec, "nodeSelector": None, "tolerations": None}  # only the affinity is under test here
        assert fits(spec, node) == node_schedulable(node, hyperpod=True), (health, spec.get("affinity"))
    assert fits(pods[0], node) == (health in (None, "Schedulable"))


@pytest.mark.parametrize("ray_version, token_auth", [("2.60.0", True), ("2.52.0", True), ("v2.52", True),
                                                     ("2.53.0rc1", True), ("2.52rc1", True), ("3.0", True),
                                                     ("2.51.1", False), ("2.9.3", False), ("02.52", False),
                                                     ("V2.52", False), ("2", False), ("nightly", False)])
def test_rayservice_dashboard_has_kuberay_managed_token_auth_from_ray_2_52(rayservice_schema, ray_version: str,
                                                                          token_auth: bool) -> None:
    """The serving RayService asks KubeRay (>= 1.5.1) for Ray token authentication (``authOptions.mode: token``)
    when the image's Ray has it; KubeRay refuses the option below Ray 2.52 or for a version it cannot parse
    (ValidateRayClusterSpec), so those RayServices go without it, as an old Ray ignores RAY_AUTH_MODE."""
    job = view(HYPERPOD, serving__enabled=True, cluster__rayVersion=ray_version)
    rs = r.build_rayservice(job, "s3://bucket/exports/")
    assert errors(rayservice_schema, rs) == []
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray_version
    assert cluster.get("authOptions") == ({"mode": "token"} if token_auth else None)
    assert r.supports_ray_token_auth(ray_version) is token_auth


# ------------------------------------------------------------------------------------------------ autoscalers
@pytest.mark.parametrize("example", [TINY, HYPERPOD])
def test_training_pods_ask_node_autoscalers_to_keep_their_nodes_and_serving_pods_do_not(example: str) -> None:
    """Every training pod template (head and each worker group) carries Karpenter's ``do-not-disrupt`` and Cluster
    Autoscaler's ``safe-to-evict: "false"`` (string values, as annotations must be); the serving RayService's pods
    carry neither: a serving replica may move."""
    job = view(example, serving__enabled=True)
    rc = r.build_raycluster(job, SETTINGS)
    training = [rc["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in rc["spec"]["workerGroupSpecs"]]
    assert len(training) == 1 + len(job.spec.cluster.worker_groups)
    for template in training:
        assert template["metadata"]["annotations"] == {"karpenter.sh/do-not-disrupt": "true",
                                                       "cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}
        assert template["metadata"]["labels"] == {api.JOB_LABEL: job.name}
    training[0]["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] = "5m"  # a copy per pod template
    assert training[1]["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    for template in pod_templates(r.build_rayservice(job, "s3://bucket/exports/")):
        assert "annotations" not in template["metadata"]


# ------------------------------------------------------------------------------------------------ Pod Security
def ray_pod_specs(job: JobView) -> dict[str, dict]:
    """The pod specs KubeRay makes for ``job``'s RayCluster and serving RayService (:func:`kuberay_pod_spec`), by
    ``<object kind>/<group>``."""
    from pod_security import kuberay_pod_spec

    specs = {}
    for obj in (r.build_raycluster(job, SETTINGS), r.build_rayservice(job, "s3://bucket/exports/")):
        spec = obj["spec"].get("rayClusterConfig", obj["spec"])
        specs[f"{obj['kind']}/head"] = kuberay_pod_spec(spec["headGroupSpec"]["template"]["spec"], worker=False)
        for group in spec["workerGroupSpecs"]:
            specs[f"{obj['kind']}/{group['groupName']}"] = kuberay_pod_spec(group["template"]["spec"], worker=True)
    return specs


@pytest.mark.parametrize("example", [TINY, HYPERPOD])
def test_ray_pods_meet_the_restricted_pod_security_level_by_default(example: str) -> None:
    """Every pod of a job (training head and workers, serving head and workers, with the init container KubeRay adds
    to workers) is admitted in a namespace that enforces ``restricted``, the default ``cluster.podSecurity``."""
    from pod_security import restricted_violations

    job = view(example, serving__enabled=True)
    assert job.spec.cluster.pod_security == "restricted"
    specs = ray_pod_specs(job)
    groups = [g.name for g in job.spec.cluster.worker_groups]
    assert sorted(specs) == sorted(["RayCluster/head", *(f"RayCluster/{g}" for g in groups), "RayService/head",
                                    "RayService/serve"])
    assert {name: restricted_violations(spec) for name, spec in specs.items()} == {name: [] for name in specs}
    for name, spec in specs.items():
        assert spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}, name
        init = [c["name"] for c in spec.get("initContainers", [])]
        assert init == ([] if name.endswith("/head") else ["wait-gcs-ready"]), name
        for container in spec["containers"] + spec.get("initContainers", []):
            assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                    "capabilities": {"drop": ["ALL"]}}, (name, container["name"])
    # the builders hand out copies: a change to one pod's context is not a change to another's
    rc = r.build_raycluster(job, SETTINGS)
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    head["securityContext"]["runAsUser"] = 0
    head["containers"][0]["securityContext"]["capabilities"]["drop"].clear()
    assert r.RESTRICTED_POD_SECURITY == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    worker = rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert worker["securityContext"] == r.RESTRICTED_POD_SECURITY
    assert worker["containers"][0]["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_baseline_ray_pods_set_no_security_context_and_meet_only_baseline() -> None:
    """``cluster.podSecurity: baseline`` (an image that runs as root) leaves every securityContext out: the pods meet
    the baseline level, and the restricted level's four container controls name each container."""
    from pod_security import baseline_violations, restricted_violations

    specs = ray_pod_specs(view(HYPERPOD, serving__enabled=True, cluster__podSecurity="baseline"))
    for name, spec in specs.items():
        containers = [f"initContainer {c['name']}" for c in spec.get("initContainers", [])] + \
            [f"container {c['name']}" for c in spec["containers"]]
        assert "securityContext" not in spec and not any("securityContext" in c for c in spec["containers"]), name
        assert baseline_violations(spec) == [], name
        assert restricted_violations(spec) == [v for where in containers for v in (
            f"Privilege Escalation: {where} does not set allowPrivilegeEscalation false",
            f"Running as Non-root: {where} runAsNonRoot is not true (pod or container)",
            f"Seccomp: {where} has no RuntimeDefault or Localhost profile (pod or container)",
            f"Capabilities: {where} does not drop ALL")], name


def test_the_pod_security_checks_catch_each_control() -> None:
    """The oracle itself: a pod that breaks one control at a time is named for exactly that control."""
    from pod_security import baseline_violations, restricted_violations

    good = ray_pod_specs(view(TINY, serving__enabled=True))["RayCluster/cpu"]
    assert restricted_violations(good) == []

    def broken(change) -> list[str]:
        spec = copy.deepcopy(good)
        change(spec)
        return restricted_violations(spec)

    ray = "container ray-worker"
    assert broken(lambda s: s.update(hostNetwork=True)) == ["Host Namespaces: hostNetwork is true"]
    assert broken(lambda s: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}})) == [
        "HostPath Volumes: volume h", "Volume Types: volume h is ['hostPath']"]
    assert broken(lambda s: s["containers"][0]["securityContext"].update(privileged=True)) == [
        f"Privileged Containers: {ray}"]
    assert broken(lambda s: s["containers"][0].update(ports=[{"containerPort": 80, "hostPort": 80}])) == [
        f"Host Ports: {ray} hostPort 80"]
    assert broken(lambda s: s["containers"][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN", "CHOWN"])) \
        == [f"Capabilities: {ray} adds ['SYS_ADMIN']",
            f"Capabilities: {ray} adds ['CHOWN', 'SYS_ADMIN'] (restricted allows only NET_BIND_SERVICE)"]
    assert broken(lambda s: s["containers"][0]["securityContext"]["capabilities"].update(add=["NET_BIND_SERVICE"])) \
        == []
    assert broken(lambda s: s["securityContext"].update(runAsUser=0)) == ["Running as Non-root user: pod runAsUser 0"]
    assert broken(lambda s: s["containers"][0]["securityContext"].update(runAsNonRoot=False)) == [
        f"Running as Non-root: {ray} runAsNonRoot is not true (pod or container)"]
    def pod_false_containers_true(spec: dict) -> None:
        spec["securityContext"]["runAsNonRoot"] = False
        for c in spec["containers"] + spec["initContainers"]:
            c["securityContext"]["runAsNonRoot"] = True
    assert broken(pod_false_containers_true) == ["Running as Non-root: pod runAsNonRoot is false"]
    assert broken(lambda s: s["containers"][0]["securityContext"].update(seccompProfile={"type": "Unconfined"})) == [
        f"Seccomp: {ray} profile Unconfined",
        f"Seccomp: {ray} has no RuntimeDefault or Localhost profile (pod or container)"]
    # the pod's profile moved to every container is as good; removed from the pod alone, it is missing everywhere
    def per_container(spec: dict) -> None:
        profile = spec["securityContext"].pop("seccompProfile")
        for c in spec["containers"] + spec["initContainers"]:
            c["securityContext"]["seccompProfile"] = profile
    assert broken(per_container) == []
    assert broken(lambda s: s["securityContext"].pop("seccompProfile")) == [
        "Seccomp: initContainer wait-gcs-ready has no RuntimeDefault or Localhost profile (pod or container)",
        f"Seccomp: {ray} has no RuntimeDefault or Localhost profile (pod or container)"]
    assert baseline_violations({"containers": [{"name": "c", "securityContext": {"procMount": "Unmasked"}}],
                                "securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}}) == [
        "Sysctls: kernel.msgmax is not in the safe set", "/proc Mount Type: container c Unmasked"]
