"""Fixtures of the real API-server tier: one control plane (etcd + kube-apiserver 1.20 + kube-controller-manager)
per test session, an admin client, a fresh namespace per test, and the KubeRay RayCluster CRD.

Without the binaries (built by ``scripts/build-kube.sh``, which ``make test`` runs via ``make system-deps``) every
test here is skipped with the reason; with ``DAEDALUS_REQUIRE_CLUSTER=1`` (or CI's ``DAEDALUS_REQUIRE_TOOLS=1``) it
fails instead.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
import yaml
from controlplane import ControlPlane, ControlPlaneUnavailable, crd_for_1_20, find_binaries
from kuberay import KUBERAY_CRDS
from cluster_support import KubeREST, installed_chart  # also puts tests/charts on sys.path
from chartlib import find_helm

_HERE = Path(__file__).resolve().parent
_started: list[ControlPlane] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of this folder that needs the control plane `cluster` (``-m "not cluster"`` deselects)."""
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents and "control_plane" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


def _report_lines() -> list[str]:
    """One line per control plane this process started: version, build stamp, start-up time by phase."""
    lines = []
    for plane in _started:
        stamp = plane.binaries.stamp
        lines.append(
            f"control plane: kube-apiserver {plane.binaries.version} (Debian {stamp.get('debian_version', '?')},"
            f" {stamp.get('go_version', '?')}) + etcd {plane.binaries.etcd}; started in {plane.startup_seconds:.1f} s"
            f" ({', '.join(f'{k} {v:.1f}' for k, v in plane.startup_phases.items())})"
        )
    return lines


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On an xdist worker, hand the report lines to the controller, which prints them (tests/conftest.py)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput.setdefault("daedalus_summary", []).extend(_report_lines())


def pytest_terminal_summary(terminalreporter) -> None:
    """Report the control plane's start-up time and build stamp in the session summary."""
    for line in _report_lines():
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def raycluster_crd():
    """The KubeRay v1.7.0 RayCluster CRD made fit for 1.20 by `crd_for_1_20`: ``(crd_dict, removed_paths)``.

    The control plane installs it at start-up (before the garbage collector's first discovery).
    """
    path = KUBERAY_CRDS / "ray.io_rayclusters.yaml"
    if not path.is_file():
        pytest.fail(f"KubeRay CRD not found at {path} (vendored under tests/data/kuberay-v1.7.0)", pytrace=False)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 0.4 s instead of 1.8 s for this 0.9 MB file
    return crd_for_1_20(yaml.load(path.read_text(), Loader=loader))


@pytest.fixture(scope="session")
def control_plane(raycluster_crd):
    """The session's `ControlPlane` (started once, stopped at the end of the session), with the RayCluster CRD.

    Skips every dependent test with the reason when the binaries are missing, unless
    ``DAEDALUS_REQUIRE_CLUSTER=1`` or ``DAEDALUS_REQUIRE_TOOLS=1`` (set by .ci/run): then fails.
    """
    try:
        binaries = find_binaries()
    except ControlPlaneUnavailable as err:
        required = [v for v in ("DAEDALUS_REQUIRE_CLUSTER", "DAEDALUS_REQUIRE_TOOLS") if os.environ.get(v) == "1"]
        if required:
            pytest.fail(f"{required[0]}=1 but the API-server tier cannot run: {err}", pytrace=False)
        pytest.skip(f"real API-server tier skipped: {err}")
    from cluster_support import daedalus_crds

    # Every CRD the tier uses is installed before the controller manager starts: its garbage collector learns
    # resource types only at start-up (then every 30 s), so owner GC of our children works at once.
    plane = ControlPlane(binaries, crds=[raycluster_crd[0], *(crd for crd, _ in daedalus_crds().values())])
    plane.start()
    _started.append(plane)
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def kube_api(control_plane):
    """An admin `kubernetes.client.ApiClient` (user in ``system:masters``) for the session."""
    with control_plane.api_client() as api:
        yield api


@pytest.fixture
def namespace(control_plane, kube_api):
    """A fresh namespace ``t-<8 hex>`` for one test, with its default ServiceAccount token minted (pods are refused
    until then); deleted afterwards (the namespace controller empties it)."""
    from kubernetes import client

    name = f"t-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(kube_api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    control_plane.wait_default_service_account(name, time.monotonic() + 30)
    yield name
    client.CoreV1Api(kube_api).delete_namespace(name)


# The chart installed with helm (its ServiceAccount is what the operator runs as) and an admin client: shared by the
# chart and operator tests of this tier, one install per test module.
@pytest.fixture(scope="module")
def helm_binary() -> str:
    return find_helm()


@pytest.fixture(scope="module")
def release(helm_binary, control_plane):
    return installed_chart(helm_binary, control_plane)


@pytest.fixture(scope="module")
def admin(control_plane) -> KubeREST:
    return KubeREST(control_plane.kubeconfig)
