"""A test fixture that plays KubeRay (and the bits of the scheduler and kubelet KubeRay relies on) against the
honest kmock API, over HTTP like a real controller.

Every ``interval`` seconds, for each RayCluster:

- **KubeRay**: creates the head pod ``<cluster>-head-<5>`` and ``replicas`` worker pods ``<cluster>-<group>-worker-<5>``
  per group from the pod templates, with KubeRay's labels (``ray.io/cluster``, ``ray.io/node-type``, ``ray.io/group``)
  and an owner reference to the RayCluster (so deleting the cluster garbage-collects them); recreates deleted pods;
  writes ``status``: ``state: ready`` and the ``HeadPodReady`` / ``RayClusterProvisioned`` conditions when every pod is
  Ready, ``head.serviceIP``/``podIP`` = ``head_host`` (127.0.0.1, where a **real local Ray head** listens), and
  ``endpoints`` from the head container's named ports, with ``dashboard`` mapped to the real head's dashboard port.
- **scheduler**: binds pending pods to a Node that satisfies ``nodeSelector``, required node affinity
  (In/NotIn/Exists/DoesNotExist), taints/tolerations, Ready and not cordoned (fewest pods first); pods that fit
  nowhere stay Pending (``PodScheduled=False``, Unschedulable).
- **kubelet / node lifecycle**: marks bound pods Running and Ready; a pod on a NotReady node becomes not Ready; a
  pod whose Node was deleted is deleted (pod GC). ConfigMap and Secret volumes of head pods are written to their
  ``mountPath`` when it lies under ``volume_root`` (so the trainer on the local head reads its config), and the head
  container's environment, ``valueFrom.secretKeyRef`` resolved from the Secret (the control token), to
  ``<volume_root>/pod-env/<namespace>/<job>.json``: the shared local Ray head cannot take a per-pod environment, so
  the test entrypoints start through ``pod_env.py``, which adds it to the Ray job's environment as a container's
  environment underlies the Ray job's own ``env_vars``.

Node objects are made by :func:`node_body` / :meth:`FakeKubeRay.add_node`; tests flip the HyperPod label with
:meth:`FakeKubeRay.set_node_health` and lose a cluster's head with :meth:`FakeKubeRay.lose_head` (the head pod goes,
its replacement stays unscheduled for a while, then comes up as a new Ray head: optionally another real Ray head).
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
import logging
import random
import string
import threading
import time
from pathlib import Path
from typing import Any

from kmock_api import ApiError, KubeClient

log = logging.getLogger("fake-kuberay")

RAYCLUSTERS = "ray.io/v1/rayclusters"
PODS = "v1/pods"
NODES = "v1/nodes"
CONFIGMAPS = "v1/configmaps"
SECRETS = "v1/secrets"
HEALTH = "sagemaker.amazonaws.com/node-health-status"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _suffix() -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=5))


def node_body(name: str, *, health: str | None = "Schedulable", instance_type: str | None = None, ready: bool = True,
              taints: list[dict] | None = None) -> dict:
    """A Node object with the HyperPod health label, an instance type and a Ready condition."""
    labels = {"kubernetes.io/hostname": name}
    if health is not None:
        labels[HEALTH] = health
    if instance_type:
        labels["node.kubernetes.io/instance-type"] = instance_type
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
            "spec": {"taints": taints} if taints else {},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                       "reason": "KubeletReady", "lastTransitionTime": _now()}]}}


def _matches_expr(expr: dict, labels: dict[str, str]) -> bool:
    key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    return False


def _tolerated(taint: dict, tolerations: list[dict]) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t.get("key") == taint.get("key")):
            return True
        if t.get("key") == taint.get("key") and t.get("value") == taint.get("value"):
            return True
    return False


def fits(pod_spec: dict, node: dict) -> bool:
    """Scheduler predicate: Ready, not cordoned, nodeSelector, required node affinity, NoSchedule/NoExecute taints."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    conds = {c["type"]: c.get("status") for c in (node.get("status") or {}).get("conditions") or []}
    if conds.get("Ready") != "True" or (node.get("spec") or {}).get("unschedulable"):
        return False
    if any(labels.get(k) != v for k, v in (pod_spec.get("nodeSelector") or {}).items()):
        return False
    req = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    if req:
        terms = req.get("nodeSelectorTerms") or []
        if not any(all(_matches_expr(e, labels) for e in t.get("matchExpressions") or []) for t in terms):
            return False
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(taint, pod_spec.get("tolerations")
                                                                                 or []):
            return False
    return True


