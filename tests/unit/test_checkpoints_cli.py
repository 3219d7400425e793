"""`daedalus checkpoints`: the listing of a checkpoint root (what each directory is, whether it verifies, where a
resume starts) and the deletion of abandoned timelines, on real checkpoints written by CheckpointManager."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from daedalus_trainer.checkpoint import (
    CheckpointError,
    CheckpointManager,
    delete_abandoned,
    inspect_root,
    load_latest,
    resolve_resume,
)
from daedalus_trainer.cli import main
from test_checkpoint import make_state, save_steps


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture()
def root_with_a_past(tmp_path: Path) -> Path:
    """steps 1-3 saved, resumed from step 1 and saved step 2 again: step-000001, step-000002 and two abandoned
    directories (the old 2 and 3), then a leftover of a killed save."""
    root = tmp_path / "run" / "checkpoints"
    manager = CheckpointManager(root, keep=5)
    save_steps(manager, [1, 2, 3])
    resolve_resume(str(root / "step-000001"), root)
    manager.save(2, *make_state(2))
    (root / ".tmp-step-000003-deadbeef").mkdir()
    (root / ".tmp-step-000003-deadbeef" / "optimizer.pt").write_bytes(b"x" * 10)
    return root


def test_inspect_root_names_every_directory_and_where_a_resume_starts(root_with_a_past: Path) -> None:
    entries = inspect_root(root_with_a_past)
    assert [(e.kind, e.step) for e in entries] == [
        ("checkpoint", 1), ("checkpoint", 2), ("abandoned", 2), ("abandoned", 3), ("leftover", None)]
    assert [e.name for e in entries if e.latest] == ["step-000002"]
    assert [e.name for e in entries if e.chosen] == ["step-000002"]
    assert all(e.problems == () for e in entries[:4])
    assert entries[4].problems is None and entries[4].bytes == 10
    on_disk = sum(p.stat().st_size for p in (root_with_a_past / "step-000001").rglob("*") if p.is_file())
    assert entries[0].bytes == on_disk > 0
    assert entries[0].time is not None and entries[4].time is None
    # nothing was changed by reading: the leftover and the pointer stay
    assert (root_with_a_past / ".tmp-step-000003-deadbeef").is_dir()
    assert (root_with_a_past / "latest").read_text().strip() == "step-000002"


def test_a_corrupt_newest_is_reported_and_the_resume_point_is_the_one_load_latest_takes(
        root_with_a_past: Path) -> None:
    flip_a_byte(root_with_a_past / "step-000002" / "optimizer.pt")
    entries = {e.name: e for e in inspect_root(root_with_a_past)}
    assert [(p.file, p.reason) for p in entries["step-000002"].problems] == [("optimizer.pt", "sha256 mismatch")]
    assert entries["step-000002"].latest and not entries["step-000002"].chosen
    assert entries["step-000001"].chosen
    assert load_latest(root_with_a_past).step == 1  # the same choice


def test_without_verification_nothing_is_chosen(root_with_a_past: Path) -> None:
    entries = inspect_root(root_with_a_past, verify=False)
    assert all(e.problems is None and not e.chosen for e in entries)


def test_a_checkpoint_a_killed_resave_left_aside_is_where_a_resume_starts(root_with_a_past: Path) -> None:
    """A kill between a re-save's two renames leaves step-000002 only as .trash-step-000002-<id>; the next resume
    puts it back (CheckpointManager.resume) and starts there: the listing says so, not "leftover"."""
    (root_with_a_past / "step-000002").rename(root_with_a_past / ".trash-step-000002-deadbeef")
    entries = {e.name: e for e in inspect_root(root_with_a_past)}
    replaced = entries[".trash-step-000002-deadbeef"]
    assert (replaced.kind, replaced.step, replaced.problems, replaced.chosen) == ("replaced", 2, (), True)
    assert not entries["step-000001"].chosen
    assert CheckpointManager(root_with_a_past).resume("latest").step == 2  # the same choice


def test_a_state_without_an_integer_step_is_not_chosen_as_load_latest_rejects_it(root_with_a_past: Path) -> None:
    ckpt = root_with_a_past / "step-000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["step"] = "two"
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    manifest = json.loads((ckpt / "MANIFEST.json").read_text())  # re-hashed: only the content is wrong
    import hashlib

    for f in manifest["files"]:
        if f["path"] == "trainer_state.json":
            data = (ckpt / "trainer_state.json").read_bytes()
            f["bytes"], f["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (ckpt / "MANIFEST.json").write_text(json.dumps(manifest))
    entries = {e.name: e for e in inspect_root(root_with_a_past)}
    assert entries["step-000002"].problems and not entries["step-000002"].chosen
    assert entries["step-000001"].chosen and load_latest(root_with_a_past).step == 1


def test_delete_abandoned_removes_only_abandoned_timelines(root_with_a_past: Path) -> None:
    before = {e.name: e.bytes for e in inspect_root(root_with_a_past, verify=False)}
    deleted, failed = delete_abandoned(root_with_a_past)
    assert failed == []
    assert sorted(e.step for e in deleted) == [2, 3]
    assert sum(e.bytes for e in deleted) == sum(b for n, b in before.items() if n.startswith("abandoned-"))
    names = sorted(p.name for p in root_with_a_past.iterdir())
    assert names == [".tmp-step-000003-deadbeef", "latest", "step-000001", "step-000002"]
    assert load_latest(root_with_a_past).step == 2


def test_a_missing_root_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        inspect_root(tmp_path / "nowhere")


@pytest.fixture()
def wide(monkeypatch) -> None:
    """A 200-column console, so that no table cell wraps inside the phrases asserted."""
    monkeypatch.setenv("COLUMNS", "200")


def test_cli_table_and_exit_status(root_with_a_past: Path, capsys, wide) -> None:
    assert main(["checkpoints", str(root_with_a_past.parent)]) == 0  # the run directory holding checkpoints/
    out = capsys.readouterr().out
    assert "2 checkpoints (" in out and "2 abandoned timelines (" in out
    assert "1 leftover (10 B)" in out
    assert "resume: latest starts from step-000002 (step 2)" in out
    assert "--delete-abandoned deletes them" in out
    assert main(["checkpoints", str(root_with_a_past / "step-000001")]) == 0  # one checkpoint: its root is listed
    assert capsys.readouterr().out == out
    assert out.count("<- latest, resume") == 1 and "ok <- latest, resume" in out


def test_cli_json_and_delete(root_with_a_past: Path, capsys) -> None:
    assert main(["checkpoints", str(root_with_a_past), "--json", "--delete-abandoned"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["resumeFrom"] == "step-000002"
    assert [e["name"] for e in doc["entries"]] == ["step-000001", "step-000002", ".tmp-step-000003-deadbeef"]
    assert [e["problems"] for e in doc["entries"]] == [[], [], None]
    assert len(doc["deleted"]) == 2 and all(d["bytes"] > 0 for d in doc["deleted"])
    assert not any(p.name.startswith("abandoned-") for p in root_with_a_past.iterdir())


def test_cli_exit_1_when_no_checkpoint_verifies(root_with_a_past: Path, capsys, wide) -> None:
    for step in (1, 2):
        flip_a_byte(root_with_a_past / f"step-00000{step}" / "adapter" / "adapter_model.safetensors")
    assert main(["checkpoints", str(root_with_a_past)]) == 1
    out = capsys.readouterr().out
    assert "resume: latest refuses to start: no checkpoint verifies" in out
    assert out.count("corrupt: adapter/adapter_model.safetensors: sha256 mismatch") == 2
    assert "<- resume" not in out
    with pytest.raises(CheckpointError, match=f"`daedalus checkpoints {root_with_a_past}` lists each one"):
        load_latest(root_with_a_past)  # a resume's refusal points at the listing


def test_cli_given_a_damaged_checkpoint_lists_its_root(root_with_a_past: Path, capsys, wide) -> None:
    """status.latestCheckpoint.path of a checkpoint without its manifest: the root is listed (it read as an empty
    root: "0 checkpoints, resume: latest starts fresh", exit 0)."""
    (root_with_a_past / "step-000002" / "MANIFEST.json").unlink()
    assert main(["checkpoints", str(root_with_a_past / "step-000002")]) == 0
    out = capsys.readouterr().out
    assert "2 checkpoints (" in out and "corrupt: MANIFEST.json: missing" in out
    assert "resume: latest starts from step-000001 (step 1)" in out


def test_cli_json_exit_status_matches_the_table(root_with_a_past: Path, capsys) -> None:
    for step in (1, 2):
        flip_a_byte(root_with_a_past / f"step-00000{step}" / "optimizer.pt")
    assert main(["checkpoints", str(root_with_a_past), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["resumeFrom"] is None


def test_cli_bad_paths_are_one_line_errors(tmp_path: Path, capsys) -> None:
    assert main(["checkpoints", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'nowhere'}: no such directory")
    (tmp_path / "f").write_text("x")  # a file is read as a job YAML: this one is not
    assert main(["checkpoints", str(tmp_path / "f")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'f'}")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["checkpoints", str(empty)]) == 0
    assert "0 checkpoints (0 B)" in capsys.readouterr().out


def test_cli_given_the_job_yaml_lists_that_run_s_checkpoints(root_with_a_past: Path, tmp_path: Path, capsys,
                                                              wide) -> None:
    """`daedalus checkpoints job.yaml [--runs-dir D]`: the checkpoints `daedalus run job.yaml --runs-dir D` keeps,
    D/<metadata.name>/checkpoints."""
    import yaml
    from support.jobs import tiny_job_dict

    job = tiny_job_dict()
    job["metadata"]["name"] = "run"  # root_with_a_past is <tmp>/run/checkpoints
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    assert main(["checkpoints", str(job_file), "--runs-dir", str(root_with_a_past.parent.parent)]) == 0
    out = capsys.readouterr().out
    assert f"checkpoints under {root_with_a_past}" in out and "resume: latest starts from step-000002" in out
    assert main(["checkpoints", str(job_file), "--runs-dir", str(tmp_path / "elsewhere")]) == 0  # not run there
    assert capsys.readouterr().out == (f"{tmp_path / 'elsewhere' / 'run' / 'checkpoints'}: no checkpoints yet\n"
                                       "resume: latest starts fresh (no step-* checkpoint)\n")
