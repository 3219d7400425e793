"""The Argo CD health check (charts/daedalus/files/argocd-health.lua) run by a real Lua runtime (lupa) over status
fixtures. Argo CD runs health checks with gopher-lua, a Lua 5.1 implementation; the cases run on Lua 5.1 and 5.4.

Every fixture's status is first validated against the generated CRD's status schema, so each is well formed (field
names and types); which conditions go with which phase is chosen by hand here, after the operator's status module.
"""

from __future__ import annotations

import copy
import importlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from chartlib import CHART, REPO

import lupa  # noqa: E402, F401  (the test extra installs it: a missing one must fail, not skip)
from argocd import SCRIPT, health  # noqa: E402

CRD = REPO / "crds" / "rltrainingjob.yaml"
T = "2026-11-30T07:00:00Z"


def cond(type_: str, status: str, reason: str, message: str = "", generation: int | None = 3) -> dict[str, Any]:
    c = {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": T}
    if generation is not None:
        c["observedGeneration"] = generation
    return c


def job(status: dict[str, Any] | None, generation: int = 3) -> dict[str, Any]:
    obj = {"apiVersion": "daedalus.dev/v1alpha1", "kind": "RLTrainingJob",
           "metadata": {"name": "maze", "namespace": "ml", "generation": generation}, "spec": {}}
    if status is not None:
        obj["status"] = status
    return obj


RUNNING = {"phase": "Running", "observedGeneration": 3, "currentStep": 120, "totalSteps": 400, "conditions": [
    cond("Ready", "True", "Running", "Training on 4 workers"),
    cond("Reconciling", "False", "AsExpected"),
    cond("Stalled", "False", "AsExpected"),
]}

CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    "no status yet": (job(None), "Progressing", "Waiting for the operator to report status"),
    "spec changed, not observed": (
        job(dict(RUNNING), generation=4), "Progressing",
        "Waiting for the operator to observe generation 4 (observed 3)"),
    "condition from an older generation": (
        job({"phase": "Running", "conditions": [cond("Ready", "True", "Running", "Training", generation=2)]}),
        "Progressing", "Waiting for the operator to observe generation 3 (condition Ready is from generation 2)"),
    "provisioning": (
        job({"phase": "Provisioning", "observedGeneration": 3, "conditions": [
            cond("Ready", "False", "Provisioning", "RayCluster maze-ab12 has 1/4 workers ready"),
            cond("Reconciling", "True", "Provisioning", "Waiting for RayCluster maze-ab12")]}),
        "Progressing", "Provisioning: Waiting for RayCluster maze-ab12"),
    "recovering after node replacement": (
        job({"phase": "Recovering", "observedGeneration": 3, "restarts": 1, "conditions": [
            cond("Ready", "False", "Recovering", "Node i-0abc is being replaced"),
            cond("Reconciling", "True", "NodeReplacement", "Checkpointed at step 120; resubmitting")]}),
        "Progressing", "NodeReplacement: Checkpointed at step 120; resubmitting"),
    "running": (job(RUNNING), "Healthy", "Running: Training on 4 workers (step 120/400)"),
    "running, the operator's message with the step": (  # not "... step 120/400 (step 120/400)"
        job(RUNNING | {"conditions": [cond("Ready", "True", "Running", "attempt 1 running, step 120/400")]}),
        "Healthy", "Running: attempt 1 running, step 120/400"),
    "succeeded": (
        job({"phase": "Succeeded", "observedGeneration": 3, "conditions": [
            cond("Ready", "False", "Succeeded", "Finished"),
            cond("Succeeded", "True", "Succeeded", "400 steps; eval success 0.81")]}),
        "Healthy", "Succeeded: 400 steps; eval success 0.81"),
    "suspended": (
        job({"phase": "Suspended", "observedGeneration": 3, "conditions": [
            cond("Ready", "False", "Suspended", "spec.suspend is true"),
            cond("Suspended", "True", "Suspended", "Checkpointed at step 200 and released the RayCluster")]}),
        "Suspended", "Suspended: Checkpointed at step 200 and released the RayCluster"),
    "failed": (
        job({"phase": "Failed", "observedGeneration": 3, "restarts": 5, "conditions": [
            cond("Ready", "False", "Failed", "Gave up"),
            cond("Reconciling", "True", "Recovering", "stale flag a failed job may still carry"),
            cond("Failed", "True", "RestartLimitExceeded", "5 restarts; last: ApplicationError: CUDA OOM")]}),
        "Degraded", "RestartLimitExceeded: 5 restarts; last: ApplicationError: CUDA OOM"),
    "failed phase without a Failed condition": (
        job({"phase": "Failed", "observedGeneration": 3, "lastFailure": {
            "reason": "InvalidSpec", "message": "model.path does not exist", "time": T}}),
        "Degraded", "model.path does not exist"),
    "stalled": (
        job({"phase": "Running", "observedGeneration": 3, "conditions": [
            cond("Ready", "False", "CheckpointTimeout", "Trainer did not checkpoint"),
            cond("Reconciling", "False", "CheckpointTimeout"),
            cond("Stalled", "True", "DashboardUnreachable", "Ray dashboard unreachable for 300 s")]}),
        "Degraded", "DashboardUnreachable: Ray dashboard unreachable for 300 s"),
    "pending without conditions": (
        job({"phase": "Pending", "observedGeneration": 3}), "Progressing", "Phase Pending"),
    "empty status": (job({}), "Progressing", "Waiting for the operator"),
}


def runtimes() -> list[str]:
    out = []
    for name in ("lua51", "lua54"):
        try:
            importlib.import_module(f"lupa.{name}")
            out.append(name)
        except ImportError:
            pass
    return out or ["default"]


@pytest.mark.parametrize("runtime_name", runtimes())
@pytest.mark.parametrize("case", sorted(CASES))
def test_health(runtime_name: str, case: str) -> None:
    obj, status, message = CASES[case]
    assert health(copy.deepcopy(obj), runtime_name) == (status, message)


def test_every_argocd_status_is_reachable() -> None:
    assert {status for _, status, _ in CASES.values()} == {"Progressing", "Healthy", "Suspended", "Degraded"}


def test_fixtures_are_valid_statuses() -> None:
    import jsonschema
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    for case, (obj, _, _) in CASES.items():
        if "status" in obj:
            try:
                jsonschema.validate(obj["status"], schema)
            except jsonschema.ValidationError as exc:
                pytest.fail(f"fixture {case!r} is not a valid status: {exc.message}")


def _readme_lua_blocks() -> list[str]:
    readme = (CHART / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", readme, flags=re.S)
    found = []
    for block in blocks:
        doc = yaml.safe_load(block)
        key = "resource.customizations.health.daedalus.dev_RLTrainingJob"
        if isinstance(doc, dict):
            if doc.get("kind") == "ConfigMap":
                found.append(doc["data"][key])
            elif "configs" in doc:
                found.append(doc["configs"]["cm"][key])
    return found


def test_readme_snippets_carry_the_same_script() -> None:
    """The argocd-cm ConfigMap and the argo-cd Helm values snippets in the chart README hold this exact script."""
    blocks = _readme_lua_blocks()
    assert len(blocks) == 2
    for block in blocks:
        assert block == SCRIPT