class FakeKubeRay:
    """See the module docstring.

    Args:
        kube: client of the test API server.
        dashboard_port: the real local Ray head's dashboard port (published as ``endpoints.dashboard``).
        head_host: the address published as the head's service/pod IP.
        volume_root: only ConfigMap/Secret mounts under this directory are materialised (never outside a test's tmp).
        interval: seconds between passes.
    """

    def __init__(self, kube: KubeClient, *, dashboard_port: int, head_host: str = "127.0.0.1",
                 volume_root: Path | None = None, interval: float = 0.2):
        self.kube = kube
        self.dashboard_port = dashboard_port
        self.head_host = head_host
        self.volume_root = Path(volume_root).resolve() if volume_root else None
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.passes = 0
        self.errors: list[str] = []
        self.pods_created: list[str] = []
        self._lock = threading.RLock()  # one pass at a time; lose_head() happens between passes
        self._head_down_until = 0.0  # time.monotonic() before which new head pods stay unscheduled

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> "FakeKubeRay":
        self._thread = threading.Thread(target=self._run, name="fake-kuberay", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    self.step()
            except Exception as e:  # noqa: BLE001 - keep playing; tests look at .errors
                self.errors.append(repr(e))
                log.warning("fake KubeRay pass failed: %r", e)
            self.passes += 1
            self._stop.wait(self.interval)

    # -- nodes ------------------------------------------------------------------------------------------------
    def add_node(self, name: str, **kw: Any) -> dict:
        return self.kube.create(NODES, None, node_body(name, **kw))

    def set_node_health(self, name: str, value: str) -> dict:
        """Flip the HyperPod health label of a node (what HyperPod does before replacing or rebooting it)."""
        return self.kube.patch(NODES, None, name, {"metadata": {"labels": {HEALTH: value}}})

    def set_node_ready(self, name: str, ready: bool) -> dict:
        return self.kube.patch(NODES, None, name, {"status": {"conditions": [
            {"type": "Ready", "status": "True" if ready else "False", "reason": "KubeletReady" if ready else
             "KubeletNotReady", "lastTransitionTime": _now()}]}}, status=True)

    def lose_head(self, namespace: str, cluster: str, *, dashboard_port: int | None = None,
                  down_seconds: float = 2.0) -> str:
        """The head of RayCluster ``cluster`` is lost (its pod or node died): delete the head pod at once; KubeRay's
        replacement pod stays unscheduled for ``down_seconds`` (no head address published meanwhile), then comes up
        as a **new** Ray head at ``dashboard_port`` (another real Ray head that knows none of the old head's jobs;
        ``None`` keeps the current port). Returns the deleted pod's name.

        Raises:
            LookupError: the cluster has no head pod.
        """
        with self._lock:
            heads = [p for p in self.kube.list(PODS, namespace, selector="ray.io/cluster")
                     if p["metadata"]["labels"].get("ray.io/cluster") == cluster
                     and p["metadata"]["labels"].get("ray.io/node-type") == "head"]
            if not heads:
                raise LookupError(f"RayCluster {namespace}/{cluster} has no head pod")
            for pod in heads:
                self.kube.delete(PODS, namespace, pod["metadata"]["name"])
            if dashboard_port is not None:
                self.dashboard_port = dashboard_port
            self._head_down_until = time.monotonic() + down_seconds
            return heads[0]["metadata"]["name"]

    # -- one pass -----------------------------------------------------------------------------------------------
    def step(self) -> None:
        nodes = {n["metadata"]["name"]: n for n in self.kube.list(NODES)}
        pods = self.kube.list(PODS, selector="ray.io/cluster")
        self._node_lifecycle(pods, nodes)
        for cluster in self.kube.list(RAYCLUSTERS):
            if cluster["metadata"].get("deletionTimestamp"):
                continue
            mine = [p for p in pods if p["metadata"]["labels"].get("ray.io/cluster") == cluster["metadata"]["name"]
                    and p["metadata"]["namespace"] == cluster["metadata"]["namespace"]]
            self._reconcile_cluster(cluster, mine, nodes)

    def _node_lifecycle(self, pods: list[dict], nodes: dict[str, dict]) -> None:
        for pod in pods:
            node_name = (pod.get("spec") or {}).get("nodeName")
            if not node_name or pod["metadata"].get("deletionTimestamp"):
                continue
            ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
            node = nodes.get(node_name)
            if node is None:
                self.kube.delete(PODS, ns, name)  # pod GC: bound to a node that no longer exists
                pod["metadata"]["deletionTimestamp"] = _now()
                continue
            ready = any(c["type"] == "Ready" and c.get("status") == "True"
                        for c in (node.get("status") or {}).get("conditions") or [])
            pod_ready = any(c["type"] == "Ready" and c.get("status") == "True"
                            for c in (pod.get("status") or {}).get("conditions") or [])
            if not ready and pod_ready:
                self._set_pod_ready(pod, False, "NodeNotReady")

    def _set_pod_ready(self, pod: dict, ready: bool, reason: str = "") -> None:
        now = _now()
        status = {"phase": "Running", "podIP": self.head_host, "hostIP": self.head_host, "startTime": now,
                  "conditions": [
                      {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                      {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": now,
                       **({"reason": reason} if reason else {})},
                      {"type": "ContainersReady", "status": "True" if ready else "False", "lastTransitionTime": now}],
                  "containerStatuses": [{"name": c["name"], "ready": ready, "restartCount": 0, "image": c.get("image"),
                                         "state": {"running": {"startedAt": now}}}
                                        for c in pod["spec"].get("containers", [])]}
        self.kube.patch(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"], {"status": status}, status=True)
        pod["status"] = status

    def _reconcile_cluster(self, cluster: dict, pods: list[dict], nodes: dict[str, dict]) -> None:
        spec = cluster["spec"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        wanted = [("head", "headgroup", spec["headGroupSpec"]["template"], 1)]
        wanted += [("worker", g["groupName"], g["template"], int(g.get("replicas", 0)))
                   for g in spec.get("workerGroupSpecs", [])]
        for role, group, template, replicas in wanted:
            have = [p for p in live if p["metadata"]["labels"].get("ray.io/group") == group]
            for _ in range(replicas - len(have)):
                live.append(self._create_pod(cluster, role, group, template))
        load: dict[str, int] = {}
        for p in self.kube.list(PODS):
            n = (p.get("spec") or {}).get("nodeName")
            if n:
                load[n] = load.get(n, 0) + 1
        for pod in live:
            if not (pod.get("spec") or {}).get("nodeName"):
                self._schedule(pod, nodes, load)
        self._kubelet_volumes(cluster, live)
        self._write_status(cluster, live)

    def _create_pod(self, cluster: dict, role: str, group: str, template: dict) -> dict:
        cname = cluster["metadata"]["name"]
        name = f"{cname}-head-{_suffix()}" if role == "head" else f"{cname}-{group}-worker-{_suffix()}"
        labels = dict((template.get("metadata") or {}).get("labels") or {})
        labels.update({"ray.io/cluster": cname, "ray.io/node-type": role, "ray.io/group": group,
                       "ray.io/is-ray-node": "yes"})
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "labels": labels,
                             "ownerReferences": [{"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": cname,
                                                  "uid": cluster["metadata"]["uid"], "controller": True,
                                                  "blockOwnerDeletion": True}]},
                "spec": copy.deepcopy(template.get("spec") or {}),
                "status": {"phase": "Pending"}}
        created = self.kube.create(PODS, cluster["metadata"]["namespace"], body)
        self.pods_created.append(name)
        return created

    def _schedule(self, pod: dict, nodes: dict[str, dict], load: dict[str, int]) -> None:
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        if pod["metadata"]["labels"].get("ray.io/node-type") == "head" and time.monotonic() < self._head_down_until:
            return  # the lost head's replacement is not placed yet (lose_head)
        candidates = sorted((n for n in nodes.values() if fits(pod["spec"], n)),
                            key=lambda n: (load.get(n["metadata"]["name"], 0), n["metadata"]["name"]))
        if not candidates:
            cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                    "message": "0 nodes are available", "lastTransitionTime": _now()}
            current = (pod.get("status") or {}).get("conditions") or []
            if not any(c.get("reason") == "Unschedulable" for c in current):
                self.kube.patch(PODS, ns, name, {"status": {"phase": "Pending", "conditions": [cond]}}, status=True)
            return
        node = candidates[0]["metadata"]["name"]
        load[node] = load.get(node, 0) + 1
        pod.update(self.kube.patch(PODS, ns, name, {"spec": {"nodeName": node}}))
        self._set_pod_ready(pod, True)

    def _kubelet_volumes(self, cluster: dict, pods: list[dict]) -> None:
        if self.volume_root is None:
            return
        ns = cluster["metadata"]["namespace"]
        for pod in pods:
            if pod["metadata"]["labels"].get("ray.io/node-type") != "head" or not pod["spec"].get("nodeName"):
                continue
            volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
            self._container_env(pod)
            for container in pod["spec"].get("containers", []):
                for mount in container.get("volumeMounts", []):
                    target = Path(mount["mountPath"]).resolve()
                    if self.volume_root not in target.parents and target != self.volume_root:
                        continue
                    vol = volumes.get(mount["name"]) or {}
                    files: dict[str, bytes] = {}
                    if "configMap" in vol:
                        cm = self.kube.get(CONFIGMAPS, ns, vol["configMap"]["name"])
                        files = {k: v.encode() for k, v in ((cm or {}).get("data") or {}).items()}
                    elif "secret" in vol:
                        sec = self.kube.get(SECRETS, ns, vol["secret"]["secretName"])
                        files = {k: base64.b64decode(v) for k, v in ((sec or {}).get("data") or {}).items()}
                    for key, data in files.items():
                        target.mkdir(parents=True, exist_ok=True)
                        path = target / key
                        if not path.exists() or path.read_bytes() != data:
                            tmp = target / f".{key}.tmp"
                            tmp.write_bytes(data)
                            tmp.replace(path)

    def _container_env(self, pod: dict) -> None:
        """Write the head container's environment (``value`` and ``valueFrom.secretKeyRef``) for ``pod_env.py``; an
        unresolvable reference leaves the variable out (a real kubelet would not start the container)."""
        job = pod["metadata"]["labels"].get("daedalus.dev/job")
        containers = pod["spec"].get("containers") or []
        if not job or not containers:
            return
        env: dict[str, str] = {}
        for e in containers[0].get("env") or []:
            if "value" in e:
                env[e["name"]] = e["value"]
            elif ((e.get("valueFrom") or {}).get("secretKeyRef")):
                ref = e["valueFrom"]["secretKeyRef"]
                sec = self.kube.get(SECRETS, pod["metadata"]["namespace"], ref["name"]) or {}
                data = (sec.get("data") or {}).get(ref["key"])
                if data is not None:
                    env[e["name"]] = base64.b64decode(data).decode()
        target = self.volume_root / "pod-env" / pod["metadata"]["namespace"] / f"{job}.json"
        text = json.dumps(env, sort_keys=True)
        if not target.exists() or target.read_text() != text:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(target)

    def _write_status(self, cluster: dict, pods: list[dict]) -> None:
        ns, cname = cluster["metadata"]["namespace"], cluster["metadata"]["name"]

        def is_ready(p: dict) -> bool:
            return any(c["type"] == "Ready" and c.get("status") == "True"
                       for c in (p.get("status") or {}).get("conditions") or [])

        heads = [p for p in pods if p["metadata"]["labels"].get("ray.io/node-type") == "head"]
        workers = [p for p in pods if p["metadata"]["labels"].get("ray.io/node-type") != "head"]
        desired = sum(int(g.get("replicas", 0)) for g in cluster["spec"].get("workerGroupSpecs", []))
        head_ready = any(is_ready(p) for p in heads)
        ready_workers = sum(is_ready(p) for p in workers)
        all_ready = head_ready and ready_workers >= desired
        old = cluster.get("status") or {}
        old_conds = {c["type"]: c for c in old.get("conditions") or []}
        provisioned = all_ready or (old_conds.get("RayClusterProvisioned") or {}).get("status") == "True"

        def cond(ctype: str, ok: bool, reason_ok: str, reason_bad: str) -> dict:
            status = "True" if ok else "False"
            prev = old_conds.get(ctype)
            ltt = prev["lastTransitionTime"] if prev and prev.get("status") == status else _now()
            return {"type": ctype, "status": status, "reason": reason_ok if ok else reason_bad,
                    "message": "" if ok else f"{reason_bad}", "lastTransitionTime": ltt}

        head_container = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        endpoints = {p["name"]: str(p["containerPort"]) for p in head_container.get("ports", []) if p.get("name")}
        endpoints["dashboard"] = str(self.dashboard_port)
        # As KubeRay (v1.7 calculateStatus / updateHeadInfo): `state` turns "ready" once every pod is ready and stays
        # so until suspend, whatever happens to the head later; the head's serviceIP stays, only its podIP and
        # podName go with the pod; HeadPodReady follows the head pod.
        status: dict[str, Any] = {
            "state": "ready" if (all_ready or old.get("state") == "ready") else "",
            "conditions": [cond("HeadPodReady", head_ready, "HeadPodRunningAndReady", "HeadPodNotReady"),
                           cond("RayClusterProvisioned", provisioned, "AllPodRunningAndReadyFirstTime",
                                "RayClusterPodsProvisioning")],
            "desiredWorkerReplicas": desired,
            "readyWorkerReplicas": ready_workers,
            "availableWorkerReplicas": ready_workers,
            "observedGeneration": cluster["metadata"].get("generation", 1),
            "endpoints": endpoints,
        }
        if head_ready:
            head = next(p for p in heads if is_ready(p))
            status["head"] = {"podIP": self.head_host, "serviceIP": self.head_host, "podName": head["metadata"]["name"],
                              "serviceName": f"{cname}-head-svc"}
        elif (old.get("head") or {}).get("serviceIP"):
            status["head"] = {"serviceIP": old["head"]["serviceIP"], "serviceName": old["head"].get("serviceName")}
            if {"podIP", "podName"} & set(old["head"]):  # a merge patch keeps keys it does not set to null
                status["head"].update(podIP=None, podName=None)
        if {k: v for k, v in old.items() if k != "lastUpdateTime"} != status:
            try:
                self.kube.patch(RAYCLUSTERS, ns, cname, {"status": dict(status, head=status.get("head"),
                                                                       lastUpdateTime=_now())}, status=True)
            except ApiError as e:
                if e.status != 404:
                    raise


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.2, message: str = "condition") -> Any:
    """Poll ``predicate`` until it returns a truthy value; raise ``AssertionError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {message}; last value: {last!r}")
