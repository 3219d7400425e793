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


def test_node_replacement_with_the_real_trainer_loses_no_step(env: OperatorEnv, sft_start: Path) -> None:
    manifest = env.job_manifest(
        algorithm__steps=STEPS, algorithm__groupSize=4, algorithm__mazesPerStep=2, algorithm__maxTokensPerTurn=10,
        environment__evalMazes=16, environment__successOn="arrival", environment__maxTurns=16,
        checkpoint__intervalSteps=100, resilience__hyperPod=True)
    manifest["spec"]["model"]["sftAdapter"] = str(sft_start)
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


def test_killed_real_trainer_resumes_from_the_last_periodic_checkpoint(env: OperatorEnv, sft_start: Path) -> None:
    import os
    import signal

    steps, interval = 8, 3
    manifest = env.job_manifest(
        algorithm__steps=steps, algorithm__groupSize=4, algorithm__mazesPerStep=2, algorithm__maxTokensPerTurn=10,
        environment__evalMazes=16, environment__successOn="arrival", environment__maxTurns=16,
        checkpoint__intervalSteps=interval, resilience__hyperPod=False)
    manifest["spec"]["model"]["sftAdapter"] = str(sft_start)
    env.apply(manifest)
    env.wait_status(lambda s: s.get("phase") == "Running" and s.get("currentStep", 0) >= interval + 1, timeout=400,
                    message="attempt 1 past its first periodic checkpoint")
    pids = _trainer_pids(env.volumes / "etc-daedalus")  # Ray's shell wrapper and the trainer under it
    assert 1 <= len(pids) <= 2, pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)  # abrupt: no checkpoint, no answer
    st = env.wait_status(lambda s: s.get("submissionId", "").endswith("-a2"), timeout=300, message="attempt 2")
    st = env.wait_phase("Succeeded", timeout=600)
    rec = st["lastRecovery"]
    assert rec["reason"] == "JobFailed" and st["restarts"] == 1, rec
    resumed = rec["resumedFromStep"]
    assert resumed >= interval and resumed % interval == 0, rec  # a periodic checkpoint, from the trainer's /status
    assert 0 <= rec["lostSteps"] <= interval, rec
    state = json.loads((env.trainer_root() / "checkpoints" / f"step-{steps:06d}" / "trainer_state.json").read_text())
    assert [h["step"] for h in state["metric_history"]] == list(range(1, steps + 1))
    assert (Path(st["adapterPath"]) / "adapter_config.json").is_file()
    print(f"\nreal trainer killed: resumed from periodic checkpoint {resumed}, lost {rec['lostSteps']} "
          f"(interval {interval})")
