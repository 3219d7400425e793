"""Dockerfile.operator and Dockerfile.trainer, parsed with dockerfile-parse: bases, extras, non-root users, and pins
that agree with pyproject.toml, constraints-cpu.txt, the chart and the API defaults.

Not checked here: that the images build (no Docker on the test machines). `pip install --dry-run` of the trainer
image's install line resolves once pyproject.toml's trainer extra admits torch 2.14.0 (see test below).
"""

from __future__ import annotations

import io
import re
import shlex
import tomllib
from typing import Any

import pytest
import yaml
from chartlib import CHART, REPO

import dockerfile_parse  # noqa: E402  (test extra)
from packaging.requirements import Requirement  # noqa: E402
from packaging.version import Version  # noqa: E402

# vLLM 0.33.0's wheel metadata: torch==2.14.0, transformers>=5.16.1,<5.21.0 (docs/engineering-notes.md, "vLLM 0.33.0 wheel pins").
VLLM_TORCH = "2.14.0"
VLLM_TRANSFORMERS = ">=5.16.1,<5.21"


def parse(name: str) -> Any:
    return dockerfile_parse.DockerfileParser(fileobj=io.BytesIO((REPO / name).read_bytes()))


def instructions(df: Any, kind: str) -> list[str]:
    return [i["value"] for i in df.structure if i["instruction"] == kind]


def final_stage(df: Any) -> list[dict[str, Any]]:
    froms = [n for n, i in enumerate(df.structure) if i["instruction"] == "FROM"]
    return df.structure[froms[-1]:]


def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def extra(name: str) -> dict[str, Requirement]:
    return {Requirement(r).name: Requirement(r) for r in pyproject()["project"]["optional-dependencies"][name]}


def cpu_pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints-cpu.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip()] = version.strip()
    return pins


def pip_installs(df: Any) -> list[list[str]]:
    """The argument lists of every `pip install` in RUN instructions (shell-split, `&&` chains split)."""
    out = []
    for run in instructions(df, "RUN"):
        for part in re.split(r"&&|;", run):
            words = shlex.split(part.replace("\\\n", " "), posix=True) if "pip install" in part else []
            if words[:2] == ["pip", "install"]:
                out.append(words[2:])
    return out


def non_root_user(df: Any) -> int:
    users = [i["value"] for i in final_stage(df) if i["instruction"] == "USER"]
    assert users, "the final stage sets no USER (runs as root)"
    uid = users[-1].split(":")[0]
    assert uid.isdigit(), f"USER {users[-1]}: use a numeric uid so runAsNonRoot can verify it"
    assert int(uid) != 0
    return int(uid)


# --- operator image ---------------------------------------------------------------------------------------------

def test_operator_image() -> None:
    df = parse("Dockerfile.operator")
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", df.baseimage), df.baseimage
    installs = [args for args in pip_installs(df) if any(a.startswith(".[") for a in args)]
    assert installs == [["-c", "constraints-cpu.txt", ".[operator]"]], installs
    for run in instructions(df, "RUN"):
        assert "pip install torch" not in run and "trainer]" not in run
    assert "find_spec('torch')" in " ".join(instructions(df, "RUN")), "the build must prove torch is absent"
    # The chart runs the pod as this uid with runAsNonRoot.
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert non_root_user(df) == values["securityContext"]["runAsUser"] == values["securityContext"]["runAsGroup"]
    assert instructions(df, "ENTRYPOINT") == ['["daedalus", "operator"]']
    exposed = " ".join(instructions(df, "EXPOSE")).split()
    assert {str(values["operator"]["healthPort"]), str(values["operator"]["metricsPort"])} <= set(exposed)
    # The operator extra pins the Ray client to the cluster's Ray.
    assert str(extra("operator")["ray"].specifier) == f"=={cpu_pins()['ray']}"


# --- trainer image ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trainer() -> Any:
    return parse("Dockerfile.trainer")


def test_trainer_image_base_user_and_install(trainer: Any) -> None:
    assert trainer.baseimage.startswith("nvidia/cuda:13.0"), "torch 2.14.0 wheels ship CUDA 13.0 libraries"
    assert "runtime" in trainer.baseimage
    installs = [args for args in pip_installs(trainer) if any(a.startswith(".[") for a in args)]
    assert installs == [["-c", "constraints-gpu.txt", ".[trainer,gpu]"]], installs
    run = " ".join(instructions(trainer, "RUN"))
    for arg in ("TORCH_VERSION", "VLLM_VERSION", "TRANSFORMERS_VERSION", "PEFT_VERSION", "RAY_VERSION"):
        assert f"${{{arg}}}" in run, f"{arg} does not reach constraints-gpu.txt"
    assert "installed versions differ from the pins" in run, "the build must verify the installed versions"
    assert non_root_user(trainer) > 0
    assert trainer.envs.get("HF_HUB_OFFLINE") == "1"     # no hub downloads at run time (DESIGN §2)
    assert "9400" in " ".join(instructions(trainer, "EXPOSE")).split()


