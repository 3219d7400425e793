"""handlers.gather reading kopf's indexes: a snapshot that cannot be taken must skip the reconcile (kopf retries),
never hand the planner an empty view of the pods or nodes (which reads as "every pod and node is gone")."""

from __future__ import annotations

from pathlib import Path

import kopf
import pytest
import yaml

from daedalus_operator.handlers import Runtime, gather, job_view
from daedalus_operator.metrics import OperatorMetrics
from daedalus_operator.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[2]


class ChangingStore:
    """A kopf index store whose dict another thread keeps resizing: every iteration fails as CPython's does."""

    def __bool__(self) -> bool:
        return True

    def __iter__(self):
        raise RuntimeError("dictionary changed size during iteration")


class EmptiedStore:
    """A store that was non-empty when tested and emptied before it was read (kopf's event loop removed the object)."""

    def __bool__(self) -> bool:
        return True

    def __iter__(self):
        return iter(())


class Index(dict):
    """The mapping interface of ``kopf.Index`` (key -> store)."""


def _job():
    doc = yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text())
    doc["metadata"].update(namespace="ml", uid="0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", generation=1)
    doc["status"] = {"phase": "Running", "attempt": 1, "submissionId": "local-tiny-0f1e2d3c-a1",
                     "submissionConfirmed": True, "attemptStartTime": "2026-01-01T00:00:00Z", "currentStep": 5}
    return job_view(doc)


def _rt() -> Runtime:
    return Runtime(settings=OperatorSettings(), metrics=OperatorMetrics())


@pytest.mark.parametrize("which, index", [
    ("pods_by_job", Index({("ml", "local-tiny"): ChangingStore()})),
    ("clusters_by_job", Index({("ml", "local-tiny"): ChangingStore()})),
    ("nodes_by_name", Index({"node-a": ChangingStore()})),
    ("nodes_by_name", Index({"node-a": EmptiedStore()})),
], ids=["pods", "clusters", "nodes-changing", "nodes-emptied"])
def test_an_index_that_cannot_be_read_skips_the_reconcile(which: str, index: Index) -> None:
    indexes = {"pods_by_job": None, "nodes_by_name": None, "clusters_by_job": None, "services_by_job": None,
               which: index}
    with pytest.raises(kopf.TemporaryError):
        gather(_rt(), _job(), indexes)
