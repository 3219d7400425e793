"""The command line's handling of bad input: a clear message and exit code, before any work starts."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import pytest
import yaml

from daedalus_trainer import cli
from daedalus_trainer import config as c
from daedalus_trainer.local import _cached_evaluation, _kept_timings, run_local, start_fingerprint
from support.jobs import ROOT, tiny_job_dict
from support.tiny_model import make_tiny_job, tiny_checkpoint  # noqa: F401

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


def test_eval_names_the_directory_meant_when_given_its_parent_or_an_adapter_as_model(tmp_path, capsys):
    """`daedalus eval --model runs/<name>/exports/adapter` (an adapter as the model), `--model runs/<name>/sft` (the
    model's parent) and `--adapter runs/<name>/checkpoints/step-N` (a checkpoint holding the adapter): one line
    saying what to give instead, before anything loads. Before: 'holds no Hugging Face checkpoint (config.json)' /
    'is not a PEFT adapter directory', which did not say where the right directory is."""
    sft_dir, step = tmp_path / "sft", tmp_path / "step-000005"
    (sft_dir / "model").mkdir(parents=True)
    (sft_dir / "model" / "config.json").write_text("{}")
    (step / "adapter").mkdir(parents=True)
    (step / "adapter" / "adapter_config.json").write_text("{}")
    assert cli.main(["eval", EXAMPLE, "--model", str(step / "adapter")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --model {step}/adapter is a PEFT adapter (adapter_config.json), "
                                              f"not a model: give it as --adapter {step}/adapter, with its base model")
    assert cli.main(["eval", EXAMPLE, "--model", str(sft_dir)]) == 2
    assert capsys.readouterr().err == f"error: --model {sft_dir} holds no config.json; its model is --model " \
        f"{sft_dir}/model\n"
    assert cli.main(["eval", EXAMPLE, "--model", str(sft_dir / "model"), "--adapter", str(step)]) == 2
    assert capsys.readouterr().err == f"error: --adapter {step} holds no adapter_config.json; its adapter is " \
        f"--adapter {step}/adapter\n"


def test_eval_mazes_beyond_the_evaluation_set_are_refused(capsys):
    """examples/local-tiny.yaml holds 64 evaluation mazes: --mazes 65 was silently 64 (the sets are cut, never
    extended); now one line before the model loads (here a missing one, not reached), 64 passes the check."""
    assert cli.main(["eval", EXAMPLE, "--model", "m", "--mazes", "65"]) == 2
    assert capsys.readouterr().err == (
        "error: --mazes 65 is more than the 64 mazes of the job's evaluation sets (environment.evalMazes); give "
        "--mazes 64 or fewer, or raise environment.evalMazes (which also holds more layouts out of training)\n")
    assert cli.main(["eval", EXAMPLE, "--model", "m", "--mazes", "64"]) == 2
    assert capsys.readouterr().err == "error: m does not exist (expected a model directory with config.json)\n"


@pytest.mark.parametrize("argv,message", [
    (["--size", "20001"], "argument --size: must be 5-63 (environment.size's range), got 20001"),
    (["--cell-px", "100000"], "argument --cell-px: must be 4-128 (environment.cellPixels' range), got 100000"),
    (["--size", "nine"], "argument --size: expected a whole number, got 'nine'"),
])
def test_maze_sizes_outside_the_specs_range_are_one_line(argv, message, capsys):
    """Before, --size 20001 or --cell-px 100000 tried to allocate hundreds of GiB and died with a traceback."""
    with pytest.raises(SystemExit) as info:
        cli.main(["maze", *argv])
    assert info.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == f"daedalus maze: error: {message}"


def test_run_rejects_a_resume_path_without_a_checkpoint_before_sft(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    job = tiny_job_dict()
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    assert run_local(str(job_file), runs_dir=str(tmp_path / "runs"), resume=str(empty)) == 2
    assert not (tmp_path / "runs" / job["metadata"]["name"] / "sft").exists()  # SFT never started


def _rank4_checkpoint(root: Path) -> Path:
    """A GRPO checkpoint (step 5) under ``root`` holding a rank-4 LoRA adapter (alpha 8, q/v): another adapter than
    the tiny jobs train (rank 16, alpha 32). Returns the checkpoint's directory."""
    import torch

    from daedalus_trainer.checkpoint import AdapterState, CheckpointManager, TrainerState, capture_rng_state

    lora = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
            "task_type": "CAUSAL_LM"}
    tensors = {"base_model.model.x.lora_A.weight": torch.zeros(4, 8), "base_model.model.x.lora_B.weight": torch.zeros(8, 4)}
    return CheckpointManager(root).save(5, AdapterState(tensors, lora), {"state": {}, "param_groups": []},
                                        TrainerState(sampler={}, rng=capture_rng_state(), metric_history=[])).path


