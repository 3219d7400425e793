"""Every constant of the operator in one place: API coordinates, labels, annotations, the finalizer, condition types and
reasons, event reasons, ports, the HyperPod node-health label, and the name helpers.

The habit is KubeRay's (`ray-operator/controllers/ray/utils/constant.go`): no label key, reason or name format is spelled
anywhere else, so a rename is one edit and a test can enumerate them.

Name limits:

- Kubernetes object names used as DNS labels (Services, Pods' hostnames) must be at most 63 characters
  (RFC 1123 label, https://kubernetes.io/docs/concepts/overview/working-with-objects/names/).
- KubeRay derives longer names from a RayCluster's name (the head Service ``<name>-head-svc``, worker pods
  ``<name>-<group>-worker-<5 random>``) and rejects RayCluster names that leave no room for them; we keep RayCluster
  names within 53 characters.
- A RayService names its RayClusters ``<rayservice>-raycluster-<5 random>`` (17 extra characters), so RayService names
  are kept within 53 - 17 = 36 characters.

Names that would be too long are shortened deterministically: a prefix plus ``-`` plus 8 hex digits of the SHA-256 of
the full name, so two long job names never collide and a restarted operator computes the same name.
"""

from __future__ import annotations

import enum
import hashlib
import re

from daedalus_trainer.config import API_VERSION, GROUP, KIND, PLURAL, VERSION, Phase

__all__ = [
    "API_VERSION", "GROUP", "KIND", "PLURAL", "VERSION", "Phase",
]

# ------------------------------------------------------------------------------------------------ API coordinates
#: KubeRay API (ray.io/v1, KubeRay >= 1.0; schemas vendored in tests/data/kuberay-v1.7.0/).
RAY_GROUP = "ray.io"
RAY_VERSION = "v1"
RAY_API_VERSION = f"{RAY_GROUP}/{RAY_VERSION}"
RAYCLUSTER_PLURAL = "rayclusters"
RAYSERVICE_PLURAL = "rayservices"

# ------------------------------------------------------------------------------------------------ labels/annotations
#: Label on every child object and every Ray pod of a job: the RLTrainingJob's name.
JOB_LABEL = "daedalus.dev/job"
#: Label on the serving RayService's pods (deliberately not JOB_LABEL: the job's NetworkPolicy must not select them,
#: KubeRay has to reach the serving cluster's dashboard).
SERVING_LABEL = "daedalus.dev/serving"
#: Standard labels (https://kubernetes.io/docs/concepts/overview/working-with-objects/common-labels/).
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "daedalus-operator"
COMPONENT_LABEL = "app.kubernetes.io/component"
#: Annotation on the RayCluster: the RLTrainingJob generation it was built from.
GENERATION_ANNOTATION = "daedalus.dev/job-generation"
#: Annotation on the control Secret: never rotated by reconcile (documentation for humans).
TOKEN_ANNOTATION = "daedalus.dev/token-rotation"
#: Annotation on the NetworkPolicy: SHA-256 of the spec the operator wrote (patched when the desired spec differs,
#: e.g. after ``--metrics-namespace`` or ``--operator-namespace`` changed with the chart's values).
SPEC_DIGEST_ANNOTATION = "daedalus.dev/spec-digest"

#: KubeRay pod labels (ray-operator/controllers/ray/utils/constant.go).
RAY_CLUSTER_LABEL = "ray.io/cluster"
RAY_NODE_TYPE_LABEL = "ray.io/node-type"  # "head" | "worker"
RAY_GROUP_LABEL = "ray.io/group"

#: The operator's finalizer on RLTrainingJobs (kopf ``settings.persistence.finalizer``).
FINALIZER = "daedalus.dev/finalizer"

# ------------------------------------------------------------------------------------------------ HyperPod / nodes
#: SageMaker HyperPod EKS node health label
#: (https://docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-hyperpod-eks-resiliency-node-labels.html).
HYPERPOD_HEALTH_LABEL = "sagemaker.amazonaws.com/node-health-status"


class NodeHealthStatus(str, enum.Enum):
    """Values of :data:`HYPERPOD_HEALTH_LABEL`."""

    SCHEDULABLE = "Schedulable"
    UNSCHEDULABLE = "Unschedulable"
    PENDING_REPLACEMENT = "UnschedulablePendingReplacement"
    PENDING_REBOOT = "UnschedulablePendingReboot"


#: Taints (key -> the value that counts, ``None``: any) that say a node is being emptied to be removed: Karpenter v1
#: (``karpenter.sh/disrupted``, sigs.k8s.io/karpenter pkg/apis/v1/taints.go) and v1beta1 (``karpenter.sh/disruption``),
#: the Kubernetes cluster autoscaler (``ToBeDeletedByClusterAutoscaler``), and an EKS managed node group update, which
#: taints every node of the old version ``eks.amazonaws.com/nodegroup=unschedulable:NoSchedule`` before it evicts their
#: pods and cordons each only once it is empty ("Understand each phase of node updates", Amazon EKS user guide).
#: ``kubectl drain`` cordons the node (``spec.unschedulable``) instead.
DRAIN_TAINTS: dict[str, str | None] = {
    "karpenter.sh/disrupted": None,
    "karpenter.sh/disruption": None,
    "ToBeDeletedByClusterAutoscaler": None,
    "eks.amazonaws.com/nodegroup": "unschedulable",
}

