"""Operator tests: the pure core as tables, builders against the KubeRay schemas, and kopf running for real against
an honest kmock API server with a fake KubeRay and a real local Ray head (``tests/support``)."""

from __future__ import annotations

import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[1] / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))
