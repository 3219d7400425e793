"""`daedalus train` as the Ray job runs it: a real process, a real local Ray, the metrics and control endpoint.

Scrapes /metrics while training and checks every metric of the table is exported and the training ones move;
`POST /checkpoint` is 401 without (or with a wrong) token and, with it, returns a checkpoint written at the next
step boundary; SIGTERM ends the step in progress with a checkpoint. One trainer process does all of it: starting one
(a local Ray, the learner and rollout actors) costs more than its steps.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from ray_head import free_port
from support.jobs import tiny_job_dict

from daedalus_trainer.metrics import METRICS

pytestmark = pytest.mark.slow
TOKEN = "s3cret-token"


def _samples(text: str) -> dict[str, float]:
    """``{sample name: value}`` for the job's samples (histograms contribute _count/_sum/_bucket)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("job") == "e2e" and "le" not in s.labels:
                out[s.name] = s.value
    return out


def _wait(pred, timeout: float, what: str, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"trainer exited with {proc.returncode} while waiting for {what}")
        value = pred()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _start_trainer(job: dict, sft_start, tmp_path: Path, log) -> tuple[subprocess.Popen, str]:
    """`daedalus train` on ``job`` (from the SFT start) as a real process writing to ``log``, its endpoint on a free
    local port with the token :data:`TOKEN`: ``(process, base URL)``."""
    job["spec"]["model"]["sftAdapter"] = str(sft_start)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(job))
    port = free_port()
    env = dict(os.environ, DAEDALUS_METRICS_PORT=str(port), DAEDALUS_METRICS_HOST="127.0.0.1",
               DAEDALUS_CONTROL_TOKEN=TOKEN, DAEDALUS_ATTEMPT="1", OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "daedalus_trainer", "train", "--config", str(cfg),
                             "--out", str(tmp_path / "run")], env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def _status(base: str) -> dict | None:
    """The trainer's ``GET /status``, or None while it does not answer."""
    try:
        return requests.get(f"{base}/status", timeout=2).json()
    except requests.RequestException:
        return None


def test_metrics_move_checkpoint_on_request_and_sigterm_ends_the_step(sft_start, tmp_path):
    """One trainer process (its start-up is most of the cost): /metrics move while it trains, `POST /checkpoint` is
    401 without the token and answered at the next step boundary with it; then `kill -TERM` (ray job stop, a
    container stop): the step in progress ends, its checkpoint is written although the interval is far off, and the
    process exits 0 as after POST /stop, exporting nothing (stopped, not finished)."""
    import signal

    # klCoef > 0: the learner runs the reference forward, so daedalus_train_kl is a real value.
    job = tiny_job_dict(algorithm={"steps": 40, "evalIntervalSteps": 2, "klCoef": 0.01, "rolloutWorkers": 1},
                        checkpoint={"intervalSteps": 100})
    log_path = tmp_path / "trainer.log"
    log = open(log_path, "w")
    proc, base = _start_trainer(job, sft_start, tmp_path, log)
    try:
        _wait(lambda: (_status(base) or {}).get("step", 0) >= 1, 300, "the first step", proc)
        first = _samples(requests.get(f"{base}/metrics", timeout=5).text)
        assert requests.get(f"{base}/healthz", timeout=5).status_code == 200

        # Authentication.
        assert requests.post(f"{base}/checkpoint", timeout=10).status_code == 401
        assert requests.post(f"{base}/checkpoint", headers={"Authorization": "Bearer wrong"},
                             timeout=10).status_code == 401
        before = _status(base)["step"]
        r = requests.post(f"{base}/checkpoint", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
        assert r.status_code == 200, r.text
        ck = r.json()
        assert ck["step"] >= before
        assert (Path(ck["path"]) / "MANIFEST.json").is_file()
        assert _status(base)["latestCheckpoint"]["step"] == ck["step"]

        # past an evaluation (every 2 steps), so the eval gauge has a value
        _wait(lambda: (_status(base) or {}).get("step", 0) >= max(ck["step"] + 2, 3), 300, "two more steps", proc)
        second = _samples(requests.get(f"{base}/metrics", timeout=5).text)
        sigterm_after = _status(base)["step"]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = log_path.read_text()
    assert proc.returncode == 0, text[-3000:]

    # Every metric in the table is exported with the job's labels.
    exported = {name.removesuffix("_total").removesuffix("_count") for name in second}
    for spec in METRICS:
        assert spec.name.removesuffix("_total") in exported, spec.name
    # Training metrics move.
    assert second["daedalus_train_step"] > first["daedalus_train_step"]
    assert second["daedalus_rollout_tokens_total"] > first["daedalus_rollout_tokens_total"]
    assert second["daedalus_rollout_seconds_count"] > first["daedalus_rollout_seconds_count"]
    assert second["daedalus_checkpoint_last_step"] == ck["step"]
    assert second["daedalus_checkpoint_bytes"] > 0
    assert 0.0 <= second["daedalus_eval_success_ratio"] <= 1.0
    for name in ("daedalus_train_success_ratio", "daedalus_train_reward_mean", "daedalus_train_episode_turns",
                 "daedalus_train_grad_norm", "daedalus_train_loss", "daedalus_train_kl"):
        assert math.isfinite(second[name]), name

    # SIGTERM: the step in progress ended and was checkpointed (no interval checkpoint before step 100)
    assert "SIGTERM: the step in progress ends" in text and "training stopped at step" in text, text[-3000:]
    saved = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert saved and int(saved[-1].name.split("-")[1]) >= sigterm_after > ck["step"], (saved, sigterm_after)
    assert (saved[-1] / "MANIFEST.json").is_file()
    assert not (tmp_path / "run" / "exports" / "adapter").exists()  # stopped, not finished


def test_a_tiny_job_without_an_sft_start_says_why_grpo_cannot_learn(tmp_path):
    """`daedalus train` (what a cluster runs) does not train the SFT start `daedalus run` trains: on a tiny job
    without model.sftAdapter the policy is random weights. It says so at the start; each step's unparseable replies
    are put down to the missing format (not to a collapse, whose advice, a lower learning rate, would not help), and
    the steps whose groups all had one reward are said to teach nothing."""
    # 4 turns (the suite's 16 are not needed to show that random weights write no action)
    job = tiny_job_dict(algorithm={"steps": 2, "mazesPerStep": 2, "groupSize": 2, "evalIntervalSteps": 0,
                                   "rolloutWorkers": 1},
                        environment={"evalMazes": 2, "maxTurns": 4}, checkpoint={"intervalSteps": 2})
    job["spec"]["model"].pop("sftAdapter", None)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(job))
    env = dict(os.environ, DAEDALUS_METRICS_PORT=str(free_port()), DAEDALUS_METRICS_HOST="127.0.0.1",
               DAEDALUS_CONTROL_TOKEN=TOKEN, OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-m", "daedalus_trainer", "train", "--config", str(cfg), "--out",
                          str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "model.tiny without model.sftAdapter: GRPO starts from the tiny model's random weights" in log
    assert log.count("as in every step so far: the starting point does not write the action format") == 2, log[-3000:]
    assert "the action format has collapsed" not in log
    assert log.count("no learning signal from the rewards") == 1  # said once, at step 1
    assert "step 1: in every group all 2 episodes got the same reward (success 0%)" in log
    assert "rollout engine: transformers (1 workers)" in log  # algorithm.rolloutWorkers reached the trainer
