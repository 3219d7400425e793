"""Pure manifest builders for the children of an RLTrainingJob (KubeRay's ``Build*`` habit: never read the API).

- :func:`build_raycluster` - the KubeRay RayCluster (ray.io/v1): head group without GPUs and ``num-cpus: "0"`` (the
  trainer's driver and HTTP endpoint live there, no Ray tasks), worker groups with ``nvidia.com/gpu`` and
  ``vpc.amazonaws.com/efa``, an in-memory ``/dev/shm``, the shared PVC, node affinity to unlabelled or
  HyperPod-Schedulable nodes, the instance type, tolerations, annotations that keep Karpenter and Cluster Autoscaler
  from removing the nodes under a running job, and (``cluster.podSecurity: restricted``, the default) the
  securityContext the Pod Security Standards' restricted level asks for.
- :func:`build_config_map` - the resolved trainer config (the job manifest with every default, without the sections
  only the operator reads) that the trainer reads with ``--config``.
- :func:`build_secret` - the job's token (random, created once; reconcile never rotates it): the trainer's control
  token, given to the head container as ``$DAEDALUS_CONTROL_TOKEN``, and the Ray token of every container
  (``$RAY_AUTH_TOKEN`` with ``RAY_AUTH_MODE=token``), by ``env.valueFrom.secretKeyRef``.
- :func:`build_network_policy` - only the operator may reach the dashboard (8265) and the control port (9400); the
  job's own pods talk to each other freely (Ray GCS, object manager, NCCL).
- :func:`build_rayservice` - Ray Serve LLM (vLLM engine) serving the base model from the shared volume with the
  exported adapter as a dynamic LoRA (requests name ``<model.name>:adapter``).

Every builder returns a plain dict; tests validate the KubeRay ones against KubeRay v1.7.0's CRDs (vendored in ``tests/data/kuberay-v1.7.0``) and the
built-in kinds with ``kubernetes-validate --strict``.

References: KubeRay RayCluster/RayService API (ray-operator/apis/ray/v1), KubeRay's pod builder
(controllers/ray/common/pod.go: head service ports come from the head container's named ports, KubeRay injects
``--num-gpus`` from the container's ``nvidia.com/gpu`` limit), Kubernetes core/v1, networking.k8s.io/v1, Ray Serve LLM
``LLMConfig`` (ray.serve.llm, Ray 2.60: ``lora_config.dynamic_lora_loading_path`` must be an s3://, gs://, abfss:// or
azure:// URI).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import posixpath
import re
import secrets
from typing import Any

import yaml
from daedalus_trainer.config import HeadSpec, ObjectMeta, RLTrainingJob, RLTrainingJobSpec, WorkerGroupSpec

from daedalus_operator import api
from daedalus_operator.plan import JobView
from daedalus_operator.settings import OperatorSettings

#: Annotation on an RLTrainingJob naming the object-store URI that mirrors ``<checkpoint root>/exports`` (for example
#: the S3 prefix of an FSx for Lustre data repository association). Ray Serve LLM loads dynamic LoRA adapters only
#: from object storage; without it no RayService is created (a Warning event says why).
SERVING_LORA_URI_ANNOTATION = "daedalus.dev/serving-lora-uri"
#: LoRA id of the exported adapter: requests use ``model: "<spec.model.name>:adapter"``.
ADAPTER_ID = "adapter"


def owner_reference(job: JobView) -> dict[str, Any]:
    """Controller owner reference to the RLTrainingJob (garbage collection deletes children with the job)."""
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": job.name, "uid": job.uid,
            "controller": True, "blockOwnerDeletion": True}


def child_labels(job: JobView, component: str) -> dict[str, str]:
    """Labels of every child object: the job label, managed-by and the component."""
    return {api.JOB_LABEL: job.name, api.MANAGED_BY_LABEL: api.MANAGED_BY, api.COMPONENT_LABEL: component}


def _meta(job: JobView, name: str, component: str, **extra: Any) -> dict[str, Any]:
    meta = {"name": name, "namespace": job.namespace, "labels": child_labels(job, component),
            "ownerReferences": [owner_reference(job)]}
    meta.update(extra)
    return meta


def _spec(job: JobView) -> RLTrainingJobSpec:
    if job.spec is None:
        raise ValueError(f"RLTrainingJob {job.namespace}/{job.name} has an invalid spec; nothing can be built")
    return job.spec


def shared_mount_path(spec: RLTrainingJobSpec) -> str:
    """Where the shared PVC (``checkpoint.volume``) is mounted: the deepest common directory of ``checkpoint.path``
    and the model paths that live beside it (``model.path``, ``model.sftAdapter``), so one FSx claim can hold base
    model, SFT adapter and checkpoints (``/fsx/models/...`` and ``/fsx/daedalus/checkpoints`` mount the claim at
    ``/fsx``). Paths with nothing in common but ``/`` are left out; the result is never ``/``."""
    ckpt = posixpath.normpath(spec.checkpoint.path)
    paths = [ckpt]
    for other in (spec.model.path, spec.model.sft_adapter):
        if other and other.startswith("/"):
            common = posixpath.commonpath([ckpt, posixpath.normpath(other)])
            if common != "/":
                paths.append(posixpath.normpath(other))
    common = posixpath.commonpath(paths)
    return common if common != "/" else ckpt


# ------------------------------------------------------------------------------------------------ ConfigMap, Secret
#: Fields of the spec that only the operator reads; the trainer config leaves them out (:func:`trainer_config`).
OPERATOR_ONLY_FIELDS = ("cluster", "resilience", "serving", "suspend")


def trainer_config(job: JobView) -> dict[str, Any]:
    """The resolved trainer config (what ``daedalus train --config`` reads): the job manifest with every default
    filled in, metadata reduced to name, namespace and uid, without :data:`OPERATOR_ONLY_FIELDS`. Version skew: a
    job's trainer image (``spec.cluster.image``, immutable) may be older than the operator, and the trainer refuses
    a field it does not know; leaving out what it never reads keeps a field the operator adds there (such as
    ``cluster.podSecurity``) from failing an older trainer's next attempt. The trainer reads those sections back
    as their defaults.

    Raises:
        ValueError: the job's spec is invalid.
    """
    spec = _spec(job)
    doc = RLTrainingJob(metadata=ObjectMeta(name=job.name, namespace=job.namespace), spec=spec).to_manifest()
    doc["metadata"]["uid"] = job.uid
    for field in OPERATOR_ONLY_FIELDS:
        doc["spec"].pop(field, None)
    return doc


def build_config_map(job: JobView) -> dict[str, Any]:
    """ConfigMap ``<job>-config`` with key ``config.json`` (sorted, indented JSON: stable bytes, readable diffs).

    Raises:
        ValueError: the job's spec is invalid.
    """
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(job, api.config_map_name(job.name), "config"),
        "data": {api.CONFIG_KEY: json.dumps(trainer_config(job), indent=2, sort_keys=True) + "\n"},
    }


def new_token() -> str:
    """A fresh control token: 32 random bytes, URL-safe base64 (``secrets.token_urlsafe``, 256 bits)."""
    return secrets.token_urlsafe(32)


def build_secret(job: JobView, token: str | None = None) -> dict[str, Any]:
    """Secret ``<job>-control`` with key ``token`` (base64 in ``data``). ``token`` defaults to :func:`new_token`;
    reconcile creates it once and never updates it. The head container reads it at start (``env.valueFrom``), so a
    rotation (delete the Secret) reaches the trainer with the next RayCluster (suspend and resume, or a recreated
    cluster), which also makes the operator create a new Secret."""
    token = token or new_token()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _meta(job, api.secret_name(job.name), "control-token",
                          annotations={api.TOKEN_ANNOTATION: "never rotated by the operator"}),
        "data": {api.TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def secret_token(body: dict[str, Any]) -> str:
    """The token from a Secret body (``data.token`` base64, or ``stringData.token``).

    Raises:
        KeyError: the Secret holds no token.
    """
    data = body.get("data") or {}
    if api.TOKEN_KEY in data:
        return base64.b64decode(data[api.TOKEN_KEY]).decode()
    return (body.get("stringData") or {})[api.TOKEN_KEY]


# ------------------------------------------------------------------------------------------------ NetworkPolicy
def build_network_policy(job: JobView, settings: OperatorSettings) -> dict[str, Any]:
    """Ingress to the job's pods: from the job's own pods on every port; from the operator's pods (by namespace and
    labels) to the dashboard (8265) and the control port; optionally from ``settings.metrics_namespaces`` to the
    control/metrics port only (Prometheus scraping; the control routes still need the token)."""
    own = {"podSelector": {"matchLabels": {api.JOB_LABEL: job.name}}}
    operator_peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": settings.operator_namespace}},
        "podSelector": {"matchLabels": dict(settings.operator_pod_labels)},
    }
    ingress: list[dict[str, Any]] = [
        {"from": [own]},
        {"from": [operator_peer], "ports": [{"protocol": "TCP", "port": api.DASHBOARD_PORT},
                                           {"protocol": "TCP", "port": settings.control_port}]},
    ]
    if settings.metrics_namespaces:
        ingress.append({
            "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
                     for ns in settings.metrics_namespaces],
            "ports": [{"protocol": "TCP", "port": settings.control_port}],
        })
    spec = {"podSelector": {"matchLabels": {api.JOB_LABEL: job.name}}, "policyTypes": ["Ingress"], "ingress": ingress}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(job, api.network_policy_name(job.name), "network-policy",
                          annotations={api.SPEC_DIGEST_ANNOTATION: spec_digest(spec)}),
        "spec": spec,
    }


# ------------------------------------------------------------------------------------------------ PodDisruptionBudget
def build_disruption_budget(job: JobView) -> dict[str, Any]:
    """The job's PodDisruptionBudget (policy/v1, Kubernetes 1.21+): no voluntary eviction of the training RayCluster's
    pods, selected by the job label and ``ray.io/cluster`` (serving pods are not held).

    ``minAvailable`` is every pod of the RayCluster (head + worker replicas; ``spec.cluster`` is immutable), not
    ``maxUnavailable: 0``: the disruption controller turns ``maxUnavailable`` into a pod count through the pods'
    controller's scale subresource, which a RayCluster lacks (its status sync fails); an integer ``minAvailable`` is
    the form Kubernetes supports for pods of an operator ("Arbitrary workloads and PDBs",
    https://kubernetes.io/docs/tasks/run-application/configure-pdb/). Either way no disruption is allowed.

    A drain (``kubectl drain``, an EKS managed node group update, Karpenter, the cluster autoscaler) evicts through
    the Eviction API, which refuses while the budget allows no disruption; the drainer retries. Meanwhile the
    operator sees the node being emptied (:func:`daedalus_operator.nodes.node_draining`), checkpoints, stops the
    attempt and deletes the pods there itself (a delete is not an eviction), and the drain goes on.
    ``unhealthyPodEvictionPolicy: AlwaysAllow`` (beta and on by default since 1.27, GA in 1.31; older servers drop
    it) lets a pod that is not Ready be evicted at once: it holds no training state worth waiting for, and a wedged
    pod must not block a node's drain.

    Raises:
        ValueError: the job's spec is invalid.
    """
    _spec(job)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(job, api.disruption_budget_name(job.name), "disruption-budget"),
        "spec": {
            "minAvailable": job.expected_pods,
            "selector": {"matchLabels": {api.JOB_LABEL: job.name,
                                         api.RAY_CLUSTER_LABEL: api.raycluster_name(job.name)}},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def spec_digest(spec: dict[str, Any]) -> str:
    """SHA-256 of a child's spec as the operator builds it (sorted JSON): what it wrote, whatever the server adds."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------------------------------------ RayCluster
def _affinity(hyperpod: bool) -> dict[str, Any] | None:
    """Required node affinity that admits exactly the nodes :func:`daedalus_operator.nodes.node_schedulable` judges
    schedulable: two ORed node selector terms, ``sagemaker.amazonaws.com/node-health-status DoesNotExist`` (a node
    outside HyperPod's management, e.g. plain EKS) or ``... In [Schedulable]``. A node HyperPod took out of service,
    or one with any other value, is never chosen (``NotIn`` the known bad values would admit an unknown or empty
    value that the operator then judges bad, deleting the pods the scheduler keeps placing there)."""
    if not hyperpod:
        return None
    key = api.HYPERPOD_HEALTH_LABEL
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": key, "operator": "DoesNotExist"}]},
        {"matchExpressions": [{"key": key, "operator": "In", "values": [api.NodeHealthStatus.SCHEDULABLE.value]}]},
    ]}}}


