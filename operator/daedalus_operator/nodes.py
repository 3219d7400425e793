"""Pure readers: Kubernetes Node, Pod and KubeRay RayCluster bodies -> small values the planner decides on.

No I/O here; the kopf indexes that collect the bodies live in :mod:`daedalus_operator.handlers`.

- :func:`node_health` turns the job's pods and the nodes under them into a :class:`NodeHealth`: nodes that SageMaker
  HyperPod announced for replacement or reboot (label ``sagemaker.amazonaws.com/node-health-status``), nodes that are
  gone or not Ready, pods that failed, are being deleted, went missing or were replaced after the attempt started, and
  pods sitting on nodes that should not run them (to be deleted so KubeRay reschedules them).
- :func:`read_cluster` turns a RayCluster body into a :class:`ClusterState` (ready or not, head address and ports as
  KubeRay publishes them in ``status.head`` and ``status.endpoints``).

Sources: core/v1 Node and Pod (https://kubernetes.io/docs/reference/kubernetes-api/), HyperPod node labels
(https://docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-hyperpod-eks-resiliency-node-labels.html), KubeRay v1.7
RayCluster status (``state``, ``conditions`` HeadPodReady / RayClusterProvisioned, ``head.serviceIP``,
``endpoints``; ray-operator/apis/ray/v1/raycluster_types.go).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

from daedalus_operator import api
from daedalus_operator.api import NodeHealthStatus, Reason

ANNOUNCED = {
    NodeHealthStatus.PENDING_REPLACEMENT.value: Reason.NODE_REPLACEMENT,
    NodeHealthStatus.PENDING_REBOOT.value: Reason.NODE_REBOOT,
}


def parse_time(value: str | None) -> dt.datetime | None:
    """Parse an RFC 3339 timestamp (``2026-01-02T03:04:05Z``, fractional seconds and offsets accepted, and the
    lower-case ``t`` and ``z`` RFC 3339 allows, which the API server's ``format: date-time`` check accepts too) into
    an aware UTC datetime; ``None`` for ``None`` or an empty string.

    Raises:
        ValueError: not an RFC 3339 timestamp.
    """
    if not value:
        return None
    if value[-1] in "Zz":  # fromisoformat reads "Z" (Python 3.11) but not "z"
        value = value[:-1] + "+00:00"
    return dt.datetime.fromisoformat(value).astimezone(dt.timezone.utc)


def format_time(value: dt.datetime) -> str:
    """RFC 3339 UTC with second precision (the metav1.Time wire format)."""
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass(frozen=True)
class NodeIssue:
    """A node under the job's pods that needs action: ``reason`` is NodeReplacement / NodeReboot (announced by
    HyperPod), NodeDrain (cordoned, tainted for removal or being deleted) or NodeLost (gone, not Ready); ``pods`` are
    the job's pods on it."""

    node: str
    reason: Reason
    message: str
    pods: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PodIssue:
    """A job pod that is no longer a healthy member of the attempt. ``role`` is ``head`` or ``worker``; ``reason`` is
    one of PodFailed, PodDeleting, PodNotReady, PodReplaced, PodMissing (``pod`` is empty for PodMissing).

    ``not_ready_since`` is set only for a PodNotReady pod that may just be blinking: phase Running or Pending, on a
    node that exists and is Ready; it is the ``lastTransitionTime`` of the pod's ``Ready`` condition (when Kubernetes
    last flipped it), from which the planner counts the pod's grace period (:meth:`NodeHealth.within_grace`).
    ``None`` for every other issue, including a not-Ready pod whose node is gone or not Ready, or whose ``Ready``
    condition has no transition time: lost at once."""

    pod: str
    node: str | None
    role: str
    reason: str
    message: str
    not_ready_since: dt.datetime | None = None


