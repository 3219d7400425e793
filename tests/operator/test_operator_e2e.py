"""End to end with real parts: the operator (kopf) against the honest kmock API, the fake KubeRay placing pods on
Node objects, and **real Ray jobs** on a real local Ray head running the stand-in trainer (tests/support; swap in the
real trainer with ``entrypoint=REAL_TRAINER``).

Scenarios (DESIGN §3): a HyperPod node replacement (checkpoint, stop, reschedule, resume: zero lost steps), a Ray job
killed abruptly (resumed from the last periodic checkpoint: at most one interval lost), the head lost and replaced by a
new Ray head that knows none of the old jobs (resubmitted there, resumed from the last checkpoint), an operator
restart mid-run (no second submission). Each prints its measured figures (recovery seconds, lost steps).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from fake_kuberay import wait_for
from operator_env import OperatorEnv

from daedalus_operator import api
from daedalus_operator.submit import RayJobs

pytestmark = pytest.mark.slow

STEPS = 40
INTERVAL = 5


@pytest.fixture()
def env(tmp_path: Path, ray_head):
    e = OperatorEnv(tmp_path, ray_head, step_seconds=0.3, poll=0.5)
    e.start()
    for name in ("node-a", "node-b", "node-c"):
        e.fake.add_node(name)
    yield e
    e.stop()


def ray_jobs_of(env: OperatorEnv, uid: str) -> list:
    prefix = f"local-tiny-{uid.replace('-', '')[:8]}-a"
    return [j for j in RayJobs(env.ray.dashboard_url)._c().list_jobs() if (j.submission_id or "").startswith(prefix)]


def trainer_status(env: OperatorEnv) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{env.control_port}/status", timeout=5) as r:
        return json.loads(r.read())


def attempts(env: OperatorEnv) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for rec in env.steps_log():
        out.setdefault(rec["attempt"], []).append(rec["step"])
    return out


def metric(text: str, prefix: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(prefix))
    return float(line.rsplit(" ", 1)[1])


def test_node_replacement_checkpoints_stops_and_resumes_with_zero_lost_steps(env: OperatorEnv) -> None:
    job = env.apply(env.job_manifest(algorithm__steps=STEPS, checkpoint__intervalSteps=INTERVAL,
                                     resilience__hyperPod=True))
    uid = job["metadata"]["uid"]
    env.wait_status(lambda s: s.get("phase") == "Running" and s.get("currentStep", 0) >= 6, timeout=120,
                    message="attempt 1 stepping")
    pods = env.kube.list("v1/pods", "ml", selector="ray.io/node-type=worker")
    (worker,) = pods
    bad_node = worker["spec"]["nodeName"]
    flipped_at = time.time()
    env.fake.set_node_health(bad_node, "UnschedulablePendingReplacement")
    st = env.wait_status(lambda s: s.get("submissionId", "").endswith("-a2"), timeout=90, message="attempt 2")
    assert st["restarts"] == 1 and st["attempt"] == 2
    assert st.get("plannedRestarts") == 1  # maintenance: not counted against maxRestarts
    st = env.wait_phase("Succeeded", timeout=120)

    # zero lost steps: attempt 2 starts right after the step attempt 1 checkpointed and stopped at
    steps = attempts(env)
    assert sorted(steps) == [1, 2]
    first_new = min(steps[2])
    assert first_new == max(steps[1]) + 1, steps
    assert steps[2] == list(range(first_new, STEPS + 1))
    rec = st["lastRecovery"]
    assert rec["reason"] == "NodeReplacement" and rec["lostSteps"] == 0, (rec, steps, env.event_reasons())
    assert rec["resumedFromStep"] == max(steps[1])
    first_new_time = next(r["time"] for r in env.steps_log() if r["attempt"] == 2)
    flip_to_step = first_new_time - flipped_at
    print(f"\nnode replacement: flip -> stepping again {flip_to_step:.1f} s; operator-measured recovery "
          f"{rec['seconds']:.1f} s; lost steps 0 (attempt 1 stopped after step {max(steps[1])}, attempt 2 resumed "
          f"at {first_new})")
    assert flip_to_step < 60

    # the worker was moved off the node HyperPod is replacing; the job's pods are gone with the RayCluster now
    assert worker["metadata"]["name"] in env.fake.pods_created
    moved = [n for n in env.fake.pods_created if "-cpu-worker-" in n and n != worker["metadata"]["name"]]
    assert moved, env.fake.pods_created
    wait_for(lambda: env.kube.get("ray.io/v1/rayclusters", "ml", "local-tiny-ray") is None, timeout=20,
             message="the RayCluster to be deleted after success")
    assert st["adapterPath"] == str(env.trainer_root() / "exports" / "adapter")
    assert (Path(st["adapterPath"]) / "adapter_config.json").exists()
    assert st["currentStep"] == STEPS and {c["type"]: c["status"] for c in st["conditions"]}["Succeeded"] == "True"

    reasons = env.wait_event_reasons("Submitted", "NodeReplacement", "CheckpointTaken", "Resubmitted", "Recovered",
                                     "Succeeded")
    for a, b in zip(["Submitted", "NodeReplacement", "CheckpointTaken", "Resubmitted", "Recovered", "Succeeded"],
                    ["NodeReplacement", "CheckpointTaken", "Resubmitted", "Recovered", "Succeeded", None]):
        assert a in reasons, reasons
        if b:
            assert reasons.index(a) < reasons.index(b), reasons
    assert [j.submission_id[-2:] for j in sorted(ray_jobs_of(env, uid), key=lambda j: j.submission_id)] == ["a1",
                                                                                                           "a2"]
    text = env.metrics_text()
    assert metric(text, 'daedalus_operator_restarts_total{job="local-tiny",namespace="ml",reason="NodeReplacement"}') \
        == 1.0
    assert metric(text, "daedalus_operator_recovery_seconds_count") == 1.0
    assert metric(text, 'daedalus_operator_job_phase{job="local-tiny",namespace="ml",phase="Succeeded"}') == 1.0
    assert metric(text, 'daedalus_operator_job_restarts{job="local-tiny",namespace="ml"}') == 1.0


def test_a_drained_node_is_checkpointed_off_with_zero_lost_steps(env: OperatorEnv) -> None:
    """``kubectl drain`` cordons the node, then evicts; the job's PodDisruptionBudget refuses the evictions (the API
    server's part: kmock has no Eviction API; tests/cluster/test_disruption_budget.py runs it on a real one) while the
    operator, seeing the cordon, checkpoints, stops the attempt and deletes the pod there itself. A planned restart,
    with no step lost."""
    steps_total = 24
    env.apply(env.job_manifest(algorithm__steps=steps_total, checkpoint__intervalSteps=INTERVAL))
    env.wait_status(lambda s: s.get("phase") == "Running" and s.get("currentStep", 0) >= 6, timeout=120,
                    message="attempt 1 stepping")
    pdb = env.kube.get("policy/v1/poddisruptionbudgets", "ml", "local-tiny-ray")
    assert pdb is not None and pdb["spec"]["minAvailable"] == 2  # head + 1 worker
    (worker,) = env.kube.list("v1/pods", "ml", selector="ray.io/node-type=worker")
    drained = worker["spec"]["nodeName"]
    env.kube.patch("v1/nodes", None, drained, {"spec": {"unschedulable": True}})  # kubectl cordon
    st = env.wait_status(lambda s: s.get("submissionId", "").endswith("-a2"), timeout=90, message="attempt 2")
    assert st["restarts"] == 1 and st.get("plannedRestarts") == 1
    st = env.wait_phase("Succeeded", timeout=120)
    steps = attempts(env)
    assert sorted(steps) == [1, 2] and min(steps[2]) == max(steps[1]) + 1, steps
    rec = st["lastRecovery"]
    assert rec["reason"] == "NodeDrain" and rec["lostSteps"] == 0, rec
    assert st["currentStep"] == steps_total
    moved = [n for n in env.fake.pods_created if "-cpu-worker-" in n and n != worker["metadata"]["name"]]
    assert moved, env.fake.pods_created
    reasons = env.wait_event_reasons("NodeDrain", "CheckpointTaken", "Resubmitted", "Succeeded")
    assert reasons.index("NodeDrain") < reasons.index("CheckpointTaken") < reasons.index("Resubmitted"), reasons
    print(f"\ndrain: recovery {rec['seconds']:.1f} s, lost steps 0 (attempt 1 stopped after step {max(steps[1])})")


def test_killed_ray_job_resumes_from_the_last_periodic_checkpoint(env: OperatorEnv) -> None:
    job = env.apply(env.job_manifest(algorithm__steps=STEPS, checkpoint__intervalSteps=INTERVAL))
    env.wait_status(lambda s: s.get("phase") == "Running" and s.get("currentStep", 0) >= INTERVAL + 2, timeout=120,
                    message="attempt 1 past its first checkpoint")
    pid = trainer_status(env)["pid"]
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)  # the entrypoint this test's Ray head started
    st = env.wait_status(lambda s: s.get("submissionId", "").endswith("-a2"), timeout=90, message="attempt 2")
    assert st["lastFailure"]["reason"] == "JobFailed"
    assert "exit code 137" in st["lastFailure"]["message"] or "exit code -9" in st["lastFailure"]["message"]
    st = env.wait_phase("Succeeded", timeout=120)
    steps = attempts(env)
    resumed_from = min(steps[2]) - 1
    lost = max(steps[1]) - resumed_from
    assert resumed_from % INTERVAL == 0 and 0 <= lost <= INTERVAL, steps
    first_new_time = next(r["time"] for r in env.steps_log() if r["attempt"] == 2)
    print(f"\nkilled Ray job: kill -> stepping again {first_new_time - killed_at:.1f} s; resumed from the periodic "
          f"checkpoint at step {resumed_from}; lost steps {lost} (interval {INTERVAL}); operator-measured "
          f"recovery {st['lastRecovery']['seconds']:.1f} s")
    assert st["restarts"] == 1 and st["lastRecovery"]["reason"] == "JobFailed"
    assert st.get("plannedRestarts", 0) == 0
    assert st["lastRecovery"]["resumedFromStep"] == resumed_from  # from the new attempt's /status resumedFrom
    assert 0 <= lost - st["lastRecovery"]["lostSteps"] <= 3  # detection lags by at most one poll (0.5 s ~ 2 steps)
    assert "JobFailed" in env.wait_event_reasons("JobFailed")
    assert len(ray_jobs_of(env, job["metadata"]["uid"])) == 2


def test_lost_head_is_replaced_and_the_job_resumes_on_the_new_head(env: OperatorEnv) -> None:
    """DESIGN §3 failure 3: the head pod dies (with it the Ray job: its trainer is SIGKILLed); KubeRay's new head pod
    is unscheduled for 3 s, then comes up as a **new real Ray head** that knows none of the old jobs. The operator
    must record HeadLost, wait for the new head, resubmit attempt 2 there resuming from the latest checkpoint, and
    finish."""
    from ray_head import start_ray_head

    new_head = start_ray_head(num_cpus=1)  # the replacement head (started first: its start-up is the slow part)
    try:
        job = env.apply(env.job_manifest(algorithm__steps=STEPS, checkpoint__intervalSteps=INTERVAL))
        uid = job["metadata"]["uid"]
        before = env.wait_status(lambda s: s.get("phase") == "Running" and s.get("currentStep", 0) >= INTERVAL + 2,
                                 timeout=120, message="attempt 1 past its first checkpoint")
        pid = trainer_status(env)["pid"]
        lost_at = time.time()
        old_pod = env.fake.lose_head("ml", "local-tiny-ray", dashboard_port=new_head.dashboard_port,
                                     down_seconds=3.0)
        def head_pod_down() -> bool:  # as KubeRay: state stays "ready", the service IP stays, the pod's IP goes
            status = env.kube.get("ray.io/v1/rayclusters", "ml", "local-tiny-ray")["status"] or {}
            conds = {c["type"]: c["status"] for c in status.get("conditions") or []}
            return conds.get("HeadPodReady") == "False" and not (status.get("head") or {}).get("podIP")

        wait_for(head_pod_down, timeout=10, message="KubeRay to report the head pod not ready")
        os.kill(pid, signal.SIGKILL)  # the Ray job dies with its head
        st = env.wait_status(lambda s: s.get("phase") == "Recovering", timeout=30, message="Recovering")
        assert st["lastFailure"]["reason"] == "HeadLost" and "head pod" in st["lastFailure"]["message"], st
        assert st["submissionId"] == before["submissionId"] and st["restarts"] == 0
        st = env.wait_status(lambda s: s.get("submissionId", "").endswith("-a2"), timeout=60, message="attempt 2")
        assert st["attempt"] == 2 and st["restarts"] == 1
        st = env.wait_phase("Succeeded", timeout=120)

        steps = attempts(env)
        assert sorted(steps) == [1, 2], steps
        resumed_from = min(steps[2]) - 1
        lost = max(steps[1]) - resumed_from
        assert resumed_from >= INTERVAL and resumed_from % INTERVAL == 0 and 0 <= lost <= INTERVAL, steps
        assert steps[2] == list(range(resumed_from + 1, STEPS + 1))
        rec = st["lastRecovery"]
        assert rec["reason"] == "HeadLost" and rec["resumedFromStep"] == resumed_from, rec
        assert 0 <= lost - rec["lostSteps"] <= 3, (rec, lost)  # detection lags by at most a poll (~2 steps)
        assert st["lastFailure"]["reason"] == "HeadLost" and st["currentStep"] == STEPS
        assert st["attempt"] == 2 and st["restarts"] == 1
        assert (Path(st["adapterPath"]) / "adapter_config.json").exists()

        # attempt 1 lived and died on the old head; attempt 2 was submitted only to the new one
        prefix = f"local-tiny-{uid.replace('-', '')[:8]}-a"
        old_jobs = {j.submission_id: j.status.value for j in ray_jobs_of(env, uid)}
        new_jobs = {j.submission_id: j.status.value for j in RayJobs(new_head.dashboard_url)._c().list_jobs()
                    if (j.submission_id or "").startswith(prefix)}
        assert list(old_jobs) == [before["submissionId"]] and old_jobs[before["submissionId"]] in ("FAILED",
                                                                                                    "STOPPED")
        assert new_jobs == {st["submissionId"]: "SUCCEEDED"}, new_jobs
        assert old_pod in env.fake.pods_created and len([n for n in env.fake.pods_created if "-head-" in n]) == 2

        order = ["Submitted", "HeadLost", "Resubmitted", "Recovered", "Succeeded"]
        reasons = env.wait_event_reasons(*order)
        assert all(r in reasons for r in order), reasons
        assert [reasons.index(r) for r in order] == sorted(reasons.index(r) for r in order), reasons
        text = env.metrics_text()
        assert metric(text, 'daedalus_operator_restarts_total{job="local-tiny",namespace="ml",reason="HeadLost"}') \
            == 1.0
        first_new_time = next(r["time"] for r in env.steps_log() if r["attempt"] == 2)
        print(f"\nhead lost: loss -> stepping again on the new head {first_new_time - lost_at:.1f} s (head down "
              f"3 s, backoff 1 s); resumed from the checkpoint at step {resumed_from}; lost steps {lost} (interval "
              f"{INTERVAL}); operator-measured recovery {rec['seconds']:.1f} s")
    finally:
        new_head.stop()


def test_operator_restart_mid_run_never_submits_twice(env: OperatorEnv) -> None:
    job = env.apply(env.job_manifest(algorithm__steps=STEPS, checkpoint__intervalSteps=INTERVAL))
    before = env.wait_status(lambda s: s.get("phase") == "Running" and s.get("currentStep", 0) >= 4, timeout=120,
                             message="attempt 1 stepping")
    env.stop_operator()
    stopped_at_step = trainer_status(env)["step"]
    time.sleep(1.0)
    env.start_operator()
    st = env.wait_phase("Succeeded", timeout=120)
    assert st["submissionId"] == before["submissionId"] and st["submissionId"].endswith("-a1")
    assert st["attempt"] == 1 and st["restarts"] == 0 and st["startTime"] == before["startTime"]
    jobs = ray_jobs_of(env, job["metadata"]["uid"])
    assert [j.submission_id for j in jobs] == [before["submissionId"]]
    steps = attempts(env)
    assert list(steps) == [1] and steps[1] == list(range(1, STEPS + 1))  # no step ran twice
    assert stopped_at_step < STEPS
    assert env.event_reasons().count("Submitted") == 1
    assert api.FINALIZER in env.get_job()["metadata"]["finalizers"]


def test_suspend_checkpoints_frees_the_cluster_and_resume_continues(env: OperatorEnv) -> None:
    env.apply(env.job_manifest(algorithm__steps=STEPS, checkpoint__intervalSteps=INTERVAL))
    env.wait_status(lambda s: s.get("phase") == "Running" and s.get("currentStep", 0) >= 4, timeout=120,
                    message="attempt 1 stepping")
    env.kube.patch("daedalus.dev/v1alpha1/rltrainingjobs", "ml", "local-tiny", {"spec": {"suspend": True}})
    st = env.wait_phase("Suspended", timeout=60)
    assert {c["type"]: c["status"] for c in st["conditions"]}["Suspended"] == "True"
    wait_for(lambda: env.kube.get("ray.io/v1/rayclusters", "ml", "local-tiny-ray") is None, timeout=30,
             message="the RayCluster to be deleted while suspended")
    wait_for(lambda: not env.kube.list("v1/pods", "ml"), timeout=30, message="the pods to be collected")
    pdb = "policy/v1/poddisruptionbudgets"
    assert env.kube.get(pdb, "ml", "local-tiny-ray") is None  # gone with the RayCluster: it would hold nothing
    suspended_at = max(attempts(env)[1])
    assert st["latestCheckpoint"]["step"] == suspended_at  # checkpointed right where it stopped
    time.sleep(1.0)
    assert max(attempts(env)[1]) == suspended_at  # nothing runs while suspended
    env.kube.patch("daedalus.dev/v1alpha1/rltrainingjobs", "ml", "local-tiny", {"spec": {"suspend": False}})
    wait_for(lambda: env.kube.get(pdb, "ml", "local-tiny-ray"), timeout=60, message="the budget back on resume")
    st = env.wait_phase("Succeeded", timeout=150)
    steps = attempts(env)
    assert min(steps[2]) == suspended_at + 1 and steps[2][-1] == STEPS  # zero lost steps across the suspension
    assert st["attempt"] == 2 and st["restarts"] == 0  # a suspension is not a restart
    reasons = env.wait_event_reasons("Suspend", "Suspended", "Resumed", "Succeeded")
    assert reasons.index("Suspend") < reasons.index("Suspended") < reasons.index("Resumed") < reasons.index(
        "Succeeded"), reasons


def test_a_quiet_job_is_looked_at_on_the_poll_budget_and_at_once_when_its_node_changes(tmp_path: Path,
                                                                                       ray_head) -> None:
    """``--poll-budget``: a Running job whose reconciles change nothing is looked at every ``quiet jobs / budget``
    seconds (here 1 / 0.01 = 100 s), but HyperPod's label on the node of its worker wakes it on the next tick."""
    env = OperatorEnv(tmp_path, ray_head, step_seconds=0.3, poll=0.5, extra_args=("--poll-budget", "0.01"))
    env.start()
    try:
        for name in ("node-a", "node-b", "node-c"):
            env.fake.add_node(name)
        env.apply(env.job_manifest(algorithm__steps=120, checkpoint__intervalSteps=INTERVAL,
                                   resilience__hyperPod=True))
        # looked at on every tick until the first step, then quiet
        env.wait_status(lambda s: s.get("phase") == "Running" and s.get("currentStep", 0) >= 1, timeout=120,
                        message="attempt 1 stepping")

        def counts() -> tuple[float, float]:
            text = env.metrics_text()
            reconciles = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                             if line.startswith("daedalus_operator_reconciles_total{"))
            return reconciles, metric(text, "daedalus_operator_poll_skips_total")

        # quiet: a reconcile or two may still be in flight from the start (a periodic checkpoint's first sighting)
        wait_for(lambda: counts()[1] >= 2, timeout=30, message="the timer to skip a quiet job")
        reconciles0, skips0 = counts()
        step0 = env.status().get("currentStep")
        time.sleep(4.0)  # 8 ticks at 0.5 s
        reconciles1, skips1 = counts()
        assert skips1 - skips0 >= 5, (skips0, skips1)
        assert reconciles1 - reconciles0 <= 1, (reconciles0, reconciles1)
        assert metric(env.metrics_text(), "daedalus_operator_steady_poll_seconds") == 100.0
        assert trainer_status(env)["step"] > step0 + 5  # training went on; .status was not looked at meanwhile

        (worker,) = env.kube.list("v1/pods", "ml", selector="ray.io/node-type=worker")
        flipped_at = time.monotonic()
        env.fake.set_node_health(worker["spec"]["nodeName"], "UnschedulablePendingReplacement")
        st = env.wait_status(lambda s: s.get("submissionId", "").endswith("-a2"), timeout=60, message="attempt 2")
        woke = time.monotonic() - flipped_at
        print(f"\npoll budget 0.01/s (100 s between looks at a quiet job): node label -> attempt 2 submitted "
              f"{woke:.1f} s later; lost steps {st.get('lastRecovery', {}).get('lostSteps')}")
        assert woke < 60 and st["restarts"] == 1
        rec = env.wait_status(lambda s: s.get("lastRecovery"), timeout=30, message="the recovery record")
        assert rec["lastRecovery"]["reason"] == "NodeReplacement" and rec["lastRecovery"]["lostSteps"] == 0, rec
        print(f"recovered {time.monotonic() - flipped_at:.1f} s after the label")
    finally:
        env.stop()


