"""Recovery time and lost steps: the operator end to end on the honest kmock API, the fake KubeRay and a real local Ray
head (the operator-test environment of ``tests/support``), with the stand-in trainer.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python bench/recovery.py [--repeats 5]`` (about 3-4 minutes on 2 cores).

Set-up: a real ``ray start --head`` (``tests/support/ray_head.py``), kmock in a thread, the fake KubeRay (pods,
scheduler with node affinity, kubelet), the operator for real (``daedalus_operator.main.run``: kopf in a thread, poll
interval 0.5 s), three Schedulable nodes, one RLTrainingJob (``examples/local-tiny.yaml`` with ``hyperPod: true``,
checkpoint every ``--interval`` steps, 1 s restart backoff, ``maxRestarts`` 1000). The Ray job runs
``tests/support/standin_trainer.py`` (the trainer's HTTP contract, one step every ``--step-seconds``, a line per
completed step in ``steps.jsonl`` with its attempt: the ground truth used here).

Each repeat does two events, each after the current attempt has run ``interval + 2`` steps:

1. announced: a spare Schedulable node is added (the replacement capacity), then the node under the head or a worker
   (alternating) is labelled ``sagemaker.amazonaws.com/node-health-status=UnschedulablePendingReplacement``. The
   operator checkpoints, stops the Ray job, moves the pods off the node, resubmits with ``--resume latest``.
2. abrupt: the trainer process is killed with SIGKILL (its pid from ``GET /status``); the Ray job fails and the
   operator resubmits after its backoff.

Figures per event: seconds from the event to the first completed step of the next attempt ("stepping again"), seconds
from "the cluster is ready again" (a 50 ms monitor: the RayCluster ``ready``, every expected pod Ready, none on the
flipped node) to stepping again, and lost steps = last step completed by the old attempt - the step the new attempt
resumed from (announced: must be 0; abrupt: at most ``interval``). The operator's own record (``status.lastRecovery``:
seconds, lostSteps) is printed beside them.

Last lines: ``recovery_abrupt: ...`` and ``recovery_announced: <s> s after the cluster is ready again (anchor: 30 s
target, ...)``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from benchutil import print_load, summarize  # noqa: E402

HEALTH = "sagemaker.amazonaws.com/node-health-status"
TARGET_S = 30.0


class Monitor:
    """Samples the RayCluster and its pods every ``interval`` seconds: ``(time, ready, {pod: (node, ready)})``."""

    def __init__(self, kube, namespace: str, cluster: str, expected_pods: int, interval: float = 0.05):
        self.kube, self.ns, self.cluster, self.expected = kube, namespace, cluster, expected_pods
        self.interval = interval
        self.samples: list[tuple[float, bool, dict[str, tuple[str | None, bool]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-monitor", daemon=True)

    def start(self) -> "Monitor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rc = self.kube.get("ray.io/v1/rayclusters", self.ns, self.cluster) or {}
                pods = self.kube.list("v1/pods", self.ns, selector=f"ray.io/cluster={self.cluster}")
                state = ((rc.get("status") or {}).get("state") == "ready")
                view = {}
                for p in pods:
                    if p["metadata"].get("deletionTimestamp"):
                        continue
                    ready = any(c["type"] == "Ready" and c.get("status") == "True"
                                for c in (p.get("status") or {}).get("conditions") or [])
                    view[p["metadata"]["name"]] = ((p.get("spec") or {}).get("nodeName"), ready)
                self.samples.append((time.time(), state, view))
            except Exception:  # noqa: BLE001 - a missed sample is fine
                pass
            self._stop.wait(self.interval)

    def ready_again(self, after: float, bad_node: str | None) -> float | None:
        """First sample time >= ``after`` at which the cluster is ready with every expected pod Ready, none on
        ``bad_node``."""
        for t, ready, view in list(self.samples):
            if t < after or not ready or len(view) < self.expected:
                continue
            if all(r and node != bad_node for node, r in view.values()):
                return t
        return None


def steps_of(env) -> list[dict]:
    return env.steps_log()


def attempt_steps(env, attempt: int) -> list[dict]:
    return [s for s in steps_of(env) if s["attempt"] == attempt]


def wait_steps_in_attempt(env, n: int, timeout: float = 180.0) -> int:
    """Wait until the newest attempt has completed ``n`` steps; returns that attempt."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        log = steps_of(env)
        if log:
            attempt = log[-1]["attempt"]
            if sum(1 for s in log if s["attempt"] == attempt) >= n:
                return attempt
        time.sleep(0.1)
    raise TimeoutError(f"no attempt reached {n} steps in {timeout:.0f} s")


