"""`daedalus run JOB.yaml`, the main job, as a user runs it: its own process, its own local Ray, a tiny job.

The job starts from the session's short-SFT checkpoint (``model.sftAdapter``), so the SFT stage is skipped; the
rest is the real pipeline: evaluation before (held-out and training layouts), GRPO with checkpoints, evaluation
after, the table, ``report.json`` (keys fixed by the GRPO issue) and ``curves.png``. Running it again resumes from
the last checkpoint instead of training again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from support.jobs import tiny_job_dict

pytestmark = pytest.mark.slow

ISSUE_KEYS = {"success_before", "success_after", "ci95_before", "ci95_after", "steps", "wall_seconds"}


def _run(job_file, runs_dir) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200", TERM="dumb")
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, "-m", "daedalus_trainer", "run", str(job_file), "--runs-dir", str(runs_dir), "--port", "0"],
        capture_output=True, text=True, timeout=900, env=env,
    )


def test_daedalus_run_reports_and_resumes(sft_start, tmp_path):
    job = tiny_job_dict(model={"sftAdapter": str(sft_start)}, environment={"evalMazes": 8, "evalCorners": 2},
                        algorithm={"steps": 2, "mazesPerStep": 2, "groupSize": 2}, checkpoint={"intervalSteps": 1})
    job["metadata"]["name"] = "run-e2e"
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    runs = tmp_path / "runs"

    first = _run(job_file, runs)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run_dir = runs / "run-e2e"
    report = json.loads((run_dir / "report.json").read_text())
    assert ISSUE_KEYS <= report.keys()
    assert report["steps"] == 2 and report["eval_mazes"] == 8
    assert report["eval_corners"] == 2 and report["eval_episodes"] == 16  # 8 held-out layouts x 2 corner pairs
    g_before, g_after = report["before"]["results"][0], report["after"]["results"][0]
    assert len(g_before["outcomes"]) == len(g_after["outcomes"]) == 16
    gain = report["gain"]
    assert gain["episodes"] == 16 and gain["corners"] == 2
    assert gain["gain"] == pytest.approx(report["success_after"] - report["success_before"])
    assert gain["fixed"] == sum(a > b for a, b in zip(g_after["outcomes"], g_before["outcomes"]))
    assert gain["broken"] == sum(a < b for a, b in zip(g_after["outcomes"], g_before["outcomes"]))
    assert gain["ci_low"] <= gain["gain"] <= gain["ci_high"]
    assert report["wall_seconds"] >= report["grpo_wall_seconds"] > 0
    for when in ("before", "after"):
        rate, (low, high) = report[f"success_{when}"], report[f"ci95_{when}"]
        assert 0.0 <= low <= rate <= high <= 1.0 and high - low > 0.1  # 8 layouts: a wide interval
        assert report[when]["split"] == "held-out" and report[f"{when}_training"]["split"] == "training"
        assert report[f"{when}_training"]["mazes"] == 8 and report[f"{when}_training"]["corners"] == 1
        assert report[f"training_success_{when}"] == report[f"{when}_training"]["results"][0]["success_rate"]
    assert report["success_before"] == json.loads((run_dir / "eval-before.json").read_text())["results"][0][
        "success_rate"]
    assert (run_dir / "exports" / "adapter" / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-")) == [
        "step-000001", "step-000002"]
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = first.stdout
    assert "SFT start" in out and "after GRPO" in out and "greedy, training layouts" in out
    assert f"{report['success_before']:.1%}" in out and f"{report['success_after']:.1%}" in out
    assert "GRPO steps: 2 in" in out and report["grpo_resumed_from"] is None
    assert "GRPO step 1/2: reward" in out and "GRPO step 2/2: reward" in out  # progress lines in a log
    assert "(Ctrl-C: stop after this step, checkpointed; run again to resume)" in out
    assert "last column: greedy, 8 training-layout mazes, 1 corner pair each" in out
    assert "8 layouts x 2 start/goal corner pairs" in out and "held-out greedy gain:" in out
    assert f"{gain['fixed']} episodes fixed, {gain['broken']} broken" in out

    again = _run(job_file, runs)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resumed from the checkpoint at step 2" in again.stdout
    # the run's last step is checkpointed and daedalus run evaluates by itself: no Ray, no actors for zero steps
    assert "Started a local Ray instance" in first.stdout + first.stderr
    assert "Started a local Ray instance" not in again.stdout + again.stderr
    # the bar starts at the checkpoint's step (it drew 0/2 until the end), said once, before the outcome
    assert again.stdout.count("resumed from the checkpoint at step 2") == 1
    assert again.stdout.index("resumed from the checkpoint") < again.stdout.index("nothing left to train")
    assert re.search(r"GRPO \S+ 2/2", again.stdout) and not re.search(r"GRPO \S+ 0/2", again.stdout)
    # the same start: the cached evaluation is used, not run again (the start's fingerprint matches)
    assert "Evaluation of the starting point" in first.stdout and "Evaluation of the starting point" not in again.stdout
    second = json.loads((run_dir / "report.json").read_text())
    assert second["steps"] == 2 and second["success_before"] == report["success_before"]
    assert second["grpo_resumed_from"] is None  # the timings kept are those of the call that trained from step 0
    # nothing left to train: the trained adapter's evaluation is reused too, and the report keeps the timings of the
    # run that trained
    assert "Evaluation after GRPO" in first.stdout and "Evaluation after GRPO" not in again.stdout
    assert "nothing left to train" in again.stdout
    assert (second["wall_seconds"], second["grpo_wall_seconds"]) == (report["wall_seconds"],
                                                                     report["grpo_wall_seconds"])
    # the same adapter evaluated on the same mazes greedily: the same figure
    assert second["success_after"] == report["success_after"]
    assert second["training_success_after"] == report["training_success_after"]

    # a GRPO setting changed with its checkpoints on disk: refused before the evaluation of the start (it had run for
    # minutes, rewriting eval-before.json for the new settings, then GRPO refused the checkpoint)
    before_file = (run_dir / "eval-before.json").read_bytes()
    job["spec"]["algorithm"]["temperature"] = 0.7
    job_file.write_text(yaml.safe_dump(job))
    changed = _run(job_file, runs)
    assert changed.returncode == 2, changed.stdout[-3000:] + changed.stderr[-3000:]
    assert "other settings (algorithm.temperature: 0.5 there, 0.7 in this job)" in changed.stderr
    assert "Evaluation of the starting point" not in changed.stdout and "GRPO" not in changed.stdout
    assert (run_dir / "eval-before.json").read_bytes() == before_file


def _interrupted(job_file, runs, signum: int, after: str) -> tuple[int, str]:
    """`daedalus run` in its own process group, sent ``signum`` once a line containing ``after`` is printed: SIGINT
    as Ctrl-C in a terminal sends it (to the whole foreground group), SIGTERM as kill, timeout or a container stop do
    (to the process). Returns ``(exit code, output)``."""
    import threading

    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200", TERM="dumb", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "daedalus_trainer", "run", str(job_file), "--runs-dir", str(runs), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if after in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 600
        while not seen.wait(1):  # a run that exits first (a refused checkpoint) fails at once, not after 10 min
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        code = proc.wait(300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(10)
    return code, "".join(lines)


def test_ctrl_c_then_sigterm_during_grpo_checkpoint_the_step_and_each_rerun_resumes_there(sft_start, tmp_path):
    """Ctrl-C during GRPO, then SIGTERM during the rerun: each time the step in progress ends, its checkpoint is
    written although no periodic one is due (intervalSteps 100), the command exits 130 / 143 saying so, and the same
    command resumes from that step; the third run finishes. Before, an interrupt lost every step since the last
    periodic checkpoint (here: all of them). One job for both signals: each `daedalus run` costs a Ray start, its
    actors and an evaluation."""
    job = tiny_job_dict(model={"sftAdapter": str(sft_start)}, environment={"evalMazes": 4},
                        algorithm={"steps": 8, "mazesPerStep": 2, "groupSize": 2, "rolloutWorkers": 1},
                        checkpoint={"intervalSteps": 100})
    job["metadata"]["name"] = "ctrl-c"
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    runs = tmp_path / "runs"
    checkpoints = runs / "ctrl-c" / "checkpoints"

    code, out = _interrupted(job_file, runs, signal.SIGINT, "GRPO step 1/8")
    assert code == 130, out[-3000:]
    m = re.search(r"interrupted \(Ctrl-C\): checkpoint at step (\d+); run the same command again to resume", out)
    assert m, out[-3000:]
    first_stop = int(m.group(1))
    assert 1 <= first_stop < 7, out[-3000:]
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-")) == [f"step-{first_stop:06d}"]
    assert not (runs / "ctrl-c" / "exports").exists()

    code, out = _interrupted(job_file, runs, signal.SIGTERM, f"GRPO step {first_stop + 1}/8")
    assert code == 143, out[-3000:]
    assert f"resumed from the checkpoint at step {first_stop}" in out
    m = re.search(r"stopped \(SIGTERM\): checkpoint at step (\d+); run the same command again to resume", out)
    assert m, out[-3000:]
    stopped_at = int(m.group(1))
    assert first_stop < stopped_at < 8, out[-3000:]
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-")) == [
        f"step-{first_stop:06d}", f"step-{stopped_at:06d}"]
    assert not (runs / "ctrl-c" / "exports").exists()

    again = _run(job_file, runs)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resumed from the checkpoint at step {stopped_at}" in again.stdout
    report = json.loads((runs / "ctrl-c" / "report.json").read_text())
    assert report["steps"] == 8 and report["grpo_resumed_from"] == stopped_at
    assert f"GRPO steps: 8, the last {8 - stopped_at} in " in again.stdout  # not "8 in" the rerun's seconds
    assert f"(resumed from step {stopped_at})" in again.stdout
    assert (runs / "ctrl-c" / "exports" / "adapter" / "adapter_model.safetensors").is_file()