def _tolerations(group: WorkerGroupSpec | HeadSpec) -> list[dict[str, Any]]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in group.tolerations]


def _place_head(pod: dict[str, Any], spec: RLTrainingJobSpec) -> None:
    """``cluster.head``'s node selector and tolerations on a head pod spec (training or serving)."""
    if spec.cluster.head.node_selector:
        pod["nodeSelector"] = dict(spec.cluster.head.node_selector)
    if spec.cluster.head.tolerations:
        pod["tolerations"] = _tolerations(spec.cluster.head)


def _shared_volume(spec: RLTrainingJobSpec) -> tuple[list[dict], list[dict]]:
    """(volumes, volumeMounts) of the shared PVC, empty when ``checkpoint.volume`` is unset (local paths)."""
    if not spec.checkpoint.volume:
        return [], []
    return ([{"name": "shared", "persistentVolumeClaim": {"claimName": spec.checkpoint.volume}}],
            [{"name": "shared", "mountPath": shared_mount_path(spec)}])


#: Pod-level securityContext of ``cluster.podSecurity: restricted``: the Pod Security Standards' restricted level asks
#: for ``runAsNonRoot`` and a ``RuntimeDefault`` (or Localhost) seccomp profile, set once here for every container.
RESTRICTED_POD_SECURITY: dict[str, Any] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
#: Container-level securityContext of the restricted level: no privilege escalation, every capability dropped.
#: KubeRay copies the Ray container's securityContext into the ``wait-gcs-ready`` init container it adds to workers.
RESTRICTED_CONTAINER_SECURITY: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _secure(pod: dict[str, Any], spec: RLTrainingJobSpec) -> dict[str, Any]:
    """Pod spec ``pod`` with the securityContext of ``spec.cluster.podSecurity`` on it and its containers (nothing for
    ``baseline``); returns ``pod``. The contexts are copies: two pods never share one dict."""
    if spec.cluster.pod_security == "restricted":
        pod["securityContext"] = copy.deepcopy(RESTRICTED_POD_SECURITY)
        for container in pod["containers"]:
            container["securityContext"] = copy.deepcopy(RESTRICTED_CONTAINER_SECURITY)
    return pod