def test_trainer_image_exposes_the_head_ports_and_runs_as_the_documented_uid(trainer: Any) -> None:
    """The Ray head container the operator builds (resources.build_raycluster) names its ports; the image documents
    each with EXPOSE. The uid is the one docs/deploy.md gives the checkpoint directory (chown 10001:10001)."""
    from daedalus_trainer.config import RLTrainingJobStatus, parse_job

    from daedalus_operator import resources
    from daedalus_operator.plan import JobView
    from daedalus_operator.settings import OperatorSettings

    doc = yaml.safe_load((REPO / "examples" / "hyperpod-qwen3vl-8b.yaml").read_text())
    job = JobView(name="j", namespace="ns", uid="u", generation=1, spec=parse_job(doc).spec,
                  status=RLTrainingJobStatus())
    head = resources.build_raycluster(job, OperatorSettings())["spec"]["headGroupSpec"]["template"]["spec"]
    ports = {str(p["containerPort"]) for p in head["containers"][0]["ports"]}
    exposed = set(" ".join(instructions(trainer, "EXPOSE")).split())
    assert ports <= exposed, f"head ports not exposed by Dockerfile.trainer: {sorted(ports - exposed)}"
    assert non_root_user(trainer) == 10001
    assert "chown -R 10001:10001" in (REPO / "docs" / "deploy.md").read_text()


def test_trainer_pins_agree_with_the_project(trainer: Any) -> None:
    args = trainer.args
    cpu = cpu_pins()
    trainer_extra, gpu_extra = extra("trainer"), extra("gpu")
    # vLLM: the gpu extra's pin.
    assert str(gpu_extra["vllm"].specifier) == f"=={args['VLLM_VERSION']}"
    # Ray: one version everywhere (image, CPU stack, both extras, the API default rayVersion).
    assert args["RAY_VERSION"] == cpu["ray"]
    assert str(trainer_extra["ray"].specifier) == str(extra("operator")["ray"].specifier) == f"=={cpu['ray']}"
    from daedalus_trainer.config import ClusterSpec
    assert ClusterSpec().ray_version == args["RAY_VERSION"]
    # transformers and peft: the CPU stack's versions, inside the trainer extra's ranges and vLLM's range.
    assert args["TRANSFORMERS_VERSION"] == cpu["transformers"]
    assert trainer_extra["transformers"].specifier.contains(args["TRANSFORMERS_VERSION"])
    assert Requirement(f"transformers{VLLM_TRANSFORMERS}").specifier.contains(args["TRANSFORMERS_VERSION"])
    assert args["PEFT_VERSION"] == cpu["peft"]
    assert trainer_extra["peft"].specifier.contains(args["PEFT_VERSION"])
    # torch: the version vLLM requires, one minor above the CPU stack's.
    assert args["TORCH_VERSION"] == VLLM_TORCH
    assert Version(cpu["torch"]).release[:2] <= Version(args["TORCH_VERSION"]).release[:2]


def test_trainer_extra_admits_the_gpu_torch(trainer: Any) -> None:
    assert extra("trainer")["torch"].specifier.contains(trainer.args["TORCH_VERSION"])


def test_dockerignore_keeps_only_what_the_images_copy() -> None:
    lines = [l for l in (REPO / ".dockerignore").read_text().splitlines() if l and not l.startswith("#")]
    assert lines[0] == "**"
    allowed = {l[1:].rstrip("/") for l in lines if l.startswith("!")}
    copied = set()
    for name in ("Dockerfile.operator", "Dockerfile.trainer"):
        for value in instructions(parse(name), "COPY"):
            words = value.split()
            if any(w.startswith("--from") for w in words):
                continue
            copied |= {w.rstrip("/") for w in words[:-1]}
    assert copied == allowed, (copied, allowed)
    for path in copied:
        assert (REPO / path).exists(), path


def test_images_copy_every_file_the_package_build_reads() -> None:
    """`pip install .` in an image reads pyproject's readme and license-files: a missing COPY fails the build."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needed = {"pyproject.toml", project["readme"], *project["license-files"]}
    for name in ("Dockerfile.operator", "Dockerfile.trainer"):
        copied = {w.rstrip("/") for value in instructions(parse(name), "COPY") for w in value.split()[:-1]
                  if not w.startswith("--")}
        assert needed <= copied, (name, needed - copied)