def wait_new_attempt(env, old: int, timeout: float = 180.0) -> dict:
    """The first completed step of an attempt newer than ``old``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        newer = [s for s in steps_of(env) if s["attempt"] > old]
        if newer:
            return newer[0]
        time.sleep(0.05)
    raise TimeoutError(f"the job did not step again within {timeout:.0f} s (status: {env.status()})")


def measure(env, monitor: Monitor, kind: str, t0: float, old_attempt: int, bad_node: str | None) -> dict:
    first = wait_new_attempt(env, old_attempt)
    old_steps = attempt_steps(env, old_attempt)
    last_old = max(s["step"] for s in old_steps)
    resumed_from = first["step"] - 1
    time.sleep(0.3)  # let the monitor catch up past the first step
    ready = monitor.ready_again(t0, bad_node)
    rec = operator_record(env, t0)
    return {"kind": kind, "seconds": first["time"] - t0,
            "after_ready": None if ready is None else first["time"] - max(ready, t0),
            "ready_after_event": None if ready is None else max(ready, t0) - t0,
            "lost": last_old - resumed_from, "last_old": last_old, "resumed_from": resumed_from,
            "attempt": first["attempt"], "operator_seconds": rec.get("seconds"), "operator_lost": rec.get("lostSteps"),
            "operator_reason": rec.get("reason"), "operator_detected_step": rec.get("stepAtDetection"),
            "operator_resumed_from": rec.get("resumedFromStep")}


def operator_record(env, t0: float, timeout: float = 15.0) -> dict:
    """The operator's ``status.lastRecovery`` for the event at ``t0`` (detected at or after it, to the second)."""
    import datetime as dt

    deadline = time.time() + timeout
    while time.time() < deadline:
        rec = env.status().get("lastRecovery") or {}
        stamp = rec.get("detectedAt")
        if stamp:
            detected = dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc).timestamp()
            if detected >= int(t0):
                return rec
        time.sleep(0.1)
    return {}


def operator_text(r: dict) -> str:
    """The operator's own record of the event, for comparison with the ground truth."""
    if r["operator_reason"] is None:
        return "operator: no lastRecovery for this event"
    return (f"operator: {r['operator_reason']} {r['operator_seconds']} s, step at detection "
            f"{r['operator_detected_step']}, resumed from {r['operator_resumed_from']}, lost {r['operator_lost']}")


def kill_own_trainers(tmp: Path) -> list[int]:
    """SIGKILL stand-in trainers whose command line names this run's ``tmp`` (their config lives there).

    Ray starts a job's entrypoint in its own session, so stopping the head's process group does not end it: without
    this, the last attempt's trainer would outlive the benchmark. Only processes of this run match."""
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "standin_trainer.py" in cmd and str(tmp) in cmd:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
                killed.append(int(proc.name))
            except ProcessLookupError:
                pass
    return killed