def _env(job: JobView, settings: OperatorSettings, *, head: bool = False) -> list[dict[str, Any]]:
    """Environment of the Ray containers: Ray token authentication on every one (``RAY_AUTH_MODE=token``,
    ``RAY_AUTH_TOKEN`` from the job's Secret: :data:`api.ENV_RAY_AUTH_MODE`); the head's also carries the same
    token as the trainer's control token (the Ray job's entrypoint runs on the head and inherits it). Environment
    variables rather than a Secret volume: the kubelet writes Secret files owned by root, unreadable to the trainer
    image's uid 10001 at mode 0400."""
    token = {"secretKeyRef": {"name": api.secret_name(job.name), "key": api.TOKEN_KEY}}
    env: list[dict[str, Any]] = [
        {"name": api.ENV_JOB, "value": job.name},
        {"name": api.ENV_NAMESPACE, "value": job.namespace},
        {"name": api.ENV_PORT, "value": str(settings.control_port)},
        {"name": api.ENV_RAY_AUTH_MODE, "value": "token"},
        {"name": api.ENV_RAY_AUTH_TOKEN, "valueFrom": token},
    ]
    if head:
        env.append({"name": api.ENV_TOKEN, "valueFrom": token})
    return env


#: Annotations of the training pods that ask node autoscalers not to remove their nodes voluntarily while the job
#: runs (consolidating a GPU node kills its Ray pods: the job loses the steps since its last checkpoint and waits
#: for a recovery). Karpenter (karpenter.sh/docs/reference/annotations, GA): blocks consolidation and drift, not
#: expiration or repair. Cluster Autoscaler (its FAQ, "What types of pods can prevent CA from removing a node?"):
#: the node is not scaled down. HyperPod's own replacements and reboots are announced on the node and handled
#: with a checkpoint (:mod:`daedalus_operator.nodes`). Serving pods do not carry them.
NO_VOLUNTARY_DISRUPTION: dict[str, str] = {"karpenter.sh/do-not-disrupt": "true",
                                           "cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}


def _pod_meta(job: JobView) -> dict[str, Any]:
    return {"labels": {api.JOB_LABEL: job.name}, "annotations": dict(NO_VOLUNTARY_DISRUPTION)}


def _head_template(job: JobView, settings: OperatorSettings) -> dict[str, Any]:
    spec = _spec(job)
    volumes, mounts = _shared_volume(spec)
    volumes = volumes + [{"name": "config", "configMap": {"name": api.config_map_name(job.name)}}]
    mounts = mounts + [{"name": "config", "mountPath": settings.config_dir, "readOnly": True}]
    resources = {"cpu": spec.cluster.head.cpu, "memory": spec.cluster.head.memory}
    container = {
        "name": "ray-head",
        "image": spec.cluster.image,
        "imagePullPolicy": "IfNotPresent",
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "ports": [
            {"name": "gcs-server", "containerPort": api.GCS_PORT, "protocol": "TCP"},
            {"name": api.DASHBOARD_PORT_NAME, "containerPort": api.DASHBOARD_PORT, "protocol": "TCP"},
            {"name": "client", "containerPort": api.CLIENT_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": api.RAY_METRICS_PORT, "protocol": "TCP"},
            {"name": api.CONTROL_PORT_NAME, "containerPort": settings.control_port, "protocol": "TCP"},
        ],
        "env": _env(job, settings, head=True),
        "volumeMounts": mounts,
    }
    pod: dict[str, Any] = _secure({"containers": [container], "volumes": volumes}, spec)
    _place_head(pod, spec)
    if spec.cluster.service_account_name:
        pod["serviceAccountName"] = spec.cluster.service_account_name
    affinity = _affinity(spec.resilience.hyper_pod)
    if affinity:
        pod["affinity"] = affinity
    return {"metadata": _pod_meta(job), "spec": pod}


def _worker_group(job: JobView, group: WorkerGroupSpec, settings: OperatorSettings) -> dict[str, Any]:
    spec = _spec(job)
    volumes, mounts = _shared_volume(spec)
    volumes = volumes + [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": group.shm_size}}]
    mounts = mounts + [{"name": "dshm", "mountPath": "/dev/shm"}]
    resources: dict[str, Any] = {"cpu": group.cpu, "memory": group.memory}
    if group.gpus_per_worker:
        resources[api.GPU_RESOURCE] = group.gpus_per_worker
    if group.efa:
        resources[api.EFA_RESOURCE] = group.efa
    container = {
        "name": "ray-worker",
        "image": spec.cluster.image,
        "imagePullPolicy": "IfNotPresent",
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "env": _env(job, settings),
        "volumeMounts": mounts,
    }
    pod: dict[str, Any] = _secure({"containers": [container], "volumes": volumes}, spec)
    selector = dict(group.node_selector)
    if group.instance_type:
        selector[api.INSTANCE_TYPE_LABEL] = group.instance_type
    if selector:
        pod["nodeSelector"] = selector
    if group.tolerations:
        pod["tolerations"] = _tolerations(group)
    if spec.cluster.service_account_name:
        pod["serviceAccountName"] = spec.cluster.service_account_name
    affinity = _affinity(spec.resilience.hyper_pod)
    if affinity:
        pod["affinity"] = affinity
    return {
        "groupName": group.name,
        "replicas": group.replicas,
        "minReplicas": group.replicas,
        "maxReplicas": max(group.replicas, 1),
        "rayStartParams": {},
        "template": {"metadata": _pod_meta(job), "spec": pod},
    }


def build_raycluster(job: JobView, settings: OperatorSettings) -> dict[str, Any]:
    """The job's KubeRay RayCluster (ray.io/v1), named :func:`daedalus_operator.api.raycluster_name`.

    Raises:
        ValueError: the job's spec is invalid.
    """
    spec = _spec(job)
    return {
        "apiVersion": api.RAY_API_VERSION,
        "kind": "RayCluster",
        "metadata": _meta(job, api.raycluster_name(job.name), "raycluster",
                          annotations={api.GENERATION_ANNOTATION: str(job.generation)}),
        "spec": {
            "rayVersion": spec.cluster.ray_version,
            "enableInTreeAutoscaling": False,
            "headGroupSpec": {
                "serviceType": "ClusterIP",
                "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                "template": _head_template(job, settings),
            },
            "workerGroupSpecs": [_worker_group(job, g, settings) for g in spec.cluster.worker_groups],
        },
    }


# ------------------------------------------------------------------------------------------------ RayService
def serve_config(job: JobView, lora_uri: str) -> dict[str, Any]:
    """The Ray Serve config (``serveConfigV2``): one OpenAI-compatible Ray Serve LLM app (``build_openai_app``) with
    the vLLM engine, the base model from ``spec.model.path`` and dynamic LoRA from ``lora_uri`` (the object-store
    mirror of ``<checkpoint root>/exports``, whose sub-folder ``adapter`` is the exported adapter), max LoRA rank
    ``spec.lora.rank``, ``tensor_parallel_size`` = GPUs per replica.

    Raises:
        ValueError: the job's spec is invalid.
    """
    spec = _spec(job)
    engine: dict[str, Any] = {"enable_lora": True, "max_lora_rank": spec.lora.rank, "max_loras": 1,
                              "dtype": spec.model.dtype}
    if spec.serving.gpus_per_replica > 1:
        engine["tensor_parallel_size"] = spec.serving.gpus_per_replica
    llm_config: dict[str, Any] = {
        "model_loading_config": {"model_id": spec.model.name, "model_source": spec.model.path or spec.model.name},
        "lora_config": {"dynamic_lora_loading_path": lora_uri.rstrip("/"), "max_num_adapters_per_replica": 1},
        "engine_kwargs": engine,
        "deployment_config": {"autoscaling_config": {"min_replicas": spec.serving.replicas,
                                                     "max_replicas": spec.serving.replicas}},
    }
    return {"applications": [{"name": "llm", "route_prefix": "/", "import_path": "ray.serve.llm:build_openai_app",
                              "args": {"llm_configs": [llm_config]}}]}


#: The first Ray with token authentication (docs.ray.io, "Ray token authentication"); KubeRay refuses
#: ``authOptions.mode: token`` for an older or unparsable ``rayVersion`` (ValidateRayClusterSpec).
RAY_TOKEN_AUTH_MIN_VERSION = (2, 52, 0)


def supports_ray_token_auth(ray_version: str) -> bool:
    """Whether ``ray_version`` (``spec.cluster.rayVersion``: ``2.60.0``, ``v2.52``, ``2.53.0rc1``) is at least
    :data:`RAY_TOKEN_AUTH_MIN_VERSION`; False for one that does not start with ``major.minor``."""
    # apimachinery's version.ParseGeneric, which KubeRay uses: ASCII digits, no leading zero on the major number,
    # anything after major.minor[.patch] ignored ("2.52rc1" is 2.52.0)
    m = re.match(r"v?(0|[1-9][0-9]*)\.([0-9]+)(?:\.([0-9]+))?", ray_version.strip(), re.ASCII)
    if m is None:
        return False
    return (int(m[1]), int(m[2]), int(m[3] or 0)) >= RAY_TOKEN_AUTH_MIN_VERSION


def build_rayservice(job: JobView, lora_uri: str) -> dict[str, Any]:
    """RayService ``<job>-serve`` (ray.io/v1) serving the exported adapter; pods carry ``daedalus.dev/serving``, not
    the job label (the job's NetworkPolicy must not isolate them from KubeRay).

    Its dashboard runs with Ray token authentication managed by KubeRay (``authOptions.mode: token``, KubeRay
    >= 1.5.1: KubeRay generates a Secret per RayCluster, sets ``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN`` on every container
    and sends the token when it deploys the Serve application), where ``spec.cluster.rayVersion`` is 2.52 or later
    (:func:`supports_ray_token_auth`; KubeRay refuses the option for an older Ray). The training RayCluster instead
    takes the token from the job's own Secret (:func:`_env`), which the operator needs for its job API calls.
    Requests to the served model (Ray Serve's HTTP port) are not affected.

    Raises:
        ValueError: invalid spec, or ``lora_uri`` is not an object-store URI (Ray Serve LLM rejects local paths).
    """
    spec = _spec(job)
    if not lora_uri.startswith(("s3://", "gs://", "abfss://", "azure://")):
        raise ValueError(f"{SERVING_LORA_URI_ANNOTATION} must be an s3://, gs://, abfss:// or azure:// URI "
                         f"(Ray Serve LLM loads dynamic LoRA adapters from object storage only); got {lora_uri!r}")
    image = spec.serving.image or spec.cluster.image
    volumes, mounts = _shared_volume(spec)
    labels = {api.SERVING_LABEL: job.name}
    head_container = {
        "name": "ray-head", "image": image, "imagePullPolicy": "IfNotPresent",
        "resources": {"requests": {"cpu": spec.cluster.head.cpu, "memory": spec.cluster.head.memory},
                      "limits": {"cpu": spec.cluster.head.cpu, "memory": spec.cluster.head.memory}},
        "ports": [{"name": "gcs-server", "containerPort": api.GCS_PORT},
                  {"name": api.DASHBOARD_PORT_NAME, "containerPort": api.DASHBOARD_PORT},
                  {"name": "client", "containerPort": api.CLIENT_PORT},
                  {"name": "serve", "containerPort": api.SERVE_PORT}],
        "volumeMounts": mounts,
    }
    gpu_group = next((g for g in spec.cluster.worker_groups if g.gpus_per_worker > 0), spec.cluster.worker_groups[0])
    worker_resources: dict[str, Any] = {"cpu": gpu_group.cpu, "memory": gpu_group.memory}
    if spec.serving.gpus_per_replica:
        worker_resources[api.GPU_RESOURCE] = spec.serving.gpus_per_replica
    worker_pod: dict[str, Any] = {
        "containers": [{"name": "ray-worker", "image": image, "imagePullPolicy": "IfNotPresent",
                        "resources": {"requests": dict(worker_resources), "limits": dict(worker_resources)},
                        "volumeMounts": mounts + [{"name": "dshm", "mountPath": "/dev/shm"}]}],
        "volumes": volumes + [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": gpu_group.shm_size}}],
    }
    _secure(worker_pod, spec)
    selector = dict(gpu_group.node_selector)
    if gpu_group.instance_type:
        selector[api.INSTANCE_TYPE_LABEL] = gpu_group.instance_type
    if selector:
        worker_pod["nodeSelector"] = selector
    if gpu_group.tolerations:
        worker_pod["tolerations"] = _tolerations(gpu_group)
    head_pod: dict[str, Any] = _secure({"containers": [head_container], "volumes": volumes}, spec)
    _place_head(head_pod, spec)
    if spec.cluster.service_account_name:  # IRSA / Pod Identity: the adapter is read from object storage
        head_pod["serviceAccountName"] = worker_pod["serviceAccountName"] = spec.cluster.service_account_name
    affinity = _affinity(spec.resilience.hyper_pod)
    if affinity:
        head_pod["affinity"] = affinity
        worker_pod["affinity"] = affinity
    cluster: dict[str, Any] = {
        "rayVersion": spec.cluster.ray_version,
        "headGroupSpec": {"rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                          "template": {"metadata": {"labels": labels}, "spec": head_pod}},
        "workerGroupSpecs": [{
            "groupName": "serve", "replicas": spec.serving.replicas, "minReplicas": spec.serving.replicas,
            "maxReplicas": spec.serving.replicas, "rayStartParams": {},
            "template": {"metadata": {"labels": labels}, "spec": worker_pod},
        }],
    }
    if supports_ray_token_auth(spec.cluster.ray_version):
        cluster["authOptions"] = {"mode": "token"}
    return {
        "apiVersion": api.RAY_API_VERSION,
        "kind": "RayService",
        "metadata": _meta(job, api.rayservice_name(job.name), "serving"),
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config(job, lora_uri), sort_keys=False),
            "rayClusterConfig": cluster,
        },
    }


def serving_request_model(job: JobView) -> str:
    """The ``model`` of an OpenAI request to the served adapter: ``<spec.model.name>:adapter``.

    Raises:
        ValueError: the job's spec is invalid.
    """
    return f"{_spec(job).model.name}:{ADAPTER_ID}"
