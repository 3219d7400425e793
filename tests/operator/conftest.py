"""Operator tests: the pure core as tables, builders against the KubeRay schemas, and kopf running for real against
an honest kmock API server with a fake KubeRay and a real local Ray head (``tests/support``)."""

from __future__ import annotations

import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[1] / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_head():
    """One real local Ray head for the operator tests of this session (tests/support/ray_head.py)."""
    from ray_head import start_ray_head

    head = start_ray_head(num_cpus=2)
    try:
        yield head
    finally:
        head.stop()