def control_log(env: OperatorEnv) -> list[dict]:
    """The stand-in trainer's record of the POSTs to its control routes (``control.jsonl``)."""
    path = env.trainer_root() / "control.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_deleting_a_running_job_checkpoints_first_and_the_job_created_again_resumes_there(
        env: OperatorEnv, caplog: pytest.LogCaptureFixture) -> None:
    """``kubectl delete`` then ``kubectl apply`` of the same job (Argo CD's replace does the same): the finalizer asks
    the running trainer to checkpoint and stop (``POST /stop``, the job's token), stops the Ray job only once that is
    answered, and the job created again under the name resumes from the checkpoint: no step lost. The periodic
    interval is the whole run, so before this every step of the deleted attempt was lost."""
    manifest = env.job_manifest(algorithm__steps=400, checkpoint__intervalSteps=400)
    job = env.apply(manifest)
    env.wait_status(lambda s: s.get("phase") == "Running" and s.get("currentStep", 0) >= 3, timeout=120,
                    message="attempt 1 stepping")
    deleted_at = time.time()
    env.kube.delete("daedalus.dev/v1alpha1/rltrainingjobs", "ml", "local-tiny")
    wait_for(lambda: env.get_job() is None, timeout=60, message="the job to be gone")
    gone_at = time.time()
    root = env.trainer_root()
    # exactly one checkpoint request, with the right token, and exactly the checkpoint it asked for
    assert [(c["path"], c["authorized"]) for c in control_log(env)] == [("/stop", True)]
    (written,) = sorted(p.name for p in root.glob("step-*"))
    step = int(written.removeprefix("step-"))
    assert (root / "latest").read_text().strip() == written
    # the Ray job ended after the checkpoint (the trainer exits by itself after it; the finalizer's stop is the
    # backstop): the trainer wrote it right after step `step`, while running, and ran no step after it
    (ray_job,) = wait_for(lambda: (lambda js: js if js and js[0].status.is_terminal() else None)(
        ray_jobs_of(env, job["metadata"]["uid"])), timeout=30, message="the Ray job to end")
    assert ray_job.status.value in ("SUCCEEDED", "STOPPED"), ray_job.status
    steps = [r for r in env.steps_log() if r["attempt"] == 1]
    stepped_at = next(r["time"] for r in steps if r["step"] == step)
    assert deleted_at <= stepped_at <= ray_job.end_time / 1000, (deleted_at, stepped_at, ray_job.end_time)
    lost = max(r["step"] for r in steps) - step
    assert lost == 0, steps
    env.wait_event_reasons("CheckpointedBeforeDeletion")
    (event,) = [e for e in env.events() if e["reason"] == "CheckpointedBeforeDeletion"]
    assert event["type"] == "Normal" and f"checkpoint at step {step} written before deletion" in event["message"]
    # waited for inside the finalizer: no "Handler 'finalize' failed temporarily" ERROR line (kopf logs each
    # TemporaryError so, and may post it as an Error event) for a checkpoint that takes a second
    assert not [r.getMessage() for r in caplog.records if r.getMessage().startswith("Handler 'finalize' failed")]
    print(f"\ndelete -> job gone {gone_at - deleted_at:.1f} s; checkpoint at step {step}; lost steps {lost}")
    # created again under the same name (a new uid, a new Ray job): resumes from that checkpoint
    env.apply(manifest)
    env.wait_status(lambda s: s.get("phase") == "Running" and s.get("currentStep", 0) > step, timeout=120,
                    message="the job created again stepping")
    again = [r["step"] for r in env.steps_log() if r["time"] > gone_at]
    assert min(again) == step + 1, again


