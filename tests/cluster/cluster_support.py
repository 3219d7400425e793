"""Support for the operator and chart tests on the real API-server tier (``test_operator_cluster.py``,
``test_chart_cluster.py``, ``test_dry_run.py``).

What it adds to the session's `ControlPlane` (``controlplane.py``, ``conftest.py``):

- **Our CRDs on a 1.20 server**: the RLTrainingJob CRD (``crds/rltrainingjob.yaml``) and KubeRay's RayService CRD, made
  fit for 1.20 by `crd_for_1_20`. Both carry CEL ``x-kubernetes-validations`` rules, which kube-apiserver 1.20 does
  not know: it would drop them without a word (and Helm 4's server-side apply refuses the unknown field outright), so
  they are stripped explicitly and `daedalus_crds` returns the removed paths for the tests to assert. CEL rules are
  checked elsewhere (unit tests with cel-python); everything else in the schemas (types, enums, bounds, required,
  defaults, pruning) is enforced here by the real server. `ensure_crds` installs them into a running plane when the
  plane was not started with them.
- **The chart, installed for real** (`helm_install`): ``helm upgrade --install`` with the real helm binary
  (``scripts/fetch-helm.sh``) into the plane, from a copy of the chart made by `chart_for_1_20`: the copy relaxes
  ``kubeVersion`` (the chart requires >= 1.29; this tier can only build 1.20) and is installed with ``--skip-crds``
  (the CRD is already there, stripped as above). `chart_for_1_20` can also remove verbs from the chart's RBAC rules
  (the RBAC demonstration). The chart under test is ``$DAEDALUS_TEST_CHART`` or ``charts/daedalus``.
- **The operator with the chart's ServiceAccount** (`ChartOperator`): ``daedalus_operator.main.run`` in a thread with
  the container arguments of the Deployment *as stored by the server* plus test-only overrides (free ports instead of
  8080/9090, paths under the test's tmp, the stand-in trainer as entrypoint, short intervals), authenticated with a
  TokenRequest token of the ServiceAccount the chart created. Every API call it makes is authorised by the real RBAC
  authorizer against the chart's rules.
- **KubeRay, scheduler and kubelet played against a real server** (`ClusterKubeRay`, `KubeREST`): the shared fake
  KubeRay (``tests/support/fake_kuberay.py``) over a client for the real API. Two things differ from kmock and are
  handled here, each as the real component does it: a pod is bound to a node through the ``pods/binding``
  subresource (a real API server refuses a patch of ``spec.nodeName``), and a new Node gets the
  ``node.kubernetes.io/not-ready:NoSchedule`` taint from the TaintNodesByCondition admission plugin, which the
  (absent) node lifecycle controller would remove once the node is Ready.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _extra in (REPO / "tests" / "support", REPO / "tests" / "charts"):
    if str(_extra) not in sys.path:
        sys.path.insert(0, str(_extra))

from controlplane import ControlPlane, crd_for_1_20  # noqa: E402
from fake_kuberay import FakeKubeRay, wait_for  # noqa: E402
from jobs import set_spec_fields  # noqa: E402
from kmock_api import ApiError, KubeClient  # noqa: E402
from operator_env import stop_operator_thread, with_pod_env  # noqa: E402
from kuberay import KUBERAY_CRDS  # noqa: E402
from ray_head import free_port  # noqa: E402

KUBERAY = KUBERAY_CRDS
EXAMPLES = REPO / "examples"
#: The chart under test: ``$DAEDALUS_TEST_CHART`` (e.g. a copy with a verb removed) or the repository's chart.
CHART = Path(os.environ.get("DAEDALUS_TEST_CHART") or REPO / "charts" / "daedalus")
RLTJ = ("daedalus.dev", "v1alpha1", "rltrainingjobs")
RLTJ_KEY = "daedalus.dev/v1alpha1/rltrainingjobs"
RLTJ_CRD = "rltrainingjobs.daedalus.dev"
RELEASE = "daedalus"
RELEASE_NAMESPACE = "daedalus-system"
#: The kubeVersion constraint the chart copy gets (the tier's server is 1.20).
KUBE_VERSION_1_20 = ">=1.20.0-0"
#: kube-controller-manager 1.20's garbage collector re-reads discovery every 30 s
#: (``garbageCollector.Sync(..., 30*time.Second, ...)``); a CRD installed after it started is collected after that.
GC_DISCOVERY_SECONDS = 30.0


def load_yaml(path: Path) -> Any:
    """One YAML document (libyaml when available: the KubeRay CRDs are ~1 MB)."""
    return yaml.load(Path(path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


# ------------------------------------------------------------------------------------------------ CRDs
@functools.cache
def daedalus_crds() -> dict[str, tuple[dict, tuple[str, ...]]]:
    """CRD name -> ``(crd fit for 1.20, removed JSON paths)`` for the RLTrainingJob CRD (``crds/rltrainingjob.yaml``)
    and KubeRay v1.7.0's RayService CRD (the RayCluster CRD is installed by ``conftest.control_plane``)."""
    out = {}
    for path in (REPO / "crds" / "rltrainingjob.yaml", KUBERAY / "ray.io_rayservices.yaml"):
        crd, removed = crd_for_1_20(load_yaml(path))
        out[crd["metadata"]["name"]] = (crd, tuple(removed))
    return out