@dataclasses.dataclass(frozen=True)
class NodeHealth:
    """Health of the nodes and pods under one job.

    Attributes:
        announced: nodes HyperPod labelled UnschedulablePendingReplacement / UnschedulablePendingReboot, and (with
            ``drain``) Ready nodes being emptied under pods not already being deleted (NodeDrain).
        lost_nodes: nodes that are gone or not Ready (``Ready`` condition False/Unknown).
        lost_pods: pods that failed, are being deleted, are not Ready, were (re)created after the attempt started, or
            are missing (fewer pods than the spec asks for). A not-Ready pod on a Ready node is listed at once; the
            planner tolerates it for a grace period (:meth:`within_grace`).
        bad_pods: names of pods on nodes that must not run them (announced, HyperPod-unschedulable, not Ready,
            draining or gone), not already being deleted: deleted during recovery so that KubeRay recreates them on
            good nodes.
        pods: number of the job's pods (not being deleted).
        ready_pods: how many of them are Running and Ready.
        unscheduled: ``"<pod>: <scheduler message>"`` for pods the scheduler could not place (``PodScheduled``
            False), for the Provisioning condition's message.
        not_starting: ``"pod <pod>: container <name>: <reason>: <kubelet message>"`` for each container (init
            containers first, as ``init container <name>``) of a live pod that waits for another reason than being
            created or its pod initialising (:data:`STARTING_REASONS`): a wrong image (``ErrImagePull``,
            ``ImagePullBackOff``, ``InvalidImageName``), a missing Secret or ConfigMap key or a root image under
            ``runAsNonRoot`` (``CreateContainerConfigError``), a crashing process (``CrashLoopBackOff``). Also for
            the Provisioning and Recovering conditions' messages: the kubelet says why the cluster does not come up.
            A volume that cannot be mounted leaves its pod ``ContainerCreating``: only the pod's events say so.
        head_created: ``creationTimestamp`` of the newest head pod not being deleted (``None`` without one): a head
            created after an attempt started is a new Ray cluster that cannot be running that attempt's Ray job.
        not_ready: ``(pod, since)`` for each pod in phase Running, not Ready, not being deleted, on a node that
            exists, is Ready and may run it (else it is in ``bad_pods`` already), whatever the attempt: ``since`` is
            the later of its ``Ready`` condition's ``lastTransitionTime`` and its containers' latest start
            (``state.running.startedAt``), so the time a pod spent pulling its image or restarting a container does
            not count. A pod without a usable time is not listed. The planner deletes those not Ready for longer
            than its grace while provisioning or recovering (:meth:`stale_not_ready`).
    """

    announced: tuple[NodeIssue, ...] = ()
    lost_nodes: tuple[NodeIssue, ...] = ()
    lost_pods: tuple[PodIssue, ...] = ()
    bad_pods: tuple[str, ...] = ()
    pods: int = 0
    ready_pods: int = 0
    head_created: dt.datetime | None = None
    unscheduled: tuple[str, ...] = ()
    not_ready: tuple[tuple[str, dt.datetime], ...] = ()
    not_starting: tuple[str, ...] = ()

    @property
    def head_lost(self) -> bool:
        """True when the head pod failed, is being deleted, is not Ready, went missing or was replaced during the
        attempt (a new head is a new Ray cluster: the running Ray job is gone with the old one)."""
        return any(p.role == "head" for p in self.lost_pods)

    def within_grace(self, now: dt.datetime, grace: float) -> tuple[NodeHealth, float | None]:
        """This health without the not-Ready pods still inside their grace period, and the seconds until the first of
        those runs out (``None`` when there is none).

        A PodNotReady issue with ``not_ready_since`` (a Running or Pending pod on a Ready node) is tolerated while
        ``now - not_ready_since <= grace`` seconds: a readiness probe failing for a few seconds under load is no lost
        pod. ``grace`` 0 tolerates nothing. Every other issue is kept.
        """
        if grace <= 0:
            return self, None
        kept: list[PodIssue] = []
        left: list[float] = []
        for p in self.lost_pods:
            waited = None if p.not_ready_since is None else (now - p.not_ready_since).total_seconds()
            if waited is not None and waited <= grace:
                left.append(grace - waited)
            else:
                kept.append(p)
        if not left:
            return self, None
        return dataclasses.replace(self, lost_pods=tuple(kept)), min(left)

    def stale_not_ready(self, now: dt.datetime, grace: float) -> tuple[tuple[str, ...], float | None]:
        """The pods of :attr:`not_ready` not Ready for longer than ``grace`` seconds at ``now`` (sorted names), and
        the seconds until the first of the others gets there (``None`` when there is none). ``grace <= 0`` lists
        none: a pod KubeRay just recreated is never Ready at once, so "no grace" would delete every new pod."""
        if grace <= 0:
            return (), None
        stale: list[str] = []
        left: list[float] = []
        for name, since in self.not_ready:
            waited = (now - since).total_seconds()
            if waited > grace:
                stale.append(name)
            else:
                left.append(grace - waited)
        return tuple(sorted(stale)), (min(left) if left else None)

    @property
    def only_not_ready(self) -> bool:
        """True when the only problems are pods not Ready on Ready nodes (PodNotReady with ``not_ready_since``): the
        Ray pods and their nodes are all still there, so a checkpoint is worth asking for before stopping."""
        return (bool(self.lost_pods) and not self.announced and not self.lost_nodes
                and all(p.not_ready_since is not None for p in self.lost_pods))

    def first_issue(self) -> tuple[Reason, str | None, str] | None:
        """The most important problem as ``(reason, node, message)``, or ``None`` when healthy.

        Order: announced node (checkpoint first) > head lost > node lost > worker lost.
        """
        if self.announced:
            i = self.announced[0]
            return i.reason, i.node, i.message
        if self.head_lost:
            p = next(p for p in self.lost_pods if p.role == "head")
            return Reason.HEAD_LOST, p.node, f"head pod {p.pod or '(missing)'}: {p.message}"
        if self.lost_nodes:
            i = self.lost_nodes[0]
            return Reason.NODE_LOST, i.node, i.message
        if self.lost_pods:
            p = self.lost_pods[0]
            return Reason.WORKER_LOST, p.node, f"worker pod {p.pod or '(missing)'}: {p.message}"
        return None


