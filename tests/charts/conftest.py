"""Fixtures for the Helm chart tests: a real `helm` binary (scripts/fetch-helm.sh) and a renderer."""

from __future__ import annotations

import pytest
from chartlib import Helm, find_helm


@pytest.fixture(scope="session")
def helm() -> str:
    """Path of a working helm binary; skips (or fails with DAEDALUS_REQUIRE_TOOLS=1) when it cannot be fetched."""
    return find_helm()


@pytest.fixture(scope="session")
def chart(helm: str, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(helm, tmp_path_factory.mktemp("helm"))