#: server URL -> monotonic time our CRDs were installed after the plane's start (GC discovers them later).
_late_crds: dict[str, float] = {}
_crd_lock = threading.Lock()


def ensure_crds(plane: ControlPlane) -> None:
    """Install the CRDs of `daedalus_crds` into ``plane`` unless they exist (idempotent, thread-safe)."""
    from kubernetes import client

    with _crd_lock:
        with plane.api_client() as api:
            ext = client.ApiextensionsV1Api(api)
            existing = {c.metadata.name for c in ext.list_custom_resource_definition().items}
        missing = [crd for name, (crd, _) in daedalus_crds().items() if name not in existing]
        if missing:
            plane.install_crds(missing)
            _late_crds.setdefault(plane.server, time.monotonic())


def gc_discovery_wait(plane: ControlPlane) -> float:
    """Seconds until kube-controller-manager's garbage collector surely watches the CRDs `ensure_crds` installed
    late (0 when they were there at start-up); see `GC_DISCOVERY_SECONDS`."""
    installed = _late_crds.get(plane.server)
    if installed is None:
        return 0.0
    return max(0.0, installed + GC_DISCOVERY_SECONDS + 5.0 - time.monotonic())


# ------------------------------------------------------------------------------------------------ clients
class KubeREST(KubeClient):
    """The tests' small JSON client (``kmock_api.KubeClient``) for a real kube-apiserver, authenticated from a
    kubeconfig (client certificate or bearer token), TLS verified against the kubeconfig's CA.

    ``trust_env`` is off: ``REQUESTS_CA_BUNDLE`` would otherwise replace the plane's CA, and loopback needs no proxy.

    A merge patch of exactly ``{"spec": {"nodeName": N}}`` on a pod (what the fake scheduler sends to kmock) is sent
    as a ``Binding`` to ``pods/<name>/binding``, the way kube-scheduler binds (a real server forbids changing
    ``spec.nodeName`` by patch).
    """

    def __init__(self, kubeconfig: Path, timeout: float = 10.0):
        config = yaml.safe_load(Path(kubeconfig).read_text())
        cluster = config["clusters"][0]["cluster"]
        user = config["users"][0]["user"]
        super().__init__(cluster["server"], timeout=timeout)
        self.session.trust_env = False
        self.session.verify = cluster["certificate-authority"]
        if "token" in user:
            self.session.headers["Authorization"] = f"Bearer {user['token']}"
        else:
            self.session.cert = (user["client-certificate"], user["client-key"])

    def patch(self, key: str, namespace: str | None, name: str, patch: dict, status: bool = False) -> dict:
        if key == "v1/pods" and not status and list(patch) == ["spec"] and list(patch["spec"]) == ["nodeName"]:
            binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                       "target": {"apiVersion": "v1", "kind": "Node", "name": patch["spec"]["nodeName"]}}
            self._req("POST", self.path(key, namespace, name, "binding"), json=binding)
            return self.get(key, namespace, name)
        return super().patch(key, namespace, name, patch, status)

    def text(self, path: str) -> str:
        """GET a non-JSON endpoint (e.g. the apiserver's ``/metrics``).

        Raises:
            ApiError: a 4xx/5xx answer.
        """
        r = self.session.get(self.url + path, timeout=self.timeout)
        if r.status_code >= 400:
            raise ApiError(r.status_code, r.text)
        return r.text

    def table(self, key: str, namespace: str | None = None) -> tuple[list[str], list[list[Any]]]:
        """The server-side table of a list (what ``kubectl get`` prints): ``(column names, rows of cells)``, asked
        with ``Accept: application/json;as=Table;v=v1;g=meta.k8s.io``; for a custom resource the columns are the
        CRD's ``additionalPrinterColumns`` after ``Name``.

        Raises:
            ApiError: a 4xx/5xx answer.
        """
        r = self.session.get(self.url + self.path(key, namespace), timeout=self.timeout,
                             headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"})
        if r.status_code >= 400:
            raise ApiError(r.status_code, r.text)
        doc = r.json()
        return [c["name"] for c in doc["columnDefinitions"]], [row["cells"] for row in doc.get("rows") or []]

    def force_delete(self, key: str, namespace: str | None, name: str) -> dict | None:
        """DELETE with ``gracePeriodSeconds: 0`` (what the kubelet sends once a terminating pod's containers have
        stopped, and the pod garbage collector for pods of vanished nodes); ``None`` when already gone."""
        try:
            return self._req("DELETE", self.path(key, namespace, name),
                             json={"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        except ApiError as e:
            if e.status == 404:
                return None
            raise


NOT_READY_TAINT = "node.kubernetes.io/not-ready"


class ClusterKubeRay(FakeKubeRay):
    """``fake_kuberay.FakeKubeRay`` against a real API server (see the module docstring), with the two kubelet and
    controller duties kmock makes unnecessary:

    - `add_node` removes the ``node.kubernetes.io/not-ready`` taint that admission put on the new Node, as the node
      lifecycle controller does for a Ready node;
    - each pass first completes the deletion of terminating pods of the Ray clusters: a real server only marks a pod
      bound to a node with ``deletionTimestamp`` and waits for that node's kubelet to stop the containers and
      confirm with a zero-grace DELETE (kmock deletes at once). There are no containers here to stop.

    Binding goes through `KubeREST`.
    """

    kube: KubeREST

    def step(self) -> None:
        for pod in self.kube.list("v1/pods", selector="ray.io/cluster"):
            if pod["metadata"].get("deletionTimestamp"):
                self.kube.force_delete("v1/pods", pod["metadata"]["namespace"], pod["metadata"]["name"])
        super().step()

    def add_node(self, name: str, **kw: Any) -> dict:
        created = super().add_node(name, **kw)
        taints = [t for t in (created.get("spec") or {}).get("taints") or [] if t.get("key") != NOT_READY_TAINT]
        return self.kube.patch("v1/nodes", None, name, {"spec": {"taints": taints or None}})


# ------------------------------------------------------------------------------------------------ kubectl
def find_kubectl() -> str | None:
    """A kubectl binary: ``$DAEDALUS_KUBECTL``, else ``kubectl`` on ``PATH``, else
    ``${DAEDALUS_CACHE:-~/.cache/daedalus}/bin/kubectl`` (where scripts/fetch-helm.sh's wheel also holds one);
    ``None`` when there is none."""
    env = os.environ.get("DAEDALUS_KUBECTL")
    if env:
        return env
    found = shutil.which("kubectl")
    if found:
        return found
    cached = Path(os.environ.get("DAEDALUS_CACHE") or Path.home() / ".cache" / "daedalus") / "bin" / "kubectl"
    return str(cached) if os.access(cached, os.X_OK) else None


def kubectl(binary: str, kubeconfig: Path, *args: str, timeout: float = 60.0) -> str:
    """Run ``kubectl --kubeconfig <kubeconfig> <args>`` and return its stdout.

    Raises:
        AssertionError: kubectl exited non-zero (with its stderr).
    """
    done = subprocess.run([binary, "--kubeconfig", str(kubeconfig), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "KUBECONFIG": str(kubeconfig)})
    assert done.returncode == 0, f"kubectl {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}"
    return done.stdout


# ------------------------------------------------------------------------------------------------ the chart
def chart_for_1_20(dst: Path, src: Path = CHART, *, drop_verbs: tuple[tuple[str, str], ...] = ()) -> Path:
    """Copy the chart to ``dst`` for this tier: ``kubeVersion`` relaxed to `KUBE_VERSION_1_20`; optionally remove
    verbs from its RBAC rules.

    Args:
        dst: target folder (must not exist).
        src: the chart (default `CHART`).
        drop_verbs: ``(resource, verb)`` pairs: in every rule of ``templates/`` whose ``resources:`` line lists the
            resource, the verb is removed from the ``verbs:`` line that follows.

    Raises:
        ValueError: a ``(resource, verb)`` pair matched no rule (the chart changed shape: fix the caller).
    """
    shutil.copytree(src, dst)
    meta_path = dst / "Chart.yaml"
    meta = yaml.safe_load(meta_path.read_text())
    meta["kubeVersion"] = KUBE_VERSION_1_20
    meta_path.write_text(yaml.safe_dump(meta, sort_keys=False))
    for resource, verb in drop_verbs:
        hits = 0
        for path in sorted((dst / "templates").iterdir()):
            lines = path.read_text().splitlines(keepends=True)
            for i, line in enumerate(lines[:-1]):
                if re.match(r"\s*resources:", line) and f'"{resource}"' in line and \
                        re.match(r"\s*verbs:", lines[i + 1]) and f'"{verb}"' in lines[i + 1]:
                    edited = re.sub(rf'"{re.escape(verb)}",\s*|,\s*"{re.escape(verb)}"(?=\s*\])', "",
                                    lines[i + 1], count=1)
                    hits += edited != lines[i + 1]
                    lines[i + 1] = edited
            path.write_text("".join(lines))
        if not hits:
            raise ValueError(f"no RBAC rule for {resource!r} with verb {verb!r} in {src / 'templates'}")
    return dst


@dataclasses.dataclass
class Release:
    """An installed Helm release: where, what helm printed, and what the server stored.

    Attributes:
        name / namespace / chart: the release and the chart folder it was installed from.
        service_account: the operator's ServiceAccount (the Deployment's ``serviceAccountName`` as stored).
        args: the operator container's arguments as stored in the Deployment on the server.
        manifest: the documents of ``helm get manifest`` (what helm applied).
        kubeconfig: a kubeconfig authenticating as ``service_account`` (TokenRequest token, 1 h).
    """

    name: str
    namespace: str
    chart: Path
    service_account: str
    args: list[str]
    manifest: list[dict]
    kubeconfig: Path


def may(api_client, verb: str, group: str, resource: str, subresource: str, namespace: str) -> bool:
    """The real RBAC authorizer's answer for the caller of ``api_client`` (SelfSubjectAccessReview)."""
    from kubernetes import client

    attrs = client.V1ResourceAttributes(verb=verb, group=group, resource=resource, subresource=subresource or None,
                                        namespace=namespace)
    review = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attrs))
    return client.AuthorizationV1Api(api_client).create_self_subject_access_review(review).status.allowed


def helm(binary: str, plane: ControlPlane, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run ``helm ARGS --kubeconfig <admin>`` against the plane (HOME-independent caches under the plane's dir)."""
    cache = plane.dir / "helm"
    env = {**os.environ, "HELM_CACHE_HOME": str(cache / "cache"), "HELM_CONFIG_HOME": str(cache / "config"),
           "HELM_DATA_HOME": str(cache / "data")}
    return subprocess.run([binary, *args, "--kubeconfig", str(plane.kubeconfig)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def helm_install(binary: str, plane: ControlPlane, chart: Path, release: str = RELEASE,
                 namespace: str = RELEASE_NAMESPACE, values: dict | None = None) -> Release:
    """``helm upgrade --install --skip-crds --create-namespace`` of ``chart`` into the plane and what it produced.

    Raises:
        AssertionError: helm failed (its stderr in the message).
    """
    from kubernetes import client

    ensure_crds(plane)
    extra: list[str] = []
    if values:
        values_path = plane.dir / f"values-{release}.yaml"
        values_path.write_text(yaml.safe_dump(values))
        extra = ["--values", str(values_path)]
    proc = helm(binary, plane, "upgrade", "--install", release, str(chart), "--namespace", namespace,
                "--create-namespace", "--skip-crds", *extra)
    assert proc.returncode == 0, f"helm install of {chart} failed:\n{proc.stderr}"
    got = helm(binary, plane, "get", "manifest", release, "--namespace", namespace)
    assert got.returncode == 0, got.stderr
    manifest = [d for d in yaml.safe_load_all(got.stdout) if d]
    deployment = next(d for d in manifest if d["kind"] == "Deployment")
    with plane.api_client() as api:
        stored = client.AppsV1Api(api).read_namespaced_deployment(deployment["metadata"]["name"], namespace)
    pod = stored.spec.template.spec
    operator = next(c for c in pod.containers if c.name == "operator")
    kubeconfig = plane.service_account_kubeconfig(namespace, pod.service_account_name)
    return Release(release, namespace, chart, pod.service_account_name, list(operator.args or []), manifest,
                   kubeconfig)


_releases: dict[tuple[str, str], Release] = {}


def installed_chart(binary: str, plane: ControlPlane) -> Release:
    """The tier's standard release (`RELEASE` in `RELEASE_NAMESPACE` from `CHART`), installed once per plane."""
    key = (plane.server, RELEASE)
    if key not in _releases:
        _releases[key] = helm_install(binary, plane, chart_for_1_20(plane.dir / "chart-1.20"))
    return _releases[key]


# ------------------------------------------------------------------------------------------------ the operator
class ChartOperator:
    """The Daedalus operator (``daedalus_operator.main.run``, kopf in a thread) as the chart configures it.

    Arguments: ``release.args`` (the stored Deployment's), then the test overrides listed in `overrides` (argparse
    keeps the last value of a repeated option, so chart values that a loopback test cannot use, such as the fixed
    ports 8080 and 9090, are replaced rather than edited).

    Args:
        release: the installed chart (credentials: its ServiceAccount's token).
        tmp: per-test folder: pod volumes (config, token), checkpoints.
        entrypoint: Ray job entrypoint template (``{config}``); default the stand-in trainer (``{step}`` seconds/step).
        step_seconds: the stand-in trainer's seconds per step.
        poll: ``--poll-interval``.
        extra_args: more flags (e.g. ``--deletion-timeout 3``).
    """

    def __init__(self, release: Release, tmp: Path, *, entrypoint: str | None = None, step_seconds: float = 0.3,
                 poll: float = 0.5, extra_args: tuple[str, ...] = ()):
        from operator_env import STANDIN_TRAINER

        self.release = release
        self.tmp = Path(tmp)
        self.volumes = self.tmp / "pod-volumes"
        self.checkpoints = self.tmp / "checkpoints"
        self.entrypoint = (entrypoint or STANDIN_TRAINER).replace("{step}", f"{step_seconds:g}")
        self.poll = poll
        self.extra_args = tuple(extra_args)
        self.control_port = free_port()
        self.metrics_port = free_port()
        self.liveness_port = free_port()
        self.runtime: Any = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None

    def overrides(self) -> list[str]:
        """The test-only flags appended to the chart's arguments."""
        return ["--kubeconfig", str(self.release.kubeconfig), f"--liveness=http://127.0.0.1:{self.liveness_port}/healthz",
                f"--metrics-port={self.metrics_port}", f"--poll-interval={self.poll}",
                f"--control-port={self.control_port}", f"--entrypoint={with_pod_env(self.entrypoint, self.volumes)}",
                f"--config-dir={self.volumes / 'etc-daedalus'}",
                "--request-timeout=3", "--unreachable-grace=30",
                *(["--verbose"] if os.environ.get("DAEDALUS_TEST_VERBOSE") else []), *self.extra_args]

    def argv(self) -> list[str]:
        return [*self.release.args, *self.overrides()]

    def start(self, timeout: float = 60.0) -> "ChartOperator":
        """Start kopf and wait until it is ready.

        Raises:
            RuntimeError: it failed to start or was not ready within ``timeout`` seconds.
        """
        from daedalus_operator.main import run

        self.volumes.mkdir(parents=True, exist_ok=True)
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        self._stop = stop = threading.Event()
        ready = threading.Event()
        argv = self.argv()

        def target() -> None:
            try:
                self.runtime = run(argv, stop_flag=stop, ready_flag=ready)
            except BaseException as e:  # noqa: BLE001 - surfaced by start() and stop()
                self.error = e
                ready.set()

        self._thread = threading.Thread(target=target, name=f"daedalus-operator-{self.release.name}", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise RuntimeError(f"the operator was not ready within {timeout:.0f} s")
        if self.error:
            raise RuntimeError(f"the operator failed to start: {self.error!r}")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Set kopf's stop flag and join the thread.

        Raises:
            RuntimeError: the thread did not stop within ``timeout`` seconds.
        """
        stop_operator_thread(self._stop, self._thread, timeout)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()


# ------------------------------------------------------------------------------------------------ jobs
def example(file: str, namespace: str, name: str | None = None, **spec_overrides: Any) -> dict:
    """An example manifest from ``examples/`` put into ``namespace`` (and renamed); ``a__b=value`` sets
    ``spec.a.b``."""
    doc = load_yaml(EXAMPLES / file)
    doc["metadata"]["namespace"] = namespace
    if name:
        doc["metadata"]["name"] = name
    set_spec_fields(doc["spec"], **spec_overrides)
    return doc


class Jobs:
    """RLTrainingJobs of one namespace through an admin `KubeREST` (what a user's ``kubectl`` would do)."""

    def __init__(self, kube: KubeREST, namespace: str):
        self.kube = kube
        self.namespace = namespace

    def create(self, manifest: dict) -> dict:
        return self.kube.create(RLTJ_KEY, self.namespace, manifest)

    def get(self, name: str) -> dict | None:
        return self.kube.get(RLTJ_KEY, self.namespace, name)

    def status(self, name: str) -> dict:
        return (self.get(name) or {}).get("status") or {}

    def wait_status(self, name: str, predicate: Callable[[dict], Any], timeout: float = 60.0,
                    message: str = "status") -> dict:
        seen: list[dict] = [{}]

        def check() -> dict | None:
            seen[0] = self.status(name)
            return seen[0] if predicate(seen[0]) else None

        try:
            return wait_for(check, timeout=timeout, message=f"{self.namespace}/{name}: {message}")
        except AssertionError as e:
            raise AssertionError(f"{e}\nlast status: {json.dumps(seen[0], indent=1)}") from None

    def wait_phase(self, name: str, phase: str, timeout: float = 60.0) -> dict:
        return self.wait_status(name, lambda st: st.get("phase") == phase, timeout, f"phase {phase}")

    def conditions(self, name: str) -> dict[str, dict]:
        return {c["type"]: c for c in self.status(name).get("conditions") or []}

    def events(self, name: str) -> list[dict]:
        """core/v1 Events about the job, oldest first."""
        items = [e for e in self.kube.list("v1/events", self.namespace)
                 if (e.get("involvedObject") or {}).get("name") == name]
        return sorted(items, key=lambda e: int(e["metadata"]["resourceVersion"]))

    def release_finalizers(self) -> None:
        """Remove finalizers from every job of the namespace (teardown without an operator)."""
        for job in self.kube.list(RLTJ_KEY, self.namespace):
            if job["metadata"].get("finalizers"):
                try:
                    self.kube.patch(RLTJ_KEY, self.namespace, job["metadata"]["name"],
                                    {"metadata": {"finalizers": None}})
                except ApiError as e:
                    if e.status != 404:
                        raise


def status_writes(admin: KubeREST) -> int:
    """Requests that wrote to ``rltrainingjobs/status`` so far (PATCH/PUT/APPLY, any answer), counted by
    kube-apiserver itself (``apiserver_request_total`` on its ``/metrics``, admin only).

    Unlike the resourceVersion this counts a write the server turned into a no-op: a status field the schema
    prunes comes back unchanged, so writing it again and again would never bump the resourceVersion."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0
    for family in text_string_to_metric_families(admin.text("/metrics")):
        if family.name != "apiserver_request":  # the parser strips the counter's _total suffix
            continue
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "apiserver_request_total" and labels.get("resource") == "rltrainingjobs" and \
                    labels.get("subresource") == "status" and labels.get("verb") in ("PATCH", "PUT", "APPLY"):
                total += int(sample.value)
    return total


def _status_writes_audited(plane: ControlPlane) -> list[dict]:
    """The ServiceAccounts' requests that wrote to ``rltrainingjobs/status`` so far (the audit log), oldest first."""
    return [e for e in plane.audit_events() if (e.get("objectRef") or {}).get("resource") == "rltrainingjobs"
            and e["objectRef"].get("subresource") == "status" and e.get("verb") in ("patch", "update")]


def steady_status(admin: KubeREST, jobs: Jobs, names: list[str], seconds: float,
                  plane: ControlPlane | None = None) -> dict[str, dict]:
    """Watch jobs in a state where nothing changes for ``seconds`` and return their statuses: the stored status
    must stay the same and the operator must not write any status in the window.

    The operator diffs the status it computes against the stored one and writes only a difference
    (``status.merge_patch``), so a field the server pruned from a write would be written again on every poll:
    every status field the operator writes came back from the server unpruned exactly when it stays quiet.

    ``plane``: the server counts writes to every job (its metrics have no namespace); with the plane, writes the
    audit log shows went to other jobs (one of an earlier test, in a namespace still being deleted, reconciled by
    this test's cluster-wide operator: seen in session 29) are not counted, and the failure names each write.

    Raises:
        AssertionError: a status changed, or status writes to these jobs reached the server during the window.
    """
    before = {name: jobs.status(name) for name in names}
    # The audit mark comes first: a write between the two marks (reading and parsing /metrics takes a while) must be
    # in the audit window too, or the counter would show it with no audit event to name it (CI, stop 36).
    audited = len(_status_writes_audited(plane)) if plane is not None else 0
    writes = status_writes(admin)
    time.sleep(seconds)
    after = {name: jobs.status(name) for name in names}
    wrote = status_writes(admin) - writes
    assert after == before, f"a status changed while nothing happened:\nbefore {json.dumps(before, indent=1)}\n" \
                            f"after {json.dumps(after, indent=1)}"
    if wrote and plane is not None:
        # kube-apiserver counts a request inside its handler and writes the ResponseComplete audit event after the
        # handler returns (apiserver/pkg/endpoints/filters/audit.go, WithAudit's deferred processAuditEvent), so a
        # write the counter shows may reach the audit log a moment later
        # (a write refused with 403 is audited but not counted by 1.20: those are left out of the comparison)
        def counted(events: list[dict]) -> int:
            return sum((e.get("responseStatus") or {}).get("code") != 403 for e in events)

        deadline = time.monotonic() + 5.0
        window = _status_writes_audited(plane)[audited:]
        while counted(window) < wrote and time.monotonic() < deadline:
            time.sleep(0.2)
            window = _status_writes_audited(plane)[audited:]
        mine = [e for e in window if e["objectRef"].get("namespace") == jobs.namespace
                and e["objectRef"].get("name") in names]
        others = sorted({f"{e['objectRef'].get('namespace')}/{e['objectRef'].get('name')}" for e in window} -
                        {f"{jobs.namespace}/{n}" for n in names})
        assert not mine, (f"{len(mine)} status write(s) to these jobs while nothing changed (answered "
                          f"{[(e.get('responseStatus') or {}).get('code') for e in mine]}): {json.dumps(after)}")
        if others:
            print(f"steady_status: {wrote} status write(s) in the window went to other jobs: {', '.join(others)}")
            return after
    assert wrote == 0, f"{wrote} status write(s) reached the server while nothing changed: {json.dumps(after)}"
    return after


def missing_paths(sent: Any, got: Any, path: str = "") -> list[str]:
    """JSON paths present in ``sent`` but absent from ``got`` (what a server pruned or dropped). Lists are compared
    item by item; values are not compared (the server may normalise quantities, add defaults)."""
    if isinstance(sent, dict):
        if not isinstance(got, dict):
            return [path or "."]
        out: list[str] = []
        for key, value in sent.items():
            sub = f"{path}.{key}"
            out += missing_paths(value, got[key], sub) if key in got else [sub]
        return out
    if isinstance(sent, list):
        if not isinstance(got, list) or len(got) < len(sent):
            return [path or "."]
        return [p for i, item in enumerate(sent) for p in missing_paths(item, got[i], f"{path}[{i}]")]
    return []

