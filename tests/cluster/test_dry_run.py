"""Server-side dry-run (``dryRun=All``, through the official Kubernetes client) of every example and of every object
the operator builds for them, on the real kube-apiserver 1.20, so API-level validation errors surface in CI.

Besides the server's verdict (a 4xx fails the test with the server's message), each answer is compared with what was
sent: kube-apiserver 1.20 silently drops fields it does not know (structural-schema pruning for custom resources,
unknown fields of built-in kinds; strict field validation came in 1.25), so a field missing from the answer is a
field the cluster would never have seen. The pods KubeRay creates from the RayCluster's and RayService's pod templates
are dry-run as Pods too: the KubeRay CRDs embed pod templates without validating them (e.g. a container port name
longer than 15 characters is stored in a RayCluster and refused only when KubeRay creates the pod).

What 1.20 cannot check: the CEL ``x-kubernetes-validations`` rules of our CRD (Kubernetes >= 1.25);
`test_our_crd_on_1_20_loses_exactly_its_cel_rules` shows exactly what is lost, the unit tests check the rules with
cel-python.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from cluster_support import REPO, RLTJ, RLTJ_CRD, daedalus_crds, ensure_crds, example, load_yaml, missing_paths
from daedalus_trainer.config import RLTrainingJobStatus, parse_job
from kubernetes import client
from kubernetes.client import ApiException
from pod_security import kuberay_pod_spec, restricted_violations

from daedalus_operator import resources
from daedalus_operator.plan import JobView
from daedalus_operator.settings import OperatorSettings


EXAMPLES = ["local-tiny.yaml", "hyperpod-qwen3vl-8b.yaml"]
#: The chart's defaults: operator namespace and pod labels (the NetworkPolicy's source), production paths and ports.
SETTINGS = OperatorSettings(operator_namespace="daedalus-system")
#: An object-store mirror of the exports (what the serving annotation names) for build_rayservice.
LORA_URI = "s3://daedalus-test-bucket/exports"


@pytest.fixture(scope="module")
def kube(control_plane):
    """Admin official client with our CRDs installed."""
    ensure_crds(control_plane)
    with control_plane.api_client() as api:
        yield api


def dry_run(api: client.ApiClient, body: dict) -> dict:
    """Create ``body`` with ``dryRun=All`` and return the server's answer as raw JSON (not through the client's
    models, which would drop unknown fields on their own).

    Raises:
        kubernetes.client.ApiException: the server refused it (status and the server's message).
    """
    kind, ns = body["kind"], body["metadata"].get("namespace")
    opts = {"dry_run": "All", "_preload_content": False}
    if kind == "ConfigMap":
        answer = client.CoreV1Api(api).create_namespaced_config_map(ns, body, **opts)
    elif kind == "Secret":
        answer = client.CoreV1Api(api).create_namespaced_secret(ns, body, **opts)
    elif kind == "Pod":
        answer = client.CoreV1Api(api).create_namespaced_pod(ns, body, **opts)
    elif kind == "NetworkPolicy":
        answer = client.NetworkingV1Api(api).create_namespaced_network_policy(ns, body, **opts)
    elif kind == "CustomResourceDefinition":
        answer = client.ApiextensionsV1Api(api).create_custom_resource_definition(body, **opts)
    else:  # custom resources: RLTrainingJob, RayCluster, RayService
        group, version = body["apiVersion"].split("/")
        plural = {"RLTrainingJob": "rltrainingjobs", "RayCluster": "rayclusters", "RayService": "rayservices"}[kind]
        answer = client.CustomObjectsApi(api).create_namespaced_custom_object(group, version, ns, plural, body, **opts)
    assert answer.status == 201, (answer.status, answer.data[:500])
    return json.loads(answer.data)


def job_view(manifest: dict) -> JobView:
    """The operator's view of a job as the server returned it (handlers.job_view does the same from a watch event)."""
    job = parse_job({k: v for k, v in manifest.items() if k in ("apiVersion", "kind", "metadata", "spec")})
    meta = manifest["metadata"]
    return JobView(name=meta["name"], namespace=meta["namespace"],
                   uid=meta.get("uid") or "00000000-0000-4000-8000-000000000000",
                   generation=int(meta.get("generation") or 1), spec=job.spec, status=RLTrainingJobStatus())


def built_objects(view: JobView) -> list[dict]:
    """Every object the operator builds for a job (resources.py)."""
    return [resources.build_config_map(view), resources.build_secret(view),
            resources.build_network_policy(view, SETTINGS), resources.build_raycluster(view, SETTINGS),
            resources.build_rayservice(view, LORA_URI)]


def kuberay_pods(obj: dict) -> list[dict]:
    """The pods KubeRay makes from a RayCluster's (or a RayService's ``rayClusterConfig``) pod templates: template
    metadata and spec as given, with the worker init container and the head's ``/dev/shm`` volume KubeRay adds
    (:func:`pod_security.kuberay_pod_spec`; KubeRay adds its own labels, command and env on top).

    Resource quantities become strings: KubeRay decodes the template into Go's ``corev1.PodSpec``, where a JSON number
    is a valid ``resource.Quantity`` that is sent on as a string (``8`` -> ``"8"``); the Python client, unlike the
    server, accepts only strings there."""
    spec = obj["spec"].get("rayClusterConfig") or obj["spec"]
    groups = [("head", spec["headGroupSpec"]["template"])]
    groups += [(g["groupName"], g["template"]) for g in spec.get("workerGroupSpecs", [])]
    pods = []
    for i, (group, template) in enumerate(groups):
        pod_spec = kuberay_pod_spec(template["spec"], worker=i > 0)
        for container in pod_spec.get("containers", []) + pod_spec.get("initContainers", []):
            for section in ("requests", "limits"):
                quantities = (container.get("resources") or {}).get(section) or {}
                for key, value in quantities.items():
                    quantities[key] = str(value)
        pods.append({"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": f"{obj['metadata']['name']}-{group}",
                                  "namespace": obj["metadata"]["namespace"],
                                  "labels": dict((template.get("metadata") or {}).get("labels") or {}),
                                  "annotations": dict((template.get("metadata") or {}).get("annotations") or {})},
                     "spec": pod_spec})
    return pods


