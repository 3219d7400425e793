"""The deployment docs (docs/deploy.md, charts/daedalus/README.md) stay true: their manifests are valid Kubernetes
objects and their `helm install/upgrade` commands render the chart."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from chartlib import CHART, REPO, Helm

import kubernetes_validate  # noqa: E402  (test extra)

DOCS = [REPO / "docs" / "deploy.md", CHART / "README.md"]


def blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)


def test_deploy_doc_manifests_are_valid() -> None:
    docs = [d for block in blocks(REPO / "docs" / "deploy.md", "yaml") for d in yaml.safe_load_all(block) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["PersistentVolume", "PersistentVolumeClaim", "Pod", "Pod"], kinds  # fsx-prep, ckpt-list
    for doc in docs:
        for version in ("1.29.0", "1.35.0"):
            kubernetes_validate.validate(doc, version, strict=True)
    claim = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    example = yaml.safe_load((REPO / "examples" / "hyperpod-qwen3vl-8b.yaml").read_text())
    assert claim["metadata"]["name"] == example["spec"]["checkpoint"]["volume"]
    assert claim["metadata"]["namespace"] == example["metadata"]["namespace"]
    # the listing pod reads the example job's checkpoint root: <checkpoint.path>/<namespace>/<name>
    listing = next(d for d in docs if d["metadata"]["name"] == "ckpt-list")["spec"]["containers"][0]["command"]
    meta = example["metadata"]
    assert listing == ["daedalus", "checkpoints",
                       f"{example['spec']['checkpoint']['path']}/{meta['namespace']}/{meta['name']}"]


def helm_commands(path: Path) -> list[list[str]]:
    out = []
    for block in blocks(path, "bash"):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            command = pending + line
            try:
                words = shlex.split(command, comments=True)
            except ValueError:  # a quoted argument (a jq program) goes on over the next line
                pending = command + "\n"
                continue
            pending = ""
            if words[:2] in (["helm", "install"], ["helm", "upgrade"]) and "charts/daedalus" in words:
                out.append(words)
        assert not pending, f"{path}: a bash block ends inside a quoted string: {pending!r}"
    return out


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_documented_helm_commands_render(chart: Helm, path: Path) -> None:
    commands = helm_commands(path)
    assert commands, f"no helm install/upgrade command in {path}"
    for words in commands:
        sets = []
        for i, word in enumerate(words):
            if word in ("--set", "--set-string"):
                value = words[i + 1].replace("$REGISTRY", "123456789012.dkr.ecr.us-west-2.amazonaws.com")
                value = value.replace("<account>.dkr.ecr.<region>.amazonaws.com", "123456789012.dkr.ecr.us-west-2.amazonaws.com")
                sets += [word, value]
        proc = chart.run("template", "daedalus", str(CHART), "--namespace", "daedalus", *sets)
        assert proc.returncode == 0, f"{' '.join(words)}\n{proc.stderr}"


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_an_example_said_to_apply_to_a_cluster_can_write_its_checkpoints_there(path: Path) -> None:
    """The trainer image runs as a non-root uid: on a cluster, ``checkpoint.path`` must lie on the mounted
    ``checkpoint.volume`` (the operator mounts it on every Ray pod). An example whose header says it can be applied
    to a cluster either mounts such a volume or says that it needs ``checkpoint.volume`` first."""
    from daedalus_trainer.config import RLTrainingJobStatus, parse_job

    from daedalus_operator import resources
    from daedalus_operator.plan import JobView
    from daedalus_operator.settings import OperatorSettings

    text = path.read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    if "kubectl apply" not in header:
        return
    doc = yaml.safe_load(text)
    doc["metadata"].setdefault("namespace", "default")
    spec = parse_job(doc).spec
    job = JobView(name=doc["metadata"]["name"], namespace=doc["metadata"]["namespace"], uid="u", generation=1,
                  spec=spec, status=RLTrainingJobStatus())
    head = resources.build_raycluster(job, OperatorSettings())["spec"]["headGroupSpec"]["template"]["spec"]
    mounts = [m["mountPath"] for m in head["containers"][0]["volumeMounts"] if m["name"] == "shared"]
    on_volume = any(spec.checkpoint.path == m or spec.checkpoint.path.startswith(m.rstrip("/") + "/") for m in mounts)
    assert on_volume or "needs `checkpoint.volume`" in " ".join(header.replace("#", " ").split()), (
        f"{path.name} says it can be kubectl-applied, but {spec.checkpoint.path} is on no mounted volume")
