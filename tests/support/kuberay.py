"""Where the KubeRay CRDs the tests validate against live (vendored data: ``tests/data/kuberay-v1.7.0/README.md``)."""

from __future__ import annotations

from pathlib import Path

#: KubeRay v1.7.0 CRDs: ``ray.io_rayclusters.yaml``, ``ray.io_rayservices.yaml``.
KUBERAY_CRDS = Path(__file__).resolve().parents[1] / "data" / "kuberay-v1.7.0"
