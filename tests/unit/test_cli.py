"""The command line's handling of bad input: a clear message and exit code, before any work starts."""

from __future__ import annotations

import os

import pytest
import yaml

from daedalus_trainer import cli
from daedalus_trainer import config as c
from daedalus_trainer.local import run_local, start_fingerprint
from support.jobs import ROOT, tiny_job_dict

EXAMPLE = str(ROOT / "examples" / "local-tiny.yaml")


@pytest.mark.parametrize("argv", [
    ["run", EXAMPLE, "--resume", "lastest"],
    ["train", "--config", EXAMPLE, "--resume", "/no/such/checkpoint"],
])
def test_resume_typo_is_rejected_before_anything_runs(argv, capsys):
    # argparse exits with 2 while parsing: no subcommand function (SFT, Ray, training) has been called
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert "expected 'latest', 'none' or the path of a checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("value,message", [("0", "must be at least 1"), ("-3", "must be at least 1"),
                                           ("ten", "expected a whole number")])
def test_eval_mazes_must_be_positive(value, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["eval", EXAMPLE, "--model", "m", "--mazes", value])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_run_rejects_a_resume_path_without_a_checkpoint_before_sft(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    job = tiny_job_dict()
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    assert run_local(str(job_file), runs_dir=str(tmp_path / "runs"), resume=str(empty)) == 2
    assert not (tmp_path / "runs" / job["metadata"]["name"] / "sft").exists()  # SFT never started


def test_a_directory_or_binary_file_is_a_spec_error(tmp_path, capsys):
    with pytest.raises(c.SpecError) as info:
        c.load_documents(tmp_path)
    assert info.value.errors == [("(file)", "is a directory, not a YAML or JSON file")]
    binary = tmp_path / "m.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    with pytest.raises(c.SpecError) as info:
        c.load_documents(binary)
    assert info.value.errors[0][0] == "(file)" and "not UTF-8" in info.value.errors[0][1]
    assert cli.main(["validate", str(tmp_path), str(binary)]) == 1
    out = capsys.readouterr().out
    assert "is a directory" in out and "not UTF-8" in out
    assert cli.main(["run", str(tmp_path)]) == 2  # SpecError -> "error: ..." and exit 2, no traceback
    assert "is a directory" in capsys.readouterr().err


def test_manifests_are_read_as_the_api_server_reads_them():
    """Quoted numbers and booleans are strings to the API server, snake_case keys are unknown fields, quantities
    follow Kubernetes' grammar: the same object `kubectl apply` rejects, `daedalus validate` rejects."""
    cases = [
        (("algorithm", "learningRate", "0.002"), "spec.algorithm.learningRate", "unquote it"),
        (("model", "tiny", "true"), "spec.model.tiny", "unquote it"),
        (("algorithm", "group_size", 8), "spec.algorithm.group_size", "Extra inputs are not permitted"),
        (("cluster", "head", {"cpu": "2", "memory": "lots"}), "spec.cluster.head.memory", "Kubernetes quantity"),
        (("cluster", "head", {"cpu": 2, "memory": "4Gi"}), "spec.cluster.head.cpu", "quote it"),
    ]
    for (section, key, value), path, fragment in cases:
        job = tiny_job_dict()
        job["spec"][section][key] = value
        with pytest.raises(c.SpecError) as info:
            c.parse_job(job)
        assert any(p == path and fragment in m for p, m in info.value.errors), info.value.errors
    job = tiny_job_dict()
    job["spec"]["algorithm"]["learningRate"] = 1  # an integer is a number: JSON has no separate float type
    job["spec"]["cluster"]["head"] = {"cpu": "500m", "memory": "1.5Gi"}
    parsed = c.parse_job(job)
    assert parsed.spec.algorithm.learning_rate == 1.0 and parsed.spec.cluster.head.cpu == "500m"
    assert parsed.spec.algorithm.loss_aggregation.value == job["spec"]["algorithm"]["lossAggregation"]


def test_start_fingerprint_follows_weights_and_evaluation_settings(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(b"x" * 100)
    (model / "config.json").write_text("{}")
    job = c.parse_job(tiny_job_dict())
    first = start_fingerprint(job, str(model), None)
    assert start_fingerprint(job, str(model), None) == first
    (model / "config.json").write_text('{"changed": 1}')  # not a weight file
    assert start_fingerprint(job, str(model), None) == first
    monkeypatch.chdir(tmp_path)  # the same run continued from another working directory, the path relative to it
    assert start_fingerprint(job, "model", None) == first
    other_env = c.parse_job(tiny_job_dict(environment={"evalMazes": 12}))
    assert start_fingerprint(other_env, str(model), None) != first
    hotter = c.parse_job(tiny_job_dict(algorithm={"temperature": 0.7}))
    assert start_fingerprint(hotter, str(model), None) != first
    st = weights.stat()
    weights.write_bytes(b"y" * 100)  # a new save of the same size
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert start_fingerprint(job, str(model), None) != first