#: Node label of the instance type (well-known label, https://kubernetes.io/docs/reference/labels-annotations-taints/).
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
#: Extended resources (NVIDIA device plugin; AWS EFA device plugin).
GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"

# ------------------------------------------------------------------------------------------------ ports and paths
#: Ray dashboard / job submission REST API port (Ray default).
DASHBOARD_PORT = 8265
DASHBOARD_PORT_NAME = "dashboard"
#: The trainer's metrics + control HTTP port on the head (daedalus_trainer.server.DEFAULT_PORT).
CONTROL_PORT = 9400
CONTROL_PORT_NAME = "trainer-metrics"  # a container port name: IANA_SVC_NAME, at most 15 characters
#: Ray ports the head exposes (KubeRay defaults): GCS, client, Ray's own metrics export, Serve.
GCS_PORT = 6379
CLIENT_PORT = 10001
RAY_METRICS_PORT = 8080
SERVE_PORT = 8000
#: Where the ConfigMap (``config.json``) is mounted in the Ray pods.
CONFIG_DIR = "/etc/daedalus"
CONFIG_KEY = "config.json"
#: Key of the control token in the job's Secret; the head container gets it as the environment variable
#: :data:`ENV_TOKEN` (``env.valueFrom.secretKeyRef``), not as a file: a Secret volume is root-owned and the trainer
#: image runs as uid 10001 without an fsGroup, so a 0400 token file would be unreadable to it.
TOKEN_KEY = "token"
ENV_TOKEN = "DAEDALUS_CONTROL_TOKEN"
#: Ray token authentication (Ray >= 2.52; docs.ray.io, "Ray token authentication", and KubeRay's
#: ray-cluster.auth-manual sample): every container of the job's RayCluster runs with ``RAY_AUTH_MODE=token`` and
#: ``RAY_AUTH_TOKEN`` from the same Secret key, so the dashboard's job API and the GCS refuse callers without it (the
#: health endpoints KubeRay's probes use stay open); the operator sends it as ``Authorization: Bearer``.
ENV_RAY_AUTH_MODE = "RAY_AUTH_MODE"
ENV_RAY_AUTH_TOKEN = "RAY_AUTH_TOKEN"
#: The Ray job's entrypoint; ``{config}`` is replaced by the config file path.
ENTRYPOINT = "python -m daedalus_trainer train --config {config} --resume latest"
#: Environment variables the operator passes to the Ray job (runtime_env.env_vars) and the trainer reads.
ENV_PORT = "DAEDALUS_METRICS_PORT"
ENV_ATTEMPT = "DAEDALUS_ATTEMPT"
ENV_JOB = "DAEDALUS_JOB"
ENV_NAMESPACE = "DAEDALUS_NAMESPACE"
ENV_SUBMISSION_ID = "DAEDALUS_SUBMISSION_ID"

# ------------------------------------------------------------------------------------------------ conditions
class ConditionType(str, enum.Enum):
    """Condition types (kstatus reads Ready/Reconciling/Stalled: https://github.com/kubernetes-sigs/cli-utils/blob/
    master/pkg/kstatus/README.md)."""

    READY = "Ready"
    RECONCILING = "Reconciling"
    STALLED = "Stalled"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


class Reason(str, enum.Enum):
    """CamelCase reasons used in conditions, ``lastFailure.reason`` and events (metav1.Condition reason pattern
    ``^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$``)."""

    # progress
    PROVISIONING = "Provisioning"
    SUBMITTED = "Submitted"
    RUNNING = "Running"
    CHECKPOINTING = "Checkpointing"
    RECOVERING = "Recovering"
    RESUBMITTED = "Resubmitted"
    RECOVERED = "Recovered"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    SUCCEEDED = "Succeeded"
    SERVING = "ServingCreated"
    AS_EXPECTED = "AsExpected"
    # failures (lastFailure.reason, restarts_total{reason})
    NODE_REPLACEMENT = "NodeReplacement"
    NODE_REBOOT = "NodeReboot"
    NODE_DRAIN = "NodeDrain"  # cordoned, tainted for removal (DRAIN_TAINTS) or being deleted
    NODE_LOST = "NodeLost"
    WORKER_LOST = "WorkerLost"
    HEAD_LOST = "HeadLost"
    CLUSTER_LOST = "ClusterLost"
    JOB_FAILED = "JobFailed"
    JOB_STOPPED = "JobStopped"
    APPLICATION_ERROR = "ApplicationError"
    HUNG = "Hung"
    SUSPEND = "Suspend"
    SPEC_FIXED = "SpecFixed"  # a job failed for an invalid spec resumes once it is valid again (the user's restart)
    # terminal / stalled
    INVALID_SPEC = "InvalidSpec"
    RESTART_LIMIT = "RestartLimitExceeded"
    CHECKPOINT_TIMEOUT = "CheckpointTimeout"
    API_ERROR = "APIError"


