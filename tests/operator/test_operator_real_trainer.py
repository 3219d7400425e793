"""The HyperPod node-replacement scenario with the **real tiny trainer** (`python -m daedalus_trainer train`) as the
Ray job: the operator (kopf) on the honest kmock API, the fake KubeRay, a real local Ray head, real GRPO steps on the
tiny Qwen3-VL from a short real SFT start, real checkpoints. The stand-in scenarios (test_operator_e2e.py) cover the
other failure kinds quickly; this one proves the operator and the trainer agree on the protocol (/status, /stop,
resumedFrom, checkpoints, the exported adapter).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from operator_env import REAL_TRAINER, OperatorEnv

pytestmark = pytest.mark.slow

STEPS = 6


@pytest.fixture()
def env(tmp_path: Path, ray_head):
    e = OperatorEnv(tmp_path, ray_head, entrypoint=REAL_TRAINER, poll=0.5)
    e.start()
    for name in ("node-a", "node-b", "node-c"):
        e.fake.add_node(name)
    yield e
    e.stop()


def _real_trainer_job(env: OperatorEnv, sft_start: Path, *, steps: int, interval: int, hyperpod: bool,
                      rollout_workers: int = 1) -> dict:
    """A small real-trainer job (2 mazes x 4 episodes per step, arrival within 16 turns) starting from
    ``sft_start``; one rollout worker unless told (the actors start sooner than with the automatic two)."""
    manifest = env.job_manifest(
        algorithm__steps=steps, algorithm__groupSize=4, algorithm__mazesPerStep=2, algorithm__maxTokensPerTurn=10,
        algorithm__rolloutWorkers=rollout_workers,
        environment__evalMazes=16, environment__successOn="arrival", environment__maxTurns=16,
        checkpoint__intervalSteps=interval, resilience__hyperPod=hyperpod)
    manifest["spec"]["model"]["sftAdapter"] = str(sft_start)
    return manifest


def test_node_replacement_with_the_real_trainer_loses_no_step(env: OperatorEnv, sft_start: Path) -> None:
    manifest = _real_trainer_job(env, sft_start, steps=STEPS, interval=100, hyperpod=True, rollout_workers=0)
    env.apply(manifest)
    st = env.wait_status(lambda s: s.get("phase") == "Running" and s.get("currentStep", 0) >= 2, timeout=400,
                         message="attempt 1 stepping with the real trainer")
    (worker,) = env.kube.list("v1/pods", "ml", selector="ray.io/node-type=worker")
    flipped_at = time.time()
    env.fake.set_node_health(worker["spec"]["nodeName"], "UnschedulablePendingReplacement")
    st = env.wait_status(lambda s: s.get("submissionId", "").endswith("-a2"), timeout=300, message="attempt 2")
    assert st["restarts"] == 1 and st["attempt"] == 2
    st = env.wait_phase("Succeeded", timeout=600)
    rec = st["lastRecovery"]
    # The interval (100) is never reached: the only checkpoints are the one POST /stop asked for and the final one.
    # Zero lost steps: attempt 2 resumed exactly at the step attempt 1 checkpointed when it stopped.
    assert rec["reason"] == "NodeReplacement" and rec["lostSteps"] == 0, (rec, env.event_reasons())
    stop_step = rec["resumedFromStep"]
    assert 2 <= stop_step < STEPS
    checkpoints = sorted(p.name for p in (env.trainer_root() / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert checkpoints == [f"step-{stop_step:06d}", f"step-{STEPS:06d}"]
    state = json.loads((env.trainer_root() / "checkpoints" / f"step-{STEPS:06d}" / "trainer_state.json").read_text())
    assert [h["step"] for h in state["metric_history"]] == list(range(1, STEPS + 1))  # every step once
    assert state["extra"]["rollout_workers"] == 2  # automatic (rolloutWorkers 0) on CPU, on the real Ray head
    assert st["currentStep"] == STEPS
    assert (Path(st["adapterPath"]) / "adapter_config.json").is_file()
    print(f"\nreal trainer: node replacement at step >= 2, resumed from {stop_step}, lost 0, "
          f"flip -> Succeeded {time.time() - flipped_at:.0f} s")


def _trainer_pids(config_dir: Path) -> list[int]:
    import psutil

    pids = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "daedalus_trainer train" in cmd and str(config_dir) in cmd:
            pids.append(p.info["pid"])
    return pids


def _trainer_step(env: OperatorEnv) -> int | None:
    """The real trainer's latest completed step from its own ``GET /status`` (no operator involved), or ``None``."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{env.control_port}/status", timeout=5) as r:
            return json.loads(r.read()).get("step")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def test_operator_restart_then_a_killed_trainer_one_submission_each_and_resume_from_a_periodic_checkpoint(
        env: OperatorEnv, sft_start: Path) -> None:
    """Two issue #5 acceptance scenarios with the real trainer, on one job (each costs a Ray job, a trainer process
    and its actors):

    1. "restart the operator mid-run -> no second submission, status intact": the operator thread is stopped while
       the trainer steps, the trainer steps on alone, a new operator (a fresh ``run``: new runtime, new kopf registry,
       nothing remembered in memory) adopts attempt 1 from its status.
    2. Then the trainer is killed (SIGKILL: no checkpoint, no answer) under that new operator: attempt 2 resumes from
       the last periodic checkpoint, which the operator read from the trainer's ``/status``, losing at most an
       interval of steps. Attempt 1 is never submitted again, before or after the kill.
    """
    import os
    import signal

    from fake_kuberay import wait_for

    from daedalus_operator.submit import RayJobs

    # 15: a multiple of the interval, so that even a kill after the last step's checkpoint resumes from one
    steps, interval = 15, 3
    manifest = _real_trainer_job(env, sft_start, steps=steps, interval=interval, hyperpod=False)
    job = env.apply(manifest)
    before = env.wait_status(lambda s: s.get("phase") == "Running" and s.get("currentStep", 0) >= interval + 1
                             and (s.get("latestCheckpoint") or {}).get("step"), timeout=400,
                             message="attempt 1 stepping past its first periodic checkpoint")
    env.stop_operator()
    stopped_at = wait_for(lambda: _trainer_step(env), timeout=30, message="the trainer's /status")
    # The trainer steps on with nobody watching; the job's status stays what the old operator wrote.
    stepped_alone = wait_for(lambda: (lambda s: s if s is not None and s >= stopped_at + 1 else None)(
        _trainer_step(env)), timeout=120, message="the trainer to step on without an operator")
    frozen = env.status()
    assert frozen["currentStep"] <= stopped_at < stepped_alone and frozen["submissionId"] == before["submissionId"]
    assert stepped_alone < steps - 2, "the job is about to finish before the new operator starts: raise steps"

    env.start_operator()
    adopted = env.wait_status(lambda s: s.get("currentStep", 0) >= stepped_alone, timeout=60,
                              message="the new operator reading the trainer's progress")
    assert adopted["submissionId"] == before["submissionId"] and adopted["attempt"] == 1
    assert adopted["restarts"] == 0 and adopted["startTime"] == before["startTime"]
    assert adopted["latestCheckpoint"]["step"] >= before["latestCheckpoint"]["step"]
    assert "lastFailure" not in adopted and "lastRecovery" not in adopted
    prefix = f"local-tiny-{job['metadata']['uid'].replace('-', '')[:8]}-a"

    def submitted() -> list[str]:
        """The submission ids of this job on the real Ray head (its own list), oldest first."""
        return sorted(j.submission_id for j in RayJobs(env.ray.dashboard_url)._c().list_jobs()
                      if (j.submission_id or "").startswith(prefix))

    # one attempt, one submission: the new operator adopted attempt 1 instead of submitting again
    assert submitted() == [before["submissionId"]]

    # 2. the trainer killed under the new operator, while it still has steps to train
    assert (_trainer_step(env) or 0) < steps - 1, "the job is about to finish before the kill: raise steps"
    pids = _trainer_pids(env.volumes / "etc-daedalus")  # Ray's shell wrapper and the trainer under it
    assert 1 <= len(pids) <= 2, pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    env.wait_status(lambda s: s.get("submissionId", "").endswith("-a2"), timeout=300, message="attempt 2")
    st = env.wait_phase("Succeeded", timeout=600)
    rec = st["lastRecovery"]
    assert rec["reason"] == "JobFailed" and st["restarts"] == 1 and st["attempt"] == 2, rec
    resumed = rec["resumedFromStep"]
    # a periodic checkpoint, from the trainer's /status, no older than the one the new operator saw on adopting
    assert resumed % interval == 0 and resumed >= adopted["latestCheckpoint"]["step"], rec
    assert 0 <= rec["lostSteps"] <= interval, rec
    assert st["startTime"] == before["startTime"] and st["currentStep"] == steps
    assert st["latestCheckpoint"]["step"] == steps
    a1 = before["submissionId"]
    assert a1.endswith("-a1") and submitted() == [a1, st["submissionId"]] and st["submissionId"] == a1[:-1] + "2"
    reasons = env.wait_event_reasons("Submitted", "Resubmitted")
    assert reasons.count("Submitted") == 1 and reasons.count("Resubmitted") == 1, reasons
    state = json.loads((env.trainer_root() / "checkpoints" / f"step-{steps:06d}" / "trainer_state.json").read_text())
    assert [h["step"] for h in state["metric_history"]] == list(range(1, steps + 1))  # each step once
    assert state["extra"]["rollout_workers"] == 1  # the spec's algorithm.rolloutWorkers, through the operator
    assert (Path(st["adapterPath"]) / "adapter_config.json").is_file()
    print(f"\nreal trainer, operator restart: stopped at trainer step {stopped_at}, trainer alone reached "
          f"{stepped_alone}, adopted with one submission; killed: resumed from periodic checkpoint {resumed}, lost "
          f"{rec['lostSteps']} (interval {interval}), Succeeded at step {st['currentStep']}")