def refusal(err: ApiException) -> str:
    try:
        return json.loads(err.body)["message"]
    except (TypeError, ValueError, KeyError):
        return str(err.body)


@pytest.mark.parametrize("file", EXAMPLES)
def test_example_passes_server_side_dry_run_unpruned_and_defaulted(kube, namespace, file: str):
    body = example(file, namespace)
    answer = dry_run(kube, body)
    assert missing_paths(body, answer) == []
    assert answer["spec"]["algorithm"]["klCoef"] == 0  # defaulted by the CRD's structural schema
    assert answer["metadata"]["namespace"] == namespace and answer["metadata"]["uid"]
    with pytest.raises(ApiException) as err:  # dry run: nothing stored
        client.CustomObjectsApi(kube).get_namespaced_custom_object(*RLTJ[:2], namespace, RLTJ[2],
                                                                   body["metadata"]["name"])
    assert err.value.status == 404


def test_a_null_the_crd_does_not_allow_is_defaulted_by_the_server_as_daedalus_validate_reads_it(kube, namespace):
    """`podSecurity:` with no value and `klCoef: null`: the real server drops each non-nullable null and stores the
    default, and a nullable one (`model.sftAdapter`) keeps its null; `parse_job` (what `daedalus validate` and
    `daedalus run` read a job with) reads the manifest sent to the same spec the server stored. It used to refuse
    the nulls the server takes."""
    body = example("local-tiny.yaml", namespace, cluster__podSecurity=None, algorithm__klCoef=None,
                   model__sftAdapter=None)
    # a map entry without a value (additionalProperties, no default): dropped, the other entry kept
    body["spec"]["cluster"]["workerGroups"][0]["nodeSelector"] = {"team": None, "pool": "cpu"}
    assert body["spec"]["cluster"]["podSecurity"] is None
    answer = dry_run(kube, body)
    assert answer["spec"]["cluster"]["podSecurity"] == "restricted" and answer["spec"]["algorithm"]["klCoef"] == 0
    assert answer["spec"]["cluster"]["workerGroups"][0]["nodeSelector"] == {"pool": "cpu"}
    assert "sftAdapter" in answer["spec"]["model"] and answer["spec"]["model"]["sftAdapter"] is None
    assert parse_job(body).spec == job_view(answer).spec