def test_run_rejects_a_resume_checkpoint_of_another_adapter_before_sft(tmp_path, capsys):
    """`--resume PATH` whose checkpoint holds a rank-4 adapter, for a job that trains rank 16: refused in seconds,
    before SFT, Ray or the run directory, naming both values."""
    checkpoint = _rank4_checkpoint(tmp_path / "other" / "checkpoints")
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(tiny_job_dict()))
    runs = tmp_path / "runs"
    assert cli.main(["run", str(job_file), "--runs-dir", str(runs), "--resume", str(checkpoint), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "r: checkpoint 4, this run 16" in err and "lora_alpha: checkpoint 8.0, this run 32.0" in err
    assert not runs.exists()


def test_train_rejects_a_resume_path_before_ray_starts(tmp_path, capsys, monkeypatch):
    """`daedalus train --resume PATH` with a directory holding no checkpoint, or a checkpoint of another adapter:
    one `error:` line, exit 2, before Ray starts or the job directory is created (before, Ray, the metrics server
    and the tiny base model were started first, and the run directory was left behind)."""
    import ray

    monkeypatch.setenv("DAEDALUS_METRICS_PORT", "0")
    ray_before = ray.is_initialized()  # an earlier test of the session may have left this process's Ray running
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(tiny_job_dict()))
    out = tmp_path / "train"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["train", "--config", str(job_file), "--out", str(out), "--resume", str(empty)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"error: resume path {empty} holds no checkpoint (no " \
        "step-NNNNNN directory)"
    checkpoint = _rank4_checkpoint(tmp_path / "other" / "checkpoints")
    assert cli.main(["train", "--config", str(job_file), "--out", str(out), "--resume", str(checkpoint)]) == 2
    assert "r: checkpoint 4, this run 16" in capsys.readouterr().err.splitlines()[-1]
    assert not out.exists() and ray.is_initialized() == ray_before


def _with_a_killed_resave(root: Path) -> Path:
    """``root`` holding step 5 and, as the only copy of step 6, the ``.trash-step-000006-*`` a kill between a re-save's
    two renames left (both rank-4 checkpoints, see :func:`_rank4_checkpoint`). Returns step 6's path once put back."""
    import shutil

    step5 = _rank4_checkpoint(root)
    _rank4_checkpoint(root / "six")
    shutil.move(root / "six" / "step-000005", root / ".trash-step-000006-0badc0de")
    shutil.rmtree(root / "six")
    state = json.loads((root / ".trash-step-000006-0badc0de" / "trainer_state.json").read_text())
    state["step"] = 6
    (root / ".trash-step-000006-0badc0de" / "trainer_state.json").write_text(json.dumps(state))
    _rehash(root / ".trash-step-000006-0badc0de")  # the manifest lists trainer_state.json's size and hash
    return step5.parent / "step-000006"


def _rehash(path: Path) -> None:
    import hashlib

    manifest = json.loads((path / "MANIFEST.json").read_text())
    for entry in manifest["files"]:
        data = (path / entry["path"]).read_bytes()
        entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (path / "MANIFEST.json").write_text(json.dumps(manifest))


def test_train_resume_path_of_its_own_root_puts_back_a_checkpoint_a_killed_resave_left_aside(tmp_path, capsys,
                                                                                                monkeypatch):
    """`daedalus train --resume <out>/checkpoints` (a root: its newest checkpoint) after a kill between the two
    renames of a re-save of step 6: step 6 is put back first and is the one resumed (here refused by its adapter,
    before Ray starts, naming it), as when the Trainer read the PATH itself; the early check had picked step 5."""
    monkeypatch.setenv("DAEDALUS_METRICS_PORT", "0")
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(tiny_job_dict()))
    out = tmp_path / "train"
    step6 = _with_a_killed_resave(out / "checkpoints")
    assert cli.main(["train", "--config", str(job_file), "--out", str(out), "--resume", str(out / "checkpoints")]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert "r: checkpoint 4, this run 16" in err and str(step6) in err, err
    assert step6.is_dir()


def test_trainer_given_a_loaded_checkpoint_puts_back_its_own_root_s_replaced_checkpoint(tmp_path):
    """Trainer.train(LoadedCheckpoint): the run directory's own checkpoint that a killed re-save left as .trash-* is
    put back (as with a PATH), so the run moves it aside with the timeline it does not continue, not a later save's
    clean-up back into the new one. Here the given checkpoint (another directory's) is refused by its adapter before
    any actor starts."""
    from daedalus_trainer.checkpoint import CheckpointError, load_checkpoint
    from daedalus_trainer.config import parse_job
    from daedalus_trainer.grpo import Trainer

    run = tmp_path / "run"
    own = _with_a_killed_resave(run / "checkpoints")
    loaded = load_checkpoint(_rank4_checkpoint(tmp_path / "other" / "checkpoints"))
    with pytest.raises(CheckpointError, match="r: checkpoint 4, this run 16"):
        Trainer(parse_job(tiny_job_dict()), run, work_dir=tmp_path / "work").train(loaded)
    assert own.is_dir()


def test_paths_ports_and_variables_give_one_line_errors(tmp_path, capsys, monkeypatch):
    """A file where a directory must go, a port out of range or taken, a malformed environment variable: `error:`
    (or argparse's) one line and exit 2, before the model, Ray or training start; a bad $DAEDALUS_METRICS_PORT does
    not break the commands that do not serve metrics."""
    import socket

    blocker = tmp_path / "afile"
    blocker.write_text("")
    assert cli.main(["run", EXAMPLE, "--runs-dir", str(blocker), "--port", "0"]) == 2
    assert f"--runs-dir: cannot create the directory {blocker}/local-tiny: {blocker} is a file" in capsys.readouterr().err
    assert cli.main(["sft", EXAMPLE, "--out", str(blocker / "sft")]) == 2
    assert "--out: cannot create the directory" in capsys.readouterr().err
    crd = tmp_path / "crd.yaml"
    assert cli.main(["crd", "--out", str(crd), "--out", str(blocker / "crd.yaml")]) == 2  # was a traceback
    assert capsys.readouterr().err == (f"error: --out: cannot create the directory {blocker}: {blocker} is a file, "
                                       "not a directory\n")
    assert not crd.exists()  # nothing written when one --out is bad
    assert cli.main(["crd", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: --out {tmp_path} is a directory; give the path of the file to write\n"
    assert cli.main(["eval", EXAMPLE, "--model", "m", "--json", str(tmp_path)]) == 2
    assert "is a directory; give the path of the JSON file" in capsys.readouterr().err
    # --gif and --adapter are checked before the model is loaded (here: before a missing one is noticed); a bad
    # --gif was a traceback after the whole evaluation, its result lost
    assert cli.main(["eval", EXAMPLE, "--model", "m", "--gif", str(blocker)]) == 2
    assert capsys.readouterr().err == f"error: --gif {blocker} is a file; give the directory to write the GIFs into\n"
    assert cli.main(["eval", EXAMPLE, "--model", "m", "--gif", str(blocker / "gifs")]) == 2
    assert f"--gif: cannot create the directory {blocker}/gifs: {blocker} is a file" in capsys.readouterr().err
    ascii_job = tiny_job_dict(environment={"observation": "ascii"})
    (tmp_path / "ascii.yaml").write_text(yaml.safe_dump(ascii_job))
    assert cli.main(["eval", str(tmp_path / "ascii.yaml"), "--model", "m", "--gif", str(tmp_path / "gifs")]) == 2
    assert capsys.readouterr().err == ("error: --gif: the job's environment.observation is 'ascii': its episodes "
                                       "have no images to draw GIFs from (use 'image' or 'image+ascii')\n")
    assert not (tmp_path / "gifs").exists()  # was: the evaluation, then no GIF and no word about it
    assert cli.main(["eval", EXAMPLE, "--model", "m", "--adapter", str(tmp_path / "no-adapter")]) == 2
    assert "no-adapter does not exist (expected a PEFT adapter directory" in capsys.readouterr().err
    assert cli.main(["eval", EXAMPLE, "--model", "m", "--adapter", str(tmp_path)]) == 2
    assert f"{tmp_path} is not a PEFT adapter directory (no adapter_config.json)" in capsys.readouterr().err
    job = tiny_job_dict()
    job["spec"]["checkpoint"]["path"] = str(blocker)
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    assert cli.main(["train", "--config", str(job_file)]) == 2
    assert f"checkpoint.path: cannot create the directory {blocker}/default/e2e" in capsys.readouterr().err
    for port in ("70000", "-1", "x"):
        with pytest.raises(SystemExit) as info:
            cli.main(["run", EXAMPLE, "--port", port])
        assert info.value.code == 2 and f"expected a port number 0-65535, got '{port}'" in capsys.readouterr().err
    monkeypatch.setenv("DAEDALUS_METRICS_PORT", "abc")
    assert cli.main(["validate", EXAMPLE]) == 0
    with pytest.raises(SystemExit):
        cli.main(["run", EXAMPLE])
    assert "got 'abc' (from $DAEDALUS_METRICS_PORT)" in capsys.readouterr().err
    job_file.write_text(yaml.safe_dump(tiny_job_dict()))
    out = tmp_path / "train"
    assert cli.main(["train", "--config", str(job_file), "--out", str(out)]) == 2
    assert "DAEDALUS_METRICS_PORT='abc' is not a port number" in capsys.readouterr().err
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        monkeypatch.setenv("DAEDALUS_METRICS_PORT", str(held.getsockname()[1]))
        monkeypatch.setenv("DAEDALUS_METRICS_HOST", "127.0.0.1")
        assert cli.main(["train", "--config", str(job_file), "--out", str(out)]) == 2
        assert "Address already in use); set DAEDALUS_METRICS_PORT to a free port" in capsys.readouterr().err
    monkeypatch.setenv("DAEDALUS_METRICS_PORT", "0")
    monkeypatch.setenv("DAEDALUS_ATTEMPT", "two")
    assert cli.main(["train", "--config", str(job_file), "--out", str(out)]) == 2
    assert "DAEDALUS_ATTEMPT='two' is not a whole number" in capsys.readouterr().err
    assert not out.exists()  # nothing was started
    monkeypatch.delenv("DAEDALUS_ATTEMPT")
    job = tiny_job_dict()
    job["spec"]["model"]["sftAdapter"] = str(tmp_path / "no-such-adapter")
    job_file.write_text(yaml.safe_dump(job))
    assert cli.main(["run", str(job_file), "--runs-dir", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err == f"error: model.sftAdapter '{tmp_path}/no-such-adapter' does not exist on this " \
        "machine\n"
    assert cli.main(["sft", str(job_file), "--out", str(tmp_path / "sft")]) == 2  # was "is neither a model ..."
    assert capsys.readouterr().err.splitlines()[-1] == f"error: model.sftAdapter '{tmp_path}/no-such-adapter' does " \
        "not exist on this machine"
    assert not (tmp_path / "sft").exists()  # refused before --out was created
    # a path with brackets is printed as written: rich read "[/y]" as a closing tag (MarkupError traceback)
    job["spec"]["model"]["sftAdapter"] = "x[/y]"
    job_file.write_text(yaml.safe_dump(job))
    assert cli.main(["run", str(job_file), "--runs-dir", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err == "error: model.sftAdapter 'x[/y]' does not exist on this machine\n"
    odd = tmp_path / "ck[/x]"
    odd.mkdir(parents=True)
    assert cli.main(["run", EXAMPLE, "--runs-dir", str(tmp_path / "runs"), "--resume", str(odd)]) == 2
    assert capsys.readouterr().err == f"error: --resume {odd}: resume path {odd} holds no checkpoint (no " \
        "step-NNNNNN directory)\n"
    job["spec"]["model"]["sftAdapter"] = str(tmp_path / "no-such-adapter")
    job_file.write_text(yaml.safe_dump(job))
    (tmp_path / "no-such-adapter").mkdir()  # a directory, but neither an adapter nor a model
    assert cli.main(["run", str(job_file), "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "no-such-adapter' is neither a PEFT adapter directory" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # refused before anything was created
    (tmp_path / "no-such-adapter" / "adapter_config.json").write_text("{}")  # an adapter, for a real model whose
    job["spec"]["model"].update({"tiny": False, "path": str(tmp_path / "no-such-model")})  # base is not here
    job["spec"]["cluster"]["workerGroups"][0]["gpusPerWorker"] = 1
    job_file.write_text(yaml.safe_dump(job))
    assert cli.main(["run", str(job_file), "--runs-dir", str(tmp_path / "runs")]) == 2  # ... but has no weights
    assert "no-such-adapter: it has adapter_config.json but no weights" in capsys.readouterr().err
    import safetensors.torch
    import torch

    safetensors.torch.save_file({"w": torch.zeros(2)}, str(tmp_path / "no-such-adapter" / "adapter_model.safetensors"))
    job_file.write_text(yaml.safe_dump(job))
    assert cli.main(["run", str(job_file), "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "no-such-model' holds no Hugging Face checkpoint (config.json)" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    assert cli.main(["sft", str(job_file), "--out", str(tmp_path / "sft")]) == 2
    assert "no-such-model' holds no Hugging Face checkpoint (config.json)" in capsys.readouterr().err
    assert not (tmp_path / "sft").exists()
    assert cli.main(["eval", EXAMPLE, "--model", str(tmp_path / "no-such-model")]) == 2
    assert "no-such-model does not exist (expected a model directory" in capsys.readouterr().err


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
        (("algorithm", "group_size", 8), "spec.algorithm.group_size", "the API spells it 'groupSize' (camelCase)"),
        (("cluster", "head", {"cpu": "2", "memory": "lots"}), "spec.cluster.head.memory", "Kubernetes quantity"),
        (("cluster", "head", {"cpu": 0.5, "memory": "4Gi"}), "spec.cluster.head.cpu", "quote it"),
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


def _write(tmp_path, text: str, name: str = "job.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _example_with(old: str, new: str) -> str:
    text = (ROOT / "examples" / "local-tiny.yaml").read_text()
    assert old in text
    return text.replace(old, new, 1)


def test_yaml_is_read_as_kubectl_reads_it(tmp_path):
    """`2e-3` is a number (YAML 1.2, Kubernetes' decoder; PyYAML alone reads a string); a key given twice is an
    error naming the file and both lines (kubectl refuses it) instead of the last one silently winning."""
    job = c.load_job(_write(tmp_path, _example_with("learningRate: 0.002", "learningRate: 2e-3")))
    assert job.spec.algorithm.learning_rate == 0.002
    job = c.load_job(_write(tmp_path, _example_with("learningRate: 0.002", "learningRate: 1E-3")))
    assert job.spec.algorithm.learning_rate == 0.001
    quoted = _write(tmp_path, _example_with("learningRate: 0.002", 'learningRate: "2e-3"'))
    with pytest.raises(c.SpecError) as info:
        c.load_job(quoted)
    assert any(p == "spec.algorithm.learningRate" and "unquote it" in m for p, m in info.value.errors)

    dup = _write(tmp_path, _example_with("    steps: 48 ", "    steps: 4\n    steps: 48 "), "dup.yaml")
    with pytest.raises(c.SpecError) as info:
        c.load_job(dup)
    (path, message), = info.value.errors
    assert path == "(syntax)" and "found duplicate key 'steps'" in message
    assert "\n" not in message and "<unicode string>" not in message  # one line; the file is the error's source
    assert str(info.value).startswith(f"{dup}: 1 error(s)")
    lines = [i + 1 for i, line in enumerate(dup.read_text().splitlines()) if line.startswith("    steps:")]
    assert message.startswith(f"line {lines[1]}, column 5: found duplicate key 'steps' (first given on line "
                              f"{lines[0]}) (while constructing a mapping from line ")
    # a key repeated on one line (a flow mapping, one-line JSON) is refused too; before, the last one won
    doc = json.loads(json.dumps(yaml.safe_load(Path(EXAMPLE).read_text())))
    one_line = json.dumps(doc).replace('"steps": 48', '"steps": 4, "steps": 48', 1)
    assert one_line.count('"steps"') >= 2
    with pytest.raises(c.SpecError) as info:
        c.load_job(_write(tmp_path, one_line, "dup.json"))
    (path, message), = info.value.errors
    assert path == "(syntax)" and "found duplicate key 'steps' (first given on line 1)" in message


def test_unknown_and_misplaced_fields_say_where_they_belong():
    cases = [
        # (where the key goes, key, error path, message fragment)
        ((), "suspend", "suspend", "'suspend' is a field of 'spec' (spec.suspend)"),
        (("spec", "algorithm"), "batch_size", "spec.algorithm.batch_size", "is a field of 'spec.sft'"),
        (("spec", "algorithm"), "learningrate", "spec.algorithm.learningrate", "the API spells it 'learningRate'"),
        (("spec", "algorithm"), "learnignRate", "spec.algorithm.learnignRate", "did you mean 'learningRate'"),
        ((), "annotations", "annotations", "'annotations' is a field of 'metadata' (metadata.annotations)"),
        ((), "foo", "foo", "the fields here are apiVersion, kind, metadata, spec, status"),
    ]
    for where, key, path, fragment in cases:
        job = tiny_job_dict()
        node = job
        for part in where:
            node = node[part]
        node[key] = 1
        with pytest.raises(c.SpecError) as info:
            c.parse_job(job)
        assert info.value.errors == [(path, info.value.errors[0][1])] and fragment in info.value.errors[0][1], \
            info.value.errors


def test_a_misspelt_or_missing_spec_is_reported_as_such():
    job = tiny_job_dict()
    job["spc"] = job.pop("spec")
    with pytest.raises(c.SpecError) as info:
        c.parse_job(job)
    paths = dict(info.value.errors)
    assert set(paths) == {"spc", "spec"}  # not the defaults' "model.path is required"
    assert "did you mean 'spec'" in paths["spc"] and paths["spec"].startswith("required")


def test_another_kind_is_one_error_about_the_kind(tmp_path):
    cm = _write(tmp_path, "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {a: b}\n")
    with pytest.raises(c.SpecError) as info:
        c.load_job(cm)
    assert dict(info.value.errors) == {"kind": "expected 'RLTrainingJob', got 'ConfigMap'",
                                       "apiVersion": "expected 'daedalus.dev/v1alpha1', got 'v1'"}


def test_messages_name_the_value_and_the_rule():
    cases = [
        (("metadata", "name"), "Local_Tiny", "metadata.name", "lowercase DNS label", "'Local_Tiny'"),
        (("spec", "algorithm", "lrSchedule"), "linear", "spec.algorithm.lrSchedule", "'constant' or 'cosine'",
         "(got 'linear')"),
        (("spec", "algorithm", "groupSize"), "eight", "spec.algorithm.groupSize", "valid integer", "(got 'eight')"),
        (("spec", "algorithm", "groupSize"), 1, "spec.algorithm.groupSize", "greater than or equal to 2", "(got 1)"),
        # `name: no` in YAML: was "(got the number False: quote it)"
        (("metadata", "name"), False, "metadata.name", "valid string", "(got the boolean false: quote it; YAML reads "
         "unquoted yes, no, on, off, true and false as booleans)"),
        (("spec", "model", "name"), 7, "spec.model.name", "valid string", "(got the number 7: quote it)"),
        # booleans and nulls as the YAML wrote them, not as Python prints them ("got True", "got None")
        (("spec", "algorithm", "steps"), True, "spec.algorithm.steps", "valid integer", "(got true)"),
        # a null field is defaulted as the API server defaults it (test_api.py); a null list item is an error
        (("spec", "lora", "targetModules"), ["q_proj", None], "spec.lora.targetModules[1]", "valid string",
         "(got null)"),
    ]
    for where, value, path, rule, shown in cases:
        job = tiny_job_dict()
        node = job
        for part in where[:-1]:
            node = node.setdefault(part, {})
        node[where[-1]] = value
        with pytest.raises(c.SpecError) as info:
            c.parse_job(job)
        messages = [m for p, m in info.value.errors if p == path]
        assert messages and rule in messages[0] and shown in messages[0], info.value.errors


def test_a_field_left_empty_is_named_with_the_value_used_in_its_place(tmp_path, capsys, caplog):
    """`name:` with nothing after it is null in YAML; the API server drops such a field silently and defaults it
    (test_api.py). `daedalus validate` still calls the job valid, and names each dropped field with what applies
    instead; the commands that read one job (run, train, sft, eval) log the same as warnings."""
    doc = tiny_job_dict()
    doc["spec"]["model"]["name"] = None
    doc["spec"]["checkpoint"] = None
    doc["spec"]["cluster"] = {"head": {"nodeSelector": {"topology.kubernetes.io/zone": None}},
                              "workerGroups": [{"name": "gpu", "replicas": None}]}
    path = _write(tmp_path, yaml.safe_dump(doc))
    assert cli.main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.splitlines()]
    assert lines[0] == f"✓ {path}: RLTrainingJob 'e2e' is valid"
    default_checkpoint = json.dumps(c.CheckpointSpec().model_dump(by_alias=True, mode="json"))
    assert lines[1:] == [  # in the file's order (safe_dump sorts the keys)
        f"! spec.checkpoint: empty (null), so read as left out, as the API server reads it: the default "
        f"{default_checkpoint} applies",
        '! spec.cluster.head.nodeSelector."topology.kubernetes.io/zone": empty (null), so dropped, as the API '
        'server drops it',
        "! spec.cluster.workerGroups[0].replicas: empty (null), so read as left out, as the API server reads it: the "
        "default 1 applies",
        '! spec.model.name: empty (null), so read as left out, as the API server reads it: the default '
        f'{json.dumps(c.ModelSpec().name)} applies',
    ]
    with caplog.at_level(logging.WARNING, logger="daedalus.config"):
        job = c.load_job(path)
    assert job.spec.cluster.head.node_selector == {} and job.spec.cluster.worker_groups[0].replicas == 1
    warned = [r.getMessage() for r in caplog.records if r.name == "daedalus.config"]
    assert warned == [f"{path}: {line[2:]}" for line in lines[1:]]
    # nothing left empty: nothing said
    dropped: list = []
    job = c.parse_job(tiny_job_dict(), dropped=dropped)
    assert dropped == [] and c.dropped_null_notes(dropped, job) == []


def test_a_large_or_alias_nested_value_is_shown_cut_short(tmp_path, capsys):
    """A list where a string or number belongs is shown by its first items: YAML aliases nesting 9^6 strings (a
    "billion laughs" of depth 6; depth 9 made `daedalus validate` run for minutes) printed megabytes before."""
    levels = ["    l0: &l0 [" + ", ".join(["x"] * 9) + "]"]
    levels += [f"    l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 6)]
    bomb = _write(tmp_path, "apiVersion: daedalus.dev/v1alpha1\nkind: RLTrainingJob\nmetadata:\n  name: a\n"
                            "  labels:\n" + "\n".join(levels) + "\nspec:\n  algorithm: {steps: *l5}\n")
    assert cli.main(["validate", str(bomb)]) == 1
    out = capsys.readouterr().out
    assert len(out) < 3000 and "spec.algorithm.steps: Input should be a valid integer (got [[[...], " in out
    assert "metadata.labels: the value of 'l0' must be a string; got the list ['x', 'x', 'x', 'x', ...]" in out


def test_an_empty_list_holds_no_job(tmp_path, capsys):
    """`kubectl get rltj -A -o yaml` where there are no jobs: validate says so (exit 0: nothing is invalid), a
    command that needs a job refuses it."""
    empty = _write(tmp_path, "apiVersion: v1\nkind: List\nitems: []\n")
    assert c.load_documents(empty) == []
    with pytest.raises(c.SpecError, match="holds no items"):
        c.load_job(empty)
    assert cli.main(["validate", str(empty)]) == 0
    assert "a List with no items: no RLTrainingJob to validate" in capsys.readouterr().out


def test_no_command_prints_the_whole_help(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    assert "daedalus run examples/local-tiny.yaml" in out and "validate" in out and "operator" in out


def test_a_missing_job_file_is_one_plain_line(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert cli.main(["eval", str(missing), "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {missing}: no such file or directory\n"
    assert cli.main(["validate", str(missing)]) == 1  # validate lists it among the files it could not accept
    assert f"{missing}: no such file" in capsys.readouterr().out


def test_help_states_the_exit_codes_the_commands_return(tmp_path, capsys):
    """The epilog's codes are the ones returned: 0 for a valid file, 1 for an invalid one, 2 for bad input."""
    cli.main([])
    out = capsys.readouterr().out
    assert "exit status:" in out and "\n  1    `validate`: a job file is invalid or missing" in out
    assert "\n  130  interrupted" in out and "`daedalus operator --help` lists the operator's own" in out
    invalid = _write(tmp_path, "apiVersion: daedalus.dev/v1alpha1\nkind: RLTrainingJob\nmetadata: {name: a}\n"
                               "spec: {environment: {size: 8}}\n")
    assert cli.main(["validate", EXAMPLE]) == 0
    assert cli.main(["validate", str(invalid)]) == 1
    assert cli.main(["run", str(invalid)]) == 2
    assert "spec.environment.size" in capsys.readouterr().err


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
    # the adapter by content: exported again byte for byte (a rerun of a finished run), the same; changed, not
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"a" * 64)
    with_adapter = start_fingerprint(job, str(model), str(adapter))
    (adapter / "adapter_model.safetensors").write_bytes(b"a" * 64)
    os.utime(adapter / "adapter_model.safetensors", ns=(1, 2))
    assert start_fingerprint(job, str(model), str(adapter)) == with_adapter
    (adapter / "adapter_model.safetensors").write_bytes(b"b" * 64)
    assert start_fingerprint(job, str(model), str(adapter)) != with_adapter


def test_a_truncated_cached_evaluation_is_evaluated_again_with_a_warning(tiny_checkpoint, tmp_path, caplog):
    """``eval-before.json`` cut short (an older version wrote it in place and was killed, or the disk filled) is only
    a cache: `daedalus run` logs a warning naming it and evaluates again instead of dying on json.loads; the files it
    writes then are complete, carry the start's fingerprint and serve as the cache (no third evaluation)."""
    from rich.console import Console

    job = make_tiny_job(None, environment={"evalMazes": 2, "evalCorners": 1, "maxTurns": 2})
    model = str(tiny_checkpoint)
    fingerprint = start_fingerprint(job, model, None)
    (tmp_path / "eval-before-training.json").write_text(json.dumps({"start_fingerprint": fingerprint}))
    whole = json.dumps({"start_fingerprint": fingerprint, "split": "held-out", "results": []}, indent=2)
    (tmp_path / "eval-before.json").write_text(whole[: len(whole) // 2])

    def cached(out: io.StringIO) -> tuple[dict, dict]:
        return _cached_evaluation(Console(file=out, width=200), job, model, None, tmp_path, "before",
                                  title="EVALUATING", stale="STALE")

    first = io.StringIO()
    with caplog.at_level(logging.WARNING, logger="daedalus.local"):
        held_out, training = cached(first)
    assert "EVALUATING" in first.getvalue() and "STALE" not in first.getvalue()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(tmp_path / "eval-before.json") in warnings[0]
    assert "does not parse as JSON" in warnings[0] and "evaluating again" in warnings[0]
    assert (held_out["split"], training["split"]) == ("held-out", "training")
    assert held_out["results"][0]["episodes"] == 2 and training["results"][0]["episodes"] == 2
    for name, ev in (("eval-before.json", held_out), ("eval-before-training.json", training)):
        assert json.loads((tmp_path / name).read_text()) == ev and ev["start_fingerprint"] == fingerprint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval-before-training.json", "eval-before.json"]
    second = io.StringIO()
    assert cached(second) == (held_out, training) and "EVALUATING" not in second.getvalue()


def test_the_run_report_names_the_model_and_adapters_by_absolute_paths(tiny_checkpoint, tmp_path, monkeypatch):
    """``report.json`` is read later from elsewhere: the evaluations in it name the model and adapter evaluated by
    absolute paths, as its ``adapter`` (the exported one) already was, even when the job gave them relative to the
    working directory, and when the evaluation comes from a cache that recorded them as given (an older version)
    or from another working directory. Before, ``model_path``/``adapter_path`` were as given, often relative."""
    from types import SimpleNamespace

    from rich.console import Console

    from daedalus_trainer.local import _report
    from daedalus_trainer.policy import load_pretrained

    job = make_tiny_job(None, environment={"evalMazes": 2, "evalCorners": 1, "maxTurns": 2})
    policy = load_pretrained(tiny_checkpoint, "float32", "cpu")
    policy.add_lora(job.spec.lora)
    policy.save_adapter(tmp_path / "sft-adapter")
    (tmp_path / "base").symlink_to(tiny_checkpoint)
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    evaluated = _cached_evaluation(Console(file=out, width=200), job, "base", "sft-adapter", Path("run"), "before",
                                   title="EVALUATING")
    assert "EVALUATING" in out.getvalue()
    for ev in evaluated:
        assert (ev["model_path"], ev["adapter_path"]) == (str(tmp_path / "base"), str(tmp_path / "sft-adapter"))
    # a cache that recorded the paths as given, read from another working directory: the same files, absolute
    cache = tmp_path / "run" / "eval-before.json"
    cache.write_text(json.dumps(dict(json.loads(cache.read_text()), model_path="base", adapter_path="sft-adapter")))
    monkeypatch.chdir(tmp_path / "run")
    out = io.StringIO()
    before = _cached_evaluation(Console(file=out, width=200), job, "../base", "../sft-adapter", Path("."), "before",
                                title="EVALUATING")
    assert "EVALUATING" not in out.getvalue()
    for ev in before:
        assert (ev["model_path"], ev["adapter_path"]) == (str(tmp_path / "base"), str(tmp_path / "sft-adapter"))
    result = SimpleNamespace(steps_done=2, wall_seconds=1.0, adapter_dir=Path("exports/adapter"), resumed_from=None)
    report = _report(job, before[0], before[0], result, 2.0, training=(before[1], before[1]))
    assert report["adapter"] == str(tmp_path / "run" / "exports" / "adapter")
    assert report["before"]["model_path"] == report["after_training"]["model_path"] == str(tmp_path / "base")


def test_the_grpo_summary_says_how_many_steps_the_timed_call_trained():
    """`daedalus run`'s closing line: a run trained from step 0 gives all its steps and seconds; a resumed one says
    its seconds are those of the last steps (tests/e2e/test_daedalus_run.py sees the resumed form in a real run)."""
    from daedalus_trainer.local import grpo_summary

    assert grpo_summary({"steps": 48, "grpo_wall_seconds": 300.6, "grpo_resumed_from": None}) == \
        "GRPO steps: 48 in 301 s"
    assert grpo_summary({"steps": 48, "grpo_wall_seconds": 130.2, "grpo_resumed_from": 28}) == \
        "GRPO steps: 48, the last 20 in 130 s (resumed from step 28)"
    assert grpo_summary({"steps": 6, "grpo_wall_seconds": 12.0}) == "GRPO steps: 6 in 12 s"  # a report from before


def test_a_rerun_keeps_the_timings_of_a_readable_report_only(tmp_path, caplog):
    """A rerun of a finished run reports the timings of the call that trained, read back from ``report.json``; a
    report cut short by an interrupted in-place write is a warning naming it (this call's timings are reported),
    not a crash."""
    report = tmp_path / "report.json"
    assert _kept_timings(report, 6) is None  # no report yet
    whole = json.dumps({"steps": 6, "wall_seconds": 300.5, "grpo_wall_seconds": 120.0}, indent=2)
    report.write_text(whole)
    assert _kept_timings(report, 6) == (300.5, 120.0, None)  # a report from before grpo_resumed_from
    assert _kept_timings(report, 8) is None  # the report of a shorter run
    report.write_text(json.dumps({"steps": 6, "wall_seconds": 300.5, "grpo_wall_seconds": 90.0,
                                  "grpo_resumed_from": 2}))
    assert _kept_timings(report, 6) == (300.5, 90.0, 2)
    report.write_text(whole)
    report.write_text(whole[:20])
    with caplog.at_level(logging.WARNING, logger="daedalus.local"):
        assert _kept_timings(report, 6) is None
    assert [str(report) in r.getMessage() and "does not parse" in r.getMessage() for r in caplog.records] == [True]


def test_a_file_with_two_jobs_is_refused_by_the_commands_that_take_one(tmp_path, capsys):
    """`run`, `train`, `sft` and `eval` read one job: a second one (a document, or a `kind: List` item) is an error
    naming both, not silently ignored; other kinds of objects beside the job are still skipped."""
    first, second = tiny_job_dict(), tiny_job_dict()
    second["metadata"]["name"] = "other"
    two = _write(tmp_path, yaml.safe_dump_all([first, second]), "two.yaml")
    listed = _write(tmp_path, yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [first, second]}), "l.yaml")
    for path in (two, listed):
        with pytest.raises(c.SpecError) as info:
            c.load_job(path)
        assert info.value.errors == [("(file)", "holds 2 RLTrainingJobs ('e2e', 'other'); daedalus run, train, sft and "
                                                "eval take one: split the file (daedalus validate checks them all)")]
    runs = tmp_path / "runs"
    for argv in (["run", str(two), "--runs-dir", str(runs)], ["sft", str(two)], ["eval", str(two), "--model", "m"]):
        assert cli.main(argv) == 2
        assert "holds 2 RLTrainingJobs ('e2e', 'other')" in capsys.readouterr().err
    assert not runs.exists()
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "claim"}}
    with_pvc = _write(tmp_path, yaml.safe_dump_all([pvc, first]), "pvc.yaml")
    assert c.load_job(with_pvc).metadata.name == "e2e"


def test_every_command_requires_a_name(tmp_path, capsys):
    """No default name: a job without `metadata.name` is refused by `run` (before any directory is made) with the
    same error `validate` prints, so two unnamed jobs cannot share runs/<name>/ and their checkpoints."""
    nameless = tiny_job_dict()
    del nameless["metadata"]
    empty_meta = _write(tmp_path, _example_with("metadata:\n  name: local-tiny\n", "metadata:\n"), "n.yaml")
    no_meta = _write(tmp_path, yaml.safe_dump(nameless), "m.yaml")
    runs = tmp_path / "runs"
    for path, message in [(no_meta, "required: the API server rejects an object without a name"),
                          (empty_meta, "required (metadata is empty): the API server rejects an object without")]:
        with pytest.raises(c.SpecError) as info:
            c.load_job(path)
        assert info.value.errors == [("metadata.name", info.value.errors[0][1])]
        assert message in info.value.errors[0][1] and "leave it out" not in info.value.errors[0][1]
        assert cli.main(["run", str(path), "--runs-dir", str(runs)]) == 2
        assert f"metadata.name: {info.value.errors[0][1]}" in capsys.readouterr().err
        assert cli.main(["validate", str(path)]) == 1
        out = capsys.readouterr().out
        assert "1 error(s)" in out and f"metadata.name: {info.value.errors[0][1]}" in out
    assert not runs.exists()


@pytest.mark.parametrize("old,new,path,fragment", [
    ("apiVersion: daedalus.dev/v1alpha1\nkind: RLTrainingJob\n", "", "kind", 'kind not set'),
    ("  name: local-tiny\n", "  name: local-tiny\n  namespace: Bad_NS\n", "metadata.namespace", "got 'Bad_NS'"),
    ("  name: local-tiny\n", "  name: local-tiny\n  namespace: ../../escape\n", "metadata.namespace",
     "must be a lowercase DNS label"),
    ("  name: local-tiny\n", "  name: local-tiny\n  labels: {a: 1}\n", "metadata.labels",
     "the value of 'a' must be a string; got the number 1 (quote it)"),
    ("        cpu: \"2\"\n", "        cpu: \"-2\"\n", "spec.cluster.workerGroups[0].cpu", "greater than zero"),
    ("        memory: 8Gi\n", "        memory: \"0\"\n", "spec.cluster.workerGroups[0].memory", "greater than zero"),
    ("targetModules: [q_proj,", "targetModules: [q_projj,", "spec.lora.targetModules",
     "'q_projj' is not a language-model projection of Qwen3-VL (q_proj, k_proj, v_proj, o_proj, gate_proj"),
    ("  name: local-tiny\n", f"  name: {'a' * 64}\n", "metadata.name", f"(got '{'a' * 64}', 64 characters)"),
])
def test_validate_and_load_job_give_the_same_error(tmp_path, capsys, old, new, path, fragment):
    f = _write(tmp_path, _example_with(old, new))
    with pytest.raises(c.SpecError) as info:
        c.load_job(f)
    assert path in dict(info.value.errors) and fragment in dict(info.value.errors)[path], info.value.errors
    assert cli.main(["validate", str(f)]) == 1
    out = capsys.readouterr().out
    for p, m in info.value.errors:
        assert f"{p}: {m}" in out


def test_validate_names_the_documents_that_share_a_namespace_and_name(tmp_path, capsys):
    a, b, other_ns, c_ = tiny_job_dict(), tiny_job_dict(), tiny_job_dict(), tiny_job_dict()
    other_ns["metadata"]["namespace"] = "ml"  # same name, another namespace: two objects
    del c_["metadata"]["namespace"]  # no namespace: the current one, not taken for "default"
    f = _write(tmp_path, yaml.safe_dump_all([a, other_ns, b, c_]))
    assert cli.main(["validate", str(f)]) == 1
    out = capsys.readouterr().out
    assert "document 1 of 4): RLTrainingJob 'e2e' is valid" in out
    assert "document 2 of 4): RLTrainingJob 'e2e' is valid" in out
    assert ("document 3 of 4): 1 error(s)\n    metadata.name: 'e2e' (namespace 'default') is also the name of "
            "RLTrainingJob document 1 of 4 in this file: kubectl apply would make them one object; give each job its "
            "own name") in out
    assert "document 4 of 4): RLTrainingJob 'e2e' is valid" in out
    assert list(c.duplicate_name_errors([a, other_ns, b, c_])) == [2]


def test_a_damaged_model_or_adapter_directory_is_one_line_naming_it(tiny_checkpoint, tmp_path, capsys):
    """A model directory with config.json whose weights are truncated (a copy cut short) or missing, and an adapter
    directory whose weights are truncated or missing: `daedalus eval` says which directory and what to do, exit 2.
    Before, each was a safetensors/transformers traceback, and an adapter without weights made PEFT look its path
    up on the Hugging Face Hub as a repository name (a network call at run time)."""
    import shutil

    from daedalus_trainer.policy import load_pretrained

    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(tiny_job_dict()))
    truncated = shutil.copytree(tiny_checkpoint, tmp_path / "truncated")
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    no_weights = shutil.copytree(tiny_checkpoint, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    for model, reason in ((truncated, "Error while deserializing header"), (no_weights, "Error no file named")):
        assert cli.main(["eval", str(job_file), "--model", str(model), "--greedy-only", "--mazes", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: cannot load the model in {model}: {reason}") and "copy or save it again" in err
        assert "Traceback" not in err

    policy = load_pretrained(tiny_checkpoint, "float32", "cpu")
    policy.add_lora(make_tiny_job().spec.lora)
    adapter = policy.save_adapter(tmp_path / "adapter")
    bad_adapter = shutil.copytree(adapter, tmp_path / "truncated-adapter")
    with open(bad_adapter / "adapter_model.safetensors", "r+b") as f:
        f.truncate(100)
    assert cli.main(["eval", str(job_file), "--model", str(tiny_checkpoint), "--adapter", str(bad_adapter),
                     "--greedy-only", "--mazes", "1"]) == 2
    err = capsys.readouterr().err  # after transformers' "Loading weights" bar of the model
    assert err.splitlines()[-1].startswith(f"error: cannot load the adapter in {bad_adapter}: Error while deserial")
    assert "Traceback" not in err
    (bad_adapter / "adapter_model.safetensors").unlink()
    from daedalus_trainer.policy import ModelLoadError

    with pytest.raises(ModelLoadError, match="has adapter_config.json but no weights"):
        load_pretrained(tiny_checkpoint, "float32", "cpu").load_adapter(bad_adapter)
    with pytest.raises(ModelLoadError, match="has adapter_config.json but no weights"):
        policy.load_adapter(bad_adapter)  # replacing the weights of an attached adapter


def test_field_errors_say_the_cross_field_rules_were_not_checked(tmp_path, capsys):
    """The cross-field rules run only on a spec whose fields validate: with a field error, `validate` says they were
    not checked (as the API server does), then, the field fixed, reports the rule the spec also breaks; a spec whose
    only problem is a rule shows no such note. The errors themselves (the operator's condition) hold no note."""
    broken = _example_with("mazesPerStep: 8", "mazesPerStep: 8\n    miniBatches: 3").replace(
        "groupSize: 8", "groupSize: eight", 1)
    assert cli.main(["validate", str(_write(tmp_path, broken))]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "1 error(s)" in out and "spec.algorithm.groupSize: Input should be a valid integer" in out
    assert "(the cross-field rules (the CRD's x-kubernetes-validations) were not checked because of the errors " \
           "above; correct them to complete validation)" in out
    with pytest.raises(c.SpecError) as info:
        c.load_job(_write(tmp_path, broken))
    assert [p for p, _ in info.value.errors] == ["spec.algorithm.groupSize"] and info.value.note == \
        c.CROSS_FIELD_NOT_CHECKED and c.CROSS_FIELD_NOT_CHECKED in str(info.value)
    rule_only = _example_with("mazesPerStep: 8", "mazesPerStep: 8\n    miniBatches: 3")
    assert cli.main(["validate", str(_write(tmp_path, rule_only))]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "spec.algorithm.miniBatches: algorithm.miniBatches must divide algorithm.mazesPerStep" in out
    assert "not checked" not in out
    with pytest.raises(c.SpecError) as info:
        c.load_job(_write(tmp_path, rule_only))
    assert info.value.note is None


@pytest.mark.parametrize("warnings,omp,threads,verbosity", [(True, None, 1, "WARNING"), (False, "2", 2, "ERROR"),
                                                            (False, "", 1, "ERROR"), (True, "3,1", 3, "WARNING")])
def test_quiet_single_threaded_torch(warnings, omp, threads, verbosity):
    """The set-up `daedalus sft`, `eval` and `run` share (in a fresh interpreter: it changes process-wide state):
    one torch thread unless OMP_NUM_THREADS says otherwise, no transformers or Hub progress bars, and for `run` only
    transformers' errors. An empty OMP_NUM_THREADS is one thread, OpenMP's nested `3,1` its first level (both were a
    ValueError traceback; `daedalus run` had ignored the variable)."""
    import subprocess
    import sys

    code = (f"from daedalus_trainer.usage import quiet_single_threaded_torch as q; q(warnings={warnings})\n"
            "import os, torch, transformers.utils.logging as t\n"
            "print(torch.get_num_threads(), t.is_progress_bar_enabled(), t.get_verbosity(), "
            "os.environ['HF_HUB_DISABLE_PROGRESS_BARS'])")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "HF_HUB_DISABLE_PROGRESS_BARS")}
    if omp:
        env["OMP_NUM_THREADS"] = omp
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(threads), "False", str(getattr(logging, verbosity)), "1"]
    if omp == "":  # what child processes (Ray workers) inherit
        code += "\nprint(os.environ['OMP_NUM_THREADS'])\n"
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        assert out.split()[-1] == "1"


def test_daedalus_run_progress_starts_at_the_resumed_step():
    """_Progress.resumed: the bar starts at the checkpoint's step and counts on from there; a finished run's rerun
    (nothing left to train) is a finished bar, 48/48 with 0:00:00 left, not -:--:-- (rich's reset leaves a task
    unfinished even at its total)."""
    from rich.console import Console

    from daedalus_trainer.local import _Progress

    def last_line(steps: list[int], resumed: int) -> str:
        console = Console(file=io.StringIO(), force_terminal=True, width=100, color_system=None)
        progress = _Progress(console, 48)
        with progress:
            progress.resumed(resumed)
            for step in steps:
                progress.update({"step": step, "rollout_seconds": 1.0, "learner_seconds": 1.0, "reward_mean": 0.5,
                                 "success_ratio": 0.5, "episode_turns": 3.0, "rollout_tokens": 100})
        return [line for line in console.file.getvalue().splitlines() if "GRPO" in line][-1]  # the last drawing

    finished = last_line([], 48)
    assert "48/48" in finished and "0:00:00" in finished and "-:--:--" not in finished, finished
    assert "46/48" in last_line([45, 46], 44)


def test_eval_takes_away_the_output_directories_it_made_when_the_model_does_not_load(tmp_path, capsys):
    """--gif and --json directories are made before the evaluation (a bad path fails in a second); when the model
    then does not load, the ones this command made are removed again, and a directory that was there stays."""
    there = tmp_path / "there"
    there.mkdir()
    argv = ["eval", EXAMPLE, "--model", str(tmp_path / "no-such-model"), "--gif", str(tmp_path / "a" / "b" / "gifs"),
            "--json", str(there / "new" / "report.json")]
    assert cli.main(argv) == 2
    assert "no-such-model does not exist" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there"] and list(there.iterdir()) == []



@pytest.mark.parametrize("argv,example", [
    (["run", "--help"], "daedalus run -"), (["train", "--help"], "daedalus train --config -"),
    (["sft", "--help"], "daedalus sft -"), (["eval", "--help"], "daedalus eval - --model DIR"),
])
def test_the_commands_that_read_a_job_say_that_dash_reads_standard_input(argv, example, capsys):
    """`run`, `train`, `sft` and `eval` read their job with load_job, which takes ``-`` for standard input; their
    --help says so, with an example (before, only `validate -` was documented)."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help at the terminal's width
    assert info.value.code == 0
    assert f"- reads the job from standard input (kubectl get rltj NAME -o yaml | {example})" in help_text


def test_eval_and_sft_read_the_job_from_standard_input(tiny_checkpoint, tmp_path):
    """`daedalus eval -` evaluates the job piped in (its name, not a file's, is in the report), in its own process
    with a real standard input; `daedalus sft -` given an invalid job there names <stdin> and the field, exit 2,
    before anything is created."""
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200", TERM="dumb")
    job = tiny_job_dict(environment={"evalMazes": 2, "maxTurns": 2})
    job["metadata"]["name"] = "from-stdin"
    report = tmp_path / "eval.json"
    done = subprocess.run([sys.executable, "-m", "daedalus_trainer", "eval", "-", "--model", str(tiny_checkpoint),
                           "--greedy-only", "--mazes", "1", "--json", str(report)], input=yaml.safe_dump(job),
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    ev = json.loads(report.read_text())
    assert ev["job"] == "from-stdin" and ev["mazes"] == 1 and [r["mode"] for r in ev["results"]] == ["greedy"]
    job["spec"]["environment"]["size"] = 10
    bad = subprocess.run([sys.executable, "-m", "daedalus_trainer", "sft", "-"], input=yaml.safe_dump(job),
                         capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.startswith("error: <stdin>") and "spec.environment.size" in bad.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]  # no runs/from-stdin/sft


def test_a_cut_short_start_or_base_model_is_one_line_before_ray_or_any_output(tmp_path, capsys, monkeypatch):
    """model.sftAdapter (a PEFT adapter or a full model) or the base model.path whose safetensors file was cut short
    or is a Git LFS pointer: `train` says so in one `error:` line and exits 2 before Ray starts (before, a Ray actor
    died 14 s later with a 60-line traceback and exit 1), as do `run` and `sft`, none creating its output directory."""
    import ray
    import safetensors.torch
    import torch

    monkeypatch.setenv("DAEDALUS_METRICS_PORT", "0")
    ray_before = ray.is_initialized()
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 16}')
    weights = adapter / "adapter_model.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(64, 16)}, str(weights))
    good = tmp_path / "good-adapter"
    good.mkdir()
    (good / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 16}')
    (good / "adapter_model.safetensors").write_bytes(weights.read_bytes())
    weights.write_bytes(weights.read_bytes()[:-100])  # a copy cut short
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model-00001-of-00002.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 4000000000\n")  # an LFS pointer
    gpus = {"workerGroups": [{"name": "gpu", "replicas": 1, "gpusPerWorker": 1, "cpu": "4", "memory": "32Gi"}]}
    cases = [({"sftAdapter": str(adapter)}, f"error: cannot load the adapter in {adapter}: adapter_model.safetensors: "),
             ({"sftAdapter": str(model)}, f"error: cannot load the model in {model}: model-00001-of-00002.safetensors: "),
             ({"tiny": False, "path": str(model), "sftAdapter": str(good)}, f"error: cannot load the model in {model}: ")]
    for fields, said in cases:
        job = tiny_job_dict(model=fields, cluster={} if fields.get("tiny", True) else gpus)
        job_file = tmp_path / "job.yaml"
        job_file.write_text(yaml.safe_dump(job))
        for argv in (["train", "--config", str(job_file), "--out", str(tmp_path / "train")],
                     ["run", str(job_file), "--runs-dir", str(tmp_path / "runs")],
                     ["sft", str(job_file), "--out", str(tmp_path / "sft")]):
            assert cli.main(argv) == 2, argv
            err = capsys.readouterr().err
            assert len(err.splitlines()) == 1 and err.startswith(said), (argv, err)
            assert "copy or save it again" in err
    assert not {"train", "runs", "sft"} & {p.name for p in tmp_path.iterdir()}
    assert ray.is_initialized() == ray_before


def test_check_model_paths_finds_missing_shards_no_weights_and_non_torch_bin_files(tmp_path):
    """The model-directory checks beyond safetensors headers: a sharded checkpoint whose index names a shard that is
    not there, a directory with config.json and no weights at all, a .bin that is not a torch.save file (a Git LFS
    pointer); a good .bin (zip) and a complete sharded checkpoint pass."""
    import types

    import safetensors.torch
    import torch

    from daedalus_trainer.policy import ModelLoadError, check_model_paths

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = types.SimpleNamespace(sft_adapter=str(model), path=None, tiny=False)
    with pytest.raises(ModelLoadError, match=r"it has no weight files \(\*\.safetensors or \*\.bin\)"):
        check_model_paths(spec)
    safetensors.torch.save_file({"a": torch.zeros(2)}, str(model / "model-00001-of-00002.safetensors"))
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelLoadError, match="model.safetensors.index.json names shards that are not there: "
                                             "model-00002-of-00002.safetensors"):
        check_model_paths(spec)
    safetensors.torch.save_file({"b": torch.zeros(2)}, str(model / "model-00002-of-00002.safetensors"))
    check_model_paths(spec)  # complete
    torch.save({"w": torch.zeros(2)}, model / "extra.bin")
    check_model_paths(spec)  # a zip written by torch.save
    (model / "pytorch_model.bin").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n")
    with pytest.raises(ModelLoadError, match=r"pytorch_model.bin is not a torch.save file \(it starts with b'vers'\)"):
        check_model_paths(spec)


def test_run_refuses_a_chosen_port_that_is_taken_before_any_work(tmp_path, capsys, monkeypatch):
    """`daedalus run --port N` (or $DAEDALUS_METRICS_PORT=N) with N taken: one `error:` line, exit 2, nothing
    created (before, the run went on and, minutes later at GRPO, quietly served on another port)."""
    import socket

    monkeypatch.delenv("DAEDALUS_METRICS_PORT", raising=False)
    runs = tmp_path / "runs"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert cli.main(["run", EXAMPLE, "--runs-dir", str(runs), "--port", str(port)]) == 2
        assert capsys.readouterr().err == f"error: cannot serve on 127.0.0.1:{port} (Address already in use); set " \
            "--port (or DAEDALUS_METRICS_PORT) to a free port\n"
        monkeypatch.setenv("DAEDALUS_METRICS_PORT", str(port))
        assert cli.main(["run", EXAMPLE, "--runs-dir", str(runs)]) == 2
        assert "Address already in use" in capsys.readouterr().err
    assert not runs.exists()