def test_a_trainer_that_never_answers_holds_the_deletion_only_for_the_checkpoint_timeout(env: OperatorEnv) -> None:
    """The trainer's process is frozen (SIGSTOP: it accepts the connection and never answers): the finalizer stops
    the Ray job ``checkpointTimeoutSeconds`` after the deletion (here 4 s, under ``--deletion-timeout`` 120 s), says
    why there is no checkpoint, and releases."""
    job = env.apply(env.job_manifest(algorithm__steps=400, checkpoint__intervalSteps=400,
                                     resilience__checkpointTimeoutSeconds=4))
    env.wait_status(lambda s: s.get("phase") == "Running" and s.get("currentStep", 0) >= 2, timeout=120,
                    message="attempt 1 stepping")
    pid = trainer_status(env)["pid"]
    os.kill(pid, signal.SIGSTOP)  # the entrypoint this test's Ray head started
    try:
        t0 = time.monotonic()
        env.kube.delete("daedalus.dev/v1alpha1/rltrainingjobs", "ml", "local-tiny")
        wait_for(lambda: env.get_job() is None, timeout=60, message="the finalizer to be released")
        took = time.monotonic() - t0
        print(f"\nfrozen trainer: delete -> job gone {took:.1f} s (checkpointTimeoutSeconds 4)")
        assert 4.0 <= took < 12.0, took
        assert not list(env.trainer_root().glob("step-*"))
        wait_for(lambda: all(j.status.value == "STOPPED" for j in ray_jobs_of(env, job["metadata"]["uid"])),
                 timeout=30, message="the frozen trainer's Ray job to be stopped")
        assert "NoCheckpointBeforeDeletion" in env.wait_event_reasons("NoCheckpointBeforeDeletion")
        (event,) = [e for e in env.events() if e["reason"] == "NoCheckpointBeforeDeletion"]
        assert event["type"] == "Warning" and "within 4 s" in event["message"], event
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