def _labels(body: Mapping[str, Any]) -> Mapping[str, str]:
    return (body.get("metadata") or {}).get("labels") or {}


def _condition(body: Mapping[str, Any], ctype: str) -> Mapping[str, Any] | None:
    for c in (body.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c
    return None


def node_ready(node: Mapping[str, Any]) -> bool:
    """True when the Node's ``Ready`` condition is ``True``."""
    c = _condition(node, "Ready")
    return c is not None and c.get("status") == "True"


def hyperpod_status(node: Mapping[str, Any]) -> str | None:
    """The node's HyperPod health label value, or ``None`` when the label is absent (not a HyperPod node)."""
    return _labels(node).get(api.HYPERPOD_HEALTH_LABEL)


def node_draining(node: Mapping[str, Any]) -> str | None:
    """Why the node is being emptied, in a few words, or ``None`` when it is not: being deleted
    (``metadata.deletionTimestamp``: Karpenter's termination finalizer drains it first), tainted for removal
    (:data:`api.DRAIN_TAINTS`, effect NoSchedule or NoExecute: Karpenter, the cluster autoscaler, an EKS managed node
    group update), or cordoned (``spec.unschedulable``: ``kubectl cordon`` and ``kubectl drain``). Checked in that
    order."""
    spec = node.get("spec") or {}
    if (node.get("metadata") or {}).get("deletionTimestamp"):
        return "is being deleted"
    for taint in spec.get("taints") or []:
        key = taint.get("key")
        if key in api.DRAIN_TAINTS and taint.get("effect") in ("NoSchedule", "NoExecute") and \
                api.DRAIN_TAINTS[key] in (None, taint.get("value")):
            shown = key if api.DRAIN_TAINTS[key] is None else f"{key}={taint.get('value')}"
            return f"is tainted {shown}:{taint['effect']} (to be removed)"
    if spec.get("unschedulable"):
        return "is cordoned"
    return None


def node_schedulable(node: Mapping[str, Any], *, hyperpod: bool) -> bool:
    """True when a new job pod may be placed there: Ready, not draining (:func:`node_draining`: cordoned, tainted for
    removal, being deleted), and (``hyperpod``) labelled Schedulable (or not labelled at all: a node outside
    HyperPod's management)."""
    if not node_ready(node) or node_draining(node) is not None:
        return False
    if hyperpod:
        value = hyperpod_status(node)
        return value is None or value == NodeHealthStatus.SCHEDULABLE.value
    return True


def pod_role(pod: Mapping[str, Any]) -> str:
    """``head`` or ``worker`` from KubeRay's ``ray.io/node-type`` label (unknown values count as worker)."""
    return "head" if _labels(pod).get(api.RAY_NODE_TYPE_LABEL) == "head" else "worker"


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """True when the Pod is Running and its ``Ready`` condition is ``True``."""
    status = pod.get("status") or {}
    c = _condition(pod, "Ready")
    return status.get("phase") == "Running" and c is not None and c.get("status") == "True"


def _transition_time(condition: Mapping[str, Any] | None) -> dt.datetime | None:
    """The condition's ``lastTransitionTime``, or ``None`` when it is absent or not RFC 3339."""
    try:
        return parse_time((condition or {}).get("lastTransitionTime"))
    except (TypeError, ValueError):
        return None


def _not_ready_since(pod: Mapping[str, Any]) -> dt.datetime | None:
    """From when a Running pod that is not Ready counts as such: the later of its ``Ready`` condition's
    ``lastTransitionTime`` and the newest ``state.running.startedAt`` of its containers (a pod that pulled its image
    for minutes, or whose container just restarted, has had no chance to pass its readiness probe before that);
    ``None`` when neither is known."""
    times = [_transition_time(_condition(pod, "Ready"))]
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        try:
            times.append(parse_time(((cs.get("state") or {}).get("running") or {}).get("startedAt")))
        except (TypeError, ValueError):
            pass
    known = [t for t in times if t is not None]
    return max(known) if known else None


#: ``state.waiting.reason`` of a container on its way up (core/v1 ContainerStateWaiting; the kubelet's
#: ``ContainerCreating`` while it pulls and creates, ``PodInitializing`` while init containers run): not a problem.
STARTING_REASONS = frozenset({"ContainerCreating", "PodInitializing"})


#: The two states the kubelet alternates between while an image cannot be pulled (a failed pull, then a back-off
#: before the next): quoted as one, so the condition does not change on every retry.
PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff"})


def _not_starting(pod: Mapping[str, Any]) -> list[str]:
    """What the kubelet says of each container of ``pod`` waiting for another reason than :data:`STARTING_REASONS`
    (see :attr:`NodeHealth.not_starting`), in words that stay the same while the cause does (each change is a status
    write): an image that cannot be pulled is ``ImagePullBackOff: cannot pull image "<image>"`` in both
    :data:`PULL_REASONS` (the registry's answer is in the pod's events); a crash loop quotes how the container last
    ended (``lastState.terminated``: reason, exit code), not the back-off message, whose delay grows; any other
    reason comes with the kubelet's message, cut at 300 characters."""
    name = (pod.get("metadata") or {}).get("name", "")
    status = pod.get("status") or {}
    out = []
    for kind, key in (("init container", "initContainerStatuses"), ("container", "containerStatuses")):
        for cs in status.get(key) or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if not reason or reason in STARTING_REASONS:
                continue
            if reason in PULL_REASONS:
                reason, message = "ImagePullBackOff", f'cannot pull image "{cs.get("image", "")}"'
            elif reason == "CrashLoopBackOff":
                ended = (cs.get("lastState") or {}).get("terminated") or {}
                message = f"last ended {ended.get('reason') or 'Error'}, exit code {ended.get('exitCode')}" \
                    if ended else ""
            else:
                message = " ".join(str(waiting.get("message") or "").split())[:300]
            out.append(f"pod {name}: {kind} {cs.get('name')}: {reason}: {message}".rstrip(": "))
    return out


def _terminated_reason(pod: Mapping[str, Any]) -> str:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        for key in ("state", "lastState"):
            term = (cs.get(key) or {}).get("terminated")
            if term:
                return f"container {cs.get('name')} terminated: {term.get('reason') or 'exit ' + str(term.get('exitCode'))}"
    return (pod.get("status") or {}).get("reason") or ""


def node_health(
    pods: Iterable[Mapping[str, Any]],
    nodes: Mapping[str, Mapping[str, Any]],
    *,
    hyperpod: bool,
    drain: bool = False,
    since: dt.datetime | None = None,
    expected_pods: int | None = None,
) -> NodeHealth:
    """Summarise the health of one job's pods and the nodes under them.

    Args:
        pods: Pod bodies labelled with the job (``daedalus.dev/job``).
        nodes: Node bodies by name (all nodes the operator knows; a pod's node missing here counts as lost).
        hyperpod: read the HyperPod health label (``spec.resilience.hyperPod``).
        drain: a Ready node under live job pods that is being emptied (:func:`node_draining`: cordoned, tainted for
            removal, being deleted) is announced as NodeDrain (``spec.resilience.checkpointOnDrain``). Either way its
            pods are in ``bad_pods``.
        since: start of the current attempt; pods created after it replaced a member of the attempt. ``None``
            disables the check (no attempt running).
        expected_pods: head + worker replicas the RayCluster asks for; fewer pods counts as missing.

    Returns:
        The :class:`NodeHealth`; issues are sorted by node and pod name so the result is deterministic.
    """
    pods = sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", ""))
    by_node: dict[str, list[str]] = {}
    lost_pods: list[PodIssue] = []
    bad_pods: list[str] = []
    live = 0
    ready = 0
    roles_present: dict[str, int] = {"head": 0, "worker": 0}
    deleting: set[str] = set()
    head_created: dt.datetime | None = None
    unscheduled: list[str] = []
    not_ready: list[tuple[str, dt.datetime]] = []
    not_starting: list[str] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        name = meta.get("name", "")
        node = (pod.get("spec") or {}).get("nodeName")
        role = pod_role(pod)
        phase = (pod.get("status") or {}).get("phase")
        if node:
            by_node.setdefault(node, []).append(name)
        if meta.get("deletionTimestamp"):
            lost_pods.append(PodIssue(name, node, role, "PodDeleting", "being deleted"))
            deleting.add(name)
            continue
        live += 1
        roles_present[role] += 1
        created = parse_time(meta.get("creationTimestamp"))
        if role == "head" and created is not None and (head_created is None or created > head_created):
            head_created = created
        if phase in ("Failed", "Succeeded"):
            lost_pods.append(PodIssue(name, node, role, "PodFailed",
                                      f"phase {phase}" + (f", {_terminated_reason(pod)}" if _terminated_reason(pod) else "")))
            bad_pods.append(name)
            continue
        sched = _condition(pod, "PodScheduled")
        if sched is not None and sched.get("status") == "False":
            unscheduled.append(f"pod {name}: {sched.get('reason') or 'Unschedulable'}: {sched.get('message') or ''}"
                               .rstrip(": "))
        not_starting.extend(_not_starting(pod))
        is_ready = pod_ready(pod)
        ready += is_ready
        host = nodes.get(node) if node else None
        if (not is_ready and phase == "Running" and host is not None
                and node_schedulable(host, hyperpod=hyperpod)):
            since_not_ready = _not_ready_since(pod)
            if since_not_ready is not None:
                not_ready.append((name, since_not_ready))
        if since is not None and created is not None and created > since:
            lost_pods.append(PodIssue(name, node, role, "PodReplaced",
                                      f"created {format_time(created)} after the attempt started {format_time(since)}"))
        elif since is not None and not is_ready:
            host_ready = host is not None and node_ready(host)
            # a pod on a Ready node may be blinking (a readiness probe failing under load): the planner gives it a
            # grace period from its Ready condition's last flip; on a gone or NotReady node it is lost at once
            cond = _condition(pod, "Ready")
            changed = _transition_time(cond) if (host_ready and phase in ("Running", "Pending") and cond is not None
                                                 and cond.get("status") != "True") else None
            where = (f" since {format_time(changed)}" if changed else "" if host_ready
                     else ", on no node" if not node else f", node {node} gone" if host is None
                     else f", node {node} not Ready")
            lost_pods.append(PodIssue(name, node, role, "PodNotReady", f"phase {phase or 'Unknown'}, not Ready{where}",
                                      not_ready_since=changed))

    announced: list[NodeIssue] = []
    lost_nodes: list[NodeIssue] = []
    for node_name in sorted(by_node):
        on_node = tuple(by_node[node_name])
        node = nodes.get(node_name)
        if node is None:
            lost_nodes.append(NodeIssue(node_name, Reason.NODE_LOST, f"node {node_name} no longer exists", on_node))
            bad_pods.extend(on_node)
            continue
        label = hyperpod_status(node) if hyperpod else None
        draining = node_draining(node) if drain else None
        if label in ANNOUNCED:
            announced.append(NodeIssue(node_name, ANNOUNCED[label], f"node {node_name} is {label}", on_node))
        elif not node_ready(node):
            c = _condition(node, "Ready")
            state = c.get("status") if c else "missing"
            lost_nodes.append(NodeIssue(node_name, Reason.NODE_LOST, f"node {node_name} Ready={state}", on_node))
        elif draining is not None and any(n not in deleting for n in on_node):
            announced.append(NodeIssue(node_name, Reason.NODE_DRAIN, f"node {node_name} {draining}", on_node))
        if not node_schedulable(node, hyperpod=hyperpod):
            bad_pods.extend(on_node)

    if expected_pods is not None and since is not None:
        if roles_present["head"] == 0:
            lost_pods.append(PodIssue("", None, "head", "PodMissing", "no head pod"))
        missing_workers = expected_pods - 1 - roles_present["worker"]
        for _ in range(max(0, missing_workers)):
            lost_pods.append(PodIssue("", None, "worker", "PodMissing", "fewer worker pods than the spec asks for"))

    return NodeHealth(
        announced=tuple(announced),
        lost_nodes=tuple(lost_nodes),
        lost_pods=tuple(lost_pods),
        bad_pods=tuple(sorted(set(bad_pods) - deleting)),
        pods=live,
        ready_pods=ready,
        head_created=head_created,
        unscheduled=tuple(unscheduled),
        not_ready=tuple(not_ready),
        not_starting=tuple(not_starting),
    )


# ------------------------------------------------------------------------------------------------ RayCluster
@dataclasses.dataclass(frozen=True)
class ClusterState:
    """What the operator needs from its RayCluster.

    Attributes:
        exists: the object exists (possibly being deleted).
        ready: KubeRay reports it ready (``status.state == "ready"``, or both HeadPodReady and
            RayClusterProvisioned conditions True) and a head address is known.
        deleting: ``metadata.deletionTimestamp`` is set.
        head_host: ``status.head.serviceIP``, else ``status.head.podIP``, else the head Service's cluster DNS name.
        dashboard_port / control_port: from ``status.endpoints`` (KubeRay copies the head Service's ports there),
            defaulting to 8265 / 9400.
        state: KubeRay's ``status.state`` (``ready``, ``suspended``, ...), empty when absent.
        message: ``status.reason`` or the message of a False condition, for humans.
        created: ``metadata.creationTimestamp`` (``None`` when absent).
        reported: KubeRay has written any ``status`` (its first reconcile does, within seconds of the creation): a
            RayCluster that stays without one is one no KubeRay operator reconciles.
        expected_pods: the pods its spec asks for: 1 (the head) + ``replicas x numOfHosts`` of each worker group
            that is not suspended (KubeRay's defaults: 0 replicas, 1 host); ``None`` when it does not exist. The
            operator never patches a RayCluster, so after an edit of the job's worker groups this, not the job's
            spec, is what the running cluster can have.
    """

    exists: bool = False
    ready: bool = False
    deleting: bool = False
    head_host: str | None = None
    dashboard_port: int = api.DASHBOARD_PORT
    control_port: int = api.CONTROL_PORT
    state: str = ""
    message: str = ""
    created: dt.datetime | None = None
    expected_pods: int | None = None
    reported: bool = True

    @property
    def dashboard_url(self) -> str | None:
        """``http://<head>:<dashboard port>`` (the Ray job submission REST API), or ``None`` without a head."""
        return f"http://{self.head_host}:{self.dashboard_port}" if self.head_host else None

    @property
    def control_url(self) -> str | None:
        """``http://<head>:<control port>`` (the trainer's /status and /checkpoint), or ``None`` without a head."""
        return f"http://{self.head_host}:{self.control_port}" if self.head_host else None


def _port(endpoints: Mapping[str, Any], name: str, default: int) -> int:
    try:
        return int(endpoints.get(name, default))
    except (TypeError, ValueError):
        return default


def _count(value: Any, default: int) -> int:
    try:
        return max(0, int(value if value is not None else default))
    except (TypeError, ValueError):
        return default


def expected_cluster_pods(body: Mapping[str, Any]) -> int:
    """Pods a RayCluster body's spec asks for: the head + ``replicas x numOfHosts`` of each worker group not
    ``suspend``-ed (missing fields take KubeRay v1.7's CRD defaults, ``replicas`` 0 and ``numOfHosts`` 1)."""
    groups = (body.get("spec") or {}).get("workerGroupSpecs") or []
    return 1 + sum(_count(g.get("replicas"), 0) * _count(g.get("numOfHosts"), 1)
                   for g in groups if isinstance(g, Mapping) and not g.get("suspend"))


#: KubeRay's RayCluster condition that is True on a failed pod create or delete (rayv1.RayClusterReplicaFailure).
REPLICA_FAILURE = "ReplicaFailure"


def read_cluster(body: Mapping[str, Any] | None, *, control_port: int = api.CONTROL_PORT) -> ClusterState:
    """Read a RayCluster body (``None`` when it does not exist) into a :class:`ClusterState`.

    ``control_port`` is the port the operator asked the trainer to serve on; ``status.endpoints`` wins when it lists
    the ``trainer-metrics`` port.
    """
    if body is None:
        return ClusterState(exists=False, control_port=control_port)
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    head = status.get("head") or {}
    endpoints = status.get("endpoints") or {}
    conds = {c.get("type"): c for c in status.get("conditions") or []}
    state = status.get("state") or ""
    # KubeRay keeps `state: ready` (and the head's serviceIP) after the head pod is lost, until suspend: when it
    # publishes conditions, HeadPodReady (with RayClusterProvisioned) is what says the head answers now.
    if "HeadPodReady" in conds:
        up = all((conds.get(t) or {}).get("status") == "True" for t in ("HeadPodReady", "RayClusterProvisioned"))
    else:
        up = state == "ready"
    host = head.get("serviceIP") or head.get("podIP")
    if not host and meta.get("name") and meta.get("namespace") and up:
        host = f"{api.head_service_name(meta['name'])}.{meta['namespace']}.svc"
    # A condition says a problem when False, except ReplicaFailure: KubeRay sets it True when creating or deleting a
    # pod failed, with the API server's answer (a quota, Pod Security admission refusing the pod), and removes it once
    # that works (ray-operator/controllers/ray/raycluster_controller.go, calculateStatus).
    problems = [f"{t}: {c.get('message') or c.get('reason')}" for t, c in conds.items()
                if (c.get("status") == "True") == (t == REPLICA_FAILURE)]
    return ClusterState(
        exists=True,
        ready=bool(up and host) and not meta.get("deletionTimestamp"),
        deleting=bool(meta.get("deletionTimestamp")),
        head_host=host or None,
        dashboard_port=_port(endpoints, api.DASHBOARD_PORT_NAME, api.DASHBOARD_PORT),
        control_port=_port(endpoints, api.CONTROL_PORT_NAME, control_port),
        state=state,
        message=status.get("reason") or "; ".join(problems),
        created=parse_time(meta.get("creationTimestamp")),
        expected_pods=expected_cluster_pods(body),
        reported=bool(status),
    )