#: Failure reasons caused by infrastructure (the job is resumed; the application is not blamed).
INFRASTRUCTURE_REASONS = frozenset({
    Reason.NODE_REPLACEMENT, Reason.NODE_REBOOT, Reason.NODE_DRAIN, Reason.NODE_LOST, Reason.WORKER_LOST,
    Reason.HEAD_LOST, Reason.CLUSTER_LOST, Reason.JOB_FAILED, Reason.JOB_STOPPED,
})
#: Reasons announced ahead of time (HyperPod labels, a node drained or cordoned, suspend: a checkpoint is taken first)
#: or restarts the user made (an invalid spec fixed): no restart backoff, no count against maxRestarts.
PLANNED_REASONS = frozenset({Reason.NODE_REPLACEMENT, Reason.NODE_REBOOT, Reason.NODE_DRAIN, Reason.SUSPEND,
                             Reason.SPEC_FIXED})


class EventType(str, enum.Enum):
    """core/v1 Event types."""

    NORMAL = "Normal"
    WARNING = "Warning"


# ------------------------------------------------------------------------------------------------ names
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
#: Maximum lengths (see the module docstring).
MAX_NAME = 63
MAX_RAYCLUSTER_NAME = 53
MAX_RAYSERVICE_NAME = 36


def fit_name(name: str, limit: int = MAX_NAME) -> str:
    """``name`` if it has at most ``limit`` characters, else a prefix of it + ``-`` + 8 hex digits of its SHA-256.

    The result is a valid DNS label when ``name`` is one (a trailing ``-`` of the prefix is dropped).

    Raises:
        ValueError: ``limit`` < 10 (no room for the hash suffix).
    """
    if limit < 10:
        raise ValueError(f"limit must be at least 10, got {limit}")
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    prefix = name[: limit - 9].rstrip("-.")
    return f"{prefix}-{digest}"


def is_dns_label(name: str) -> bool:
    """True for an RFC 1123 DNS label of at most 63 characters."""
    return len(name) <= MAX_NAME and bool(_DNS_LABEL.match(name))


def raycluster_name(job: str) -> str:
    """Name of the job's RayCluster (at most 53 characters)."""
    return fit_name(f"{job}-ray", MAX_RAYCLUSTER_NAME)


def config_map_name(job: str) -> str:
    """Name of the ConfigMap holding the resolved trainer config (at most 63 characters)."""
    return fit_name(f"{job}-config")


def secret_name(job: str) -> str:
    """Name of the Secret holding the trainer control token (at most 63 characters)."""
    return fit_name(f"{job}-control")


def network_policy_name(job: str) -> str:
    """Name of the job's NetworkPolicy (at most 63 characters)."""
    return fit_name(f"{job}-ray")


def disruption_budget_name(job: str) -> str:
    """Name of the job's PodDisruptionBudget (at most 63 characters)."""
    return fit_name(f"{job}-ray")


def rayservice_name(job: str) -> str:
    """Name of the serving RayService (at most 36 characters)."""
    return fit_name(f"{job}-serve", MAX_RAYSERVICE_NAME)


def head_service_name(cluster: str) -> str:
    """KubeRay's head Service name for a RayCluster (``<cluster>-head-svc``, utils.GenerateHeadServiceName)."""
    return f"{cluster}-head-svc"


def submission_id(job: str, uid: str, attempt: int) -> str:
    """Deterministic Ray job submission id ``<job>-<uid8>-a<attempt>``: the job name, the first 8 characters of the
    object's UID without dashes (a re-created job with the same name gets new ids), and the 1-based attempt.

    Raises:
        ValueError: attempt < 1 or an empty uid.
    """
    if attempt < 1:
        raise ValueError(f"attempt is 1-based, got {attempt}")
    uid8 = uid.replace("-", "")[:8]
    if not uid8:
        raise ValueError("the job has no metadata.uid")
    return f"{job}-{uid8}-a{attempt}"


def checkpoint_root(checkpoint_path: str, namespace: str, job: str) -> str:
    """``<checkpoint.path>/<namespace>/<job>``: where the trainer writes the job's checkpoints."""
    return f"{checkpoint_path.rstrip('/')}/{namespace}/{job}"


def adapter_export_path(checkpoint_path: str, namespace: str, job: str) -> str:
    """``<checkpoint.path>/<namespace>/<job>/exports/adapter``: the exported PEFT adapter of a finished job."""
    return f"{checkpoint_root(checkpoint_path, namespace, job)}/exports/adapter"
