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


def test_ctrl_c_then_sigterm_then_a_finished_run_reports_and_a_rerun_resumes(sft_start, tmp_path):
    """The main job through every way a user ends it, on one job (each `daedalus run` costs a Ray start, its actors
    and an evaluation):

    1. Ctrl-C during GRPO, then SIGTERM during the rerun: each time the step in progress ends, its checkpoint is
       written although no periodic one is due (intervalSteps 100), the command exits 130 / 143 saying so, and the
       same command resumes from that step. Before, an interrupt lost every step since the last periodic checkpoint.
    2. The third run finishes: the table, ``report.json`` (the issue's keys), ``curves.png``, the exported adapter.
    3. A fourth run of the finished job resumes at its last step: no Ray, no actor, the cached evaluations reused.
    4. A GRPO setting changed with the checkpoints on disk: refused before the evaluation of the start.
    """
    job = tiny_job_dict(model={"sftAdapter": str(sft_start)}, environment={"evalMazes": 8, "evalCorners": 2},
                        algorithm={"steps": 8, "mazesPerStep": 2, "groupSize": 2},  # automatic rollout workers
                        checkpoint={"intervalSteps": 100})
    job["metadata"]["name"] = "run-e2e"
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    runs = tmp_path / "runs"
    run_dir = runs / "run-e2e"
    checkpoints = run_dir / "checkpoints"

    # 1. Ctrl-C, then SIGTERM
    code, first = _interrupted(job_file, runs, signal.SIGINT, "GRPO step 1/8")
    assert code == 130, first[-3000:]
    m = re.search(r"interrupted \(Ctrl-C\): checkpoint at step (\d+); run the same command again to resume", first)
    assert m, first[-3000:]
    first_stop = int(m.group(1))
    assert 1 <= first_stop < 7, first[-3000:]
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-")) == [f"step-{first_stop:06d}"]
    assert not (run_dir / "exports").exists() and not (run_dir / "report.json").exists()
    assert "Started a local Ray instance" in first and "Evaluation of the starting point" in first
    assert "GRPO step 1/8: reward" in first  # progress lines in a log
    assert "(Ctrl-C: stop after this step, checkpointed; run again to resume)" in first

    code, out = _interrupted(job_file, runs, signal.SIGTERM, f"GRPO step {first_stop + 1}/8")
    assert code == 143, out[-3000:]
    assert f"resumed from the checkpoint at step {first_stop}" in out
    assert "Evaluation of the starting point" not in out  # the same start: its cached evaluation is used
    m = re.search(r"stopped \(SIGTERM\): checkpoint at step (\d+); run the same command again to resume", out)
    assert m, out[-3000:]
    stopped_at = int(m.group(1))
    assert first_stop < stopped_at < 8, out[-3000:]
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-")) == [
        f"step-{first_stop:06d}", f"step-{stopped_at:06d}"]
    assert not (run_dir / "exports").exists()

    # 2. the run that finishes, and its report
    done = _run(job_file, runs)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert f"resumed from the checkpoint at step {stopped_at}" in out
    report = json.loads((run_dir / "report.json").read_text())
    assert ISSUE_KEYS <= report.keys()
    assert report["steps"] == 8 and report["grpo_resumed_from"] == stopped_at and report["eval_mazes"] == 8
    assert f"GRPO steps: 8, the last {8 - stopped_at} in " in out  # not "8 in" the rerun's seconds
    assert f"(resumed from step {stopped_at})" in out
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
    # the interval (100) is never reached: the two stops' checkpoints and the last step's
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-")) == [
        f"step-{first_stop:06d}", f"step-{stopped_at:06d}", "step-000008"]
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "SFT start" in out and "after GRPO" in out and "greedy, training layouts" in out
    assert f"{report['success_before']:.1%}" in out and f"{report['success_after']:.1%}" in out
    assert "last column: greedy, 8 training-layout mazes, 1 corner pair each" in out
    assert "8 layouts x 2 start/goal corner pairs" in out and "held-out greedy gain:" in out
    assert f"{gain['fixed']} episodes fixed, {gain['broken']} broken" in out
    assert "Evaluation after GRPO" in out and "Started a local Ray instance" in out + done.stderr

    # 3. the finished job again: resumed at its last step, nothing trained, nothing evaluated again
    again = _run(job_file, runs)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    # the run's last step is checkpointed and daedalus run evaluates by itself: no Ray, no actors for zero steps
    assert "Started a local Ray instance" not in again.stdout + again.stderr
    # the bar starts at the checkpoint's step (it drew 0/8 until the end), said once, before the outcome
    assert again.stdout.count("resumed from the checkpoint at step 8") == 1
    assert again.stdout.index("resumed from the checkpoint") < again.stdout.index("nothing left to train")
    assert re.search(r"GRPO \S+ 8/8", again.stdout) and not re.search(r"GRPO \S+ 0/8", again.stdout)
    assert "Evaluation of the starting point" not in again.stdout and "Evaluation after GRPO" not in again.stdout
    second = json.loads((run_dir / "report.json").read_text())
    assert second["steps"] == 8 and second["success_before"] == report["success_before"]
    # the report keeps the timings of the call that trained
    assert second["grpo_resumed_from"] == stopped_at
    assert (second["wall_seconds"], second["grpo_wall_seconds"]) == (report["wall_seconds"],
                                                                     report["grpo_wall_seconds"])
    # the same adapter evaluated on the same mazes greedily: the same figure
    assert second["success_after"] == report["success_after"]
    assert second["training_success_after"] == report["training_success_after"]

    # 4. a GRPO setting changed with its checkpoints on disk: refused before the evaluation of the start (it had run
    # for minutes, rewriting eval-before.json for the new settings, then GRPO refused the checkpoint)
    before_file = (run_dir / "eval-before.json").read_bytes()
    job["spec"]["algorithm"]["temperature"] = 0.7
    job_file.write_text(yaml.safe_dump(job))
    changed = _run(job_file, runs)
    assert changed.returncode == 2, changed.stdout[-3000:] + changed.stderr[-3000:]
    assert "other settings (algorithm.temperature: 0.5 there, 0.7 in this job)" in changed.stderr
    assert "Evaluation of the starting point" not in changed.stdout and "GRPO" not in changed.stdout
    assert (run_dir / "eval-before.json").read_bytes() == before_file