def trainer_pid(env) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{env.control_port}/status", timeout=5) as r:
        return int(json.loads(r.read())["pid"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="announced + abrupt events each (>= 5)")
    p.add_argument("--step-seconds", type=float, default=0.3, help="stand-in trainer seconds per step")
    p.add_argument("--interval", type=int, default=5, help="checkpoint.intervalSteps")
    args = p.parse_args(argv)
    if args.repeats < 5:
        p.error("--repeats must be >= 5")

    from operator_env import OperatorEnv
    from ray_head import start_ray_head

    print_load("start")
    t_start = time.time()
    head = start_ray_head(num_cpus=2)
    tmp = Path(tempfile.mkdtemp(prefix="daedalus-bench-recovery-"))
    env = OperatorEnv(tmp, head, step_seconds=args.step_seconds, poll=0.5)
    monitor = None
    rows: list[dict] = []
    try:
        env.start()
        for name in ("node-1", "node-2", "node-3"):
            env.fake.add_node(name)
        logging.getLogger().setLevel(logging.WARNING)
        for name in ("kopf", "kopf.objects", "daedalus_operator", "fake-kuberay"):
            logging.getLogger(name).setLevel(logging.ERROR)
        manifest = env.job_manifest(algorithm__steps=1_000_000, checkpoint__intervalSteps=args.interval,
                                    resilience__hyperPod=True, resilience__maxRestarts=1000,
                                    resilience__restartBackoffSeconds=1)
        t_apply = time.time()
        env.apply(manifest)
        env.wait_phase("Running", timeout=120)
        first = wait_new_attempt(env, 0)
        cluster = env.status()["rayClusterName"]
        expected = 1 + sum(int(g.get("replicas", 0)) for g in manifest["spec"]["cluster"]["workerGroups"])
        print(f"set-up {t_apply - t_start:.1f} s; job Running, first step {first['time'] - t_apply:.1f} s after "
              f"create; RayCluster {cluster} ({expected} pods); stand-in step {args.step_seconds} s, checkpoint every "
              f"{args.interval} steps", flush=True)
        monitor = Monitor(env.kube, "ml", cluster, expected).start()
        for rep in range(args.repeats):
            # 1. announced node replacement
            attempt = wait_steps_in_attempt(env, args.interval + 2)
            pods = env.kube.list("v1/pods", "ml", selector=f"ray.io/cluster={cluster}")
            role = "head" if rep % 2 == 0 else "worker"
            target = next(p["spec"]["nodeName"] for p in pods if p["metadata"]["labels"].get("ray.io/node-type") == role
                          and not p["metadata"].get("deletionTimestamp"))
            env.fake.add_node(f"spare-{rep}")
            t0 = time.time()
            env.fake.set_node_health(target, "UnschedulablePendingReplacement")
            r = measure(env, monitor, f"announced ({role} node)", t0, attempt, target)
            rows.append(r)
            print(f"  repeat {rep + 1} announced, {role} node {target}: stepping again after {r['seconds']:.2f} s "
                  f"({r['after_ready']:.2f} s after the cluster was ready again at +{r['ready_after_event']:.2f} s); "
                  f"lost {r['lost']} (last {r['last_old']}, resumed from {r['resumed_from']}); {operator_text(r)}", flush=True)
            env.kube.delete("v1/nodes", None, target)  # HyperPod replaced it: the spare took its place
            # 2. abrupt kill of the trainer process
            attempt = wait_steps_in_attempt(env, args.interval + 2)
            pid = trainer_pid(env)
            t0 = time.time()
            os.kill(pid, signal.SIGKILL)
            r = measure(env, monitor, "abrupt (SIGKILL)", t0, attempt, None)
            rows.append(r)
            print(f"  repeat {rep + 1} abrupt: stepping again after {r['seconds']:.2f} s; lost {r['lost']} "
                  f"(last {r['last_old']}, resumed from {r['resumed_from']}); {operator_text(r)}", flush=True)
        restarts = env.status().get("restarts")
    finally:
        if monitor:
            monitor.stop()
        try:
            env.stop()
        finally:
            head.stop()
            kill_own_trainers(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
    print_load("end")

    ann = [r for r in rows if r["kind"].startswith("announced")]
    abr = [r for r in rows if r["kind"].startswith("abrupt")]
    ann_s, ann_ready = summarize([r["seconds"] for r in ann]), summarize([r["after_ready"] for r in ann])
    abr_s = summarize([r["seconds"] for r in abr])
    print(f"\n== recovery, {args.repeats} announced + {args.repeats} abrupt events, median [min, max]; restarts "
          f"counted by the operator: {restarts} ==")
    print(f"announced: event -> stepping again         {ann_s.fmt(2, 's')}")
    print(f"announced: cluster ready -> stepping again {ann_ready.fmt(2, 's')}")
    print(f"announced: event -> cluster ready again    {summarize([r['ready_after_event'] for r in ann]).fmt(2, 's')}")
    print(f"announced: lost steps                      max {max(r['lost'] for r in ann)} (must be 0)")
    print(f"abrupt:    event -> stepping again         {abr_s.fmt(2, 's')}")
    print(f"abrupt:    lost steps                      {summarize([r['lost'] for r in abr]).fmt(1)}, "
          f"max {max(r['lost'] for r in abr)} (bound: checkpoint interval {args.interval})")
    print()
    print(f"recovery_abrupt: {abr_s.median:.2f} s to stepping again, lost max {max(r['lost'] for r in abr)} steps "
          f"(anchor: {TARGET_S:.0f} s target, {abr_s.median / TARGET_S:.2f}x of it; loss bound {args.interval})")
    print(f"recovery_announced: {ann_ready.median:.2f} s after the cluster is ready again, lost max "
          f"{max(r['lost'] for r in ann)} steps (anchor: {TARGET_S:.0f} s target, {ann_ready.median / TARGET_S:.2f}x "
          f"of it; lost must be 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