@pytest.mark.parametrize("dotted,value,field", [
    ("environment__observation", "video", "spec.environment.observation"),
    ("lora__rank", 0, "spec.lora.rank"),
    ("algorithm__groupSize", "eight", "spec.algorithm.groupSize"),
    # the same objects `daedalus validate` refuses: a target outside the CRD's enum, pod resources that are not > 0
    ("lora__targetModules", ["q_proj", "q_projj"], "spec.lora.targetModules"),
    ("cluster__head__cpu", "-2", "spec.cluster.head.cpu"),
    ("cluster__head__memory", "0", "spec.cluster.head.memory"),
    ("cluster__head__cpu", 0, "spec.cluster.head.cpu"),  # a whole number must be > 0 too (minimum: 1)
    ("cluster__head__cpu", 0.5, "spec.cluster.head.cpu"),  # a fraction must be quoted ("0.5", "500m")
])
def test_dry_run_refuses_a_schema_violation(kube, namespace, dotted: str, value: Any, field: str):
    """The control: the dry run validates (a broken example would fail the test above with the server's reason)."""
    with pytest.raises(ApiException) as err:
        dry_run(kube, example("local-tiny.yaml", namespace, **{dotted: value}))
    assert err.value.status == 422
    assert field in refusal(err.value)


def test_an_unquoted_whole_number_quantity_is_stored_and_built_as_a_quantity(kube, namespace):
    """`cpu: 6` (no quotes) is accepted as IntOrString, kept as the number, and the operator's RayCluster asks for
    the quantity "6", which the server takes."""
    answer = dry_run(kube, example("local-tiny.yaml", namespace, cluster__head__cpu=6))
    assert answer["spec"]["cluster"]["head"]["cpu"] == 6
    raycluster = resources.build_raycluster(job_view(answer), SETTINGS)
    head = raycluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]
    assert head["requests"]["cpu"] == head["limits"]["cpu"] == "6"
    dry_run(kube, raycluster)


@pytest.mark.parametrize("file", EXAMPLES)
def test_every_object_the_operator_builds_passes_server_side_dry_run(kube, namespace, file: str):
    view = job_view(dry_run(kube, example(file, namespace)))
    objects = built_objects(view)
    assert [o["kind"] for o in objects] == ["ConfigMap", "Secret", "NetworkPolicy", "RayCluster", "RayService"]
    problems = {}
    for obj in objects:
        try:
            answer = dry_run(kube, obj)
        except ApiException as err:
            problems[obj["kind"]] = f"{err.status}: {refusal(err)}"
            continue
        missing = missing_paths(obj, answer)
        if missing:
            problems[obj["kind"]] = f"dropped by the server: {missing}"
    assert problems == {}


@pytest.mark.parametrize("file", EXAMPLES)
def test_the_pods_kuberay_would_create_pass_server_side_dry_run(kube, namespace, file: str):
    view = job_view(dry_run(kube, example(file, namespace)))
    pods = [pod for obj in built_objects(view) if obj["kind"] in ("RayCluster", "RayService")
            for pod in kuberay_pods(obj)]
    groups = [g["name"] for g in view.spec.model_dump(by_alias=True)["cluster"]["workerGroups"]]
    cluster, service = f"{view.name}-ray", f"{view.name}-serve"
    assert [p["metadata"]["name"] for p in pods] == [f"{cluster}-head", *(f"{cluster}-{g}" for g in groups),
                                                     f"{service}-head", f"{service}-serve"]
    problems: dict[str, list[str]] = {}
    for pod in pods:
        said = problems.setdefault(pod["metadata"]["name"], [])
        try:
            answer = dry_run(kube, pod)
        except ApiException as err:
            said.append(f"{err.status}: {refusal(err)}")
            continue
        missing = missing_paths(pod, answer)
        if missing:
            said.append(f"dropped by the server: {missing}")
        # as the server stored it (its defaults added), the pod meets the restricted level (the default podSecurity)
        violations = restricted_violations(answer["spec"])
        if violations:
            said.append(f"not restricted: {violations}")
    assert {name: said for name, said in problems.items() if said} == {}


def test_our_crd_on_1_20_loses_exactly_its_cel_rules(kube):
    """The chart's CRD as it is, under another group so that it does not collide with the installed one: 1.20
    accepts it and drops exactly the paths ``crd_for_1_20`` strips (its CEL rules), nothing else."""
    crd = load_yaml(REPO / "charts" / "daedalus" / "crds" / "rltrainingjob.yaml")
    assert crd == load_yaml(REPO / "crds" / "rltrainingjob.yaml")
    crd["spec"]["group"] = "dryrun.daedalus.dev"
    crd["metadata"]["name"] = f"{crd['spec']['names']['plural']}.dryrun.daedalus.dev"
    answer = dry_run(kube, crd)
    dropped = sorted(p.lstrip(".") for p in missing_paths(crd, answer))
    _, removed = daedalus_crds()[RLTJ_CRD]
    assert dropped == sorted(removed)
    assert removed and all(p.endswith(".x-kubernetes-validations") for p in removed)
