"""Exporters and a real Prometheus for the observability tests.

Each exporter fixture returns an :class:`Exporter`: a live `/metrics` endpoint on a loopback port plus `drive()`,
which produces the activity (steps, checkpoints, reconciles, restarts) once Prometheus is already scraping it, so that
rate()/increase() panels see increments exactly as they would in a cluster. A fixture that cannot build its exporter
returns `Missing(reason)` and only the panels that need it skip.

The trainer exporter is a real tiny training run (`daedalus train` in its own process, local Ray) serving its real
endpoint; the operator exporter drives the real `daedalus_operator.metrics.OperatorMetrics` (its `observe_job`
bookkeeping and metric objects) served by its own `serve()`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from obslib import QUEUED_JOB, QUEUED_NAMESPACE, RULES, Prometheus, require_binary
from ray_head import free_port

#: RLTrainingJob identity the exporters report (labels `job` and `namespace`).
JOB = "maze-tiny"
NAMESPACE = "ml-team"
#: Seconds between driven events: more than the 1 s scrape interval, so every event lands in its own scrape.
TICK = 1.1


@dataclasses.dataclass
class Exporter:
    """A live metrics endpoint. `address` is host:port; `drive()` blocks while it produces activity."""

    address: str
    drive: Callable[[], None]
    job: str = JOB
    namespace: str = NAMESPACE


@dataclasses.dataclass
class Missing:
    """An exporter that could not be built; panels needing it skip with `reason`."""

    reason: str


@pytest.fixture(scope="session")
def trainer_exporter(sft_start, tmp_path_factory) -> Iterator[Exporter | Missing]:
    """A real tiny training run: `daedalus train` as the Ray job runs it (its own process, a local Ray), 6 GRPO steps
    from a short SFT start, a checkpoint every 2 steps, a held-out evaluation every 3; Prometheus scrapes its
    endpoint while it trains. `drive()` waits for the run to finish."""
    import json
    import os
    import subprocess
    import sys

    from support.jobs import tiny_job_dict

    # klCoef > 0 so the learner runs the reference forward and the KL panel has a real value; one rollout worker:
    # the metrics are the same, the actors start sooner.
    job = tiny_job_dict(algorithm={"steps": 6, "evalIntervalSteps": 3, "klCoef": 0.01, "rolloutWorkers": 1},
                        checkpoint={"intervalSteps": 2})
    job["metadata"] = {"name": JOB, "namespace": NAMESPACE}
    job["spec"]["model"]["sftAdapter"] = str(sft_start)
    work = tmp_path_factory.mktemp("trainer-run")
    (work / "config.json").write_text(json.dumps(job))
    port = free_port()
    env = dict(os.environ, DAEDALUS_METRICS_PORT=str(port), DAEDALUS_METRICS_HOST="127.0.0.1",
               DAEDALUS_CONTROL_TOKEN="t", OMP_NUM_THREADS="1", DAEDALUS_METRICS_LINGER_SECONDS="900")
    env.pop("RAY_ADDRESS", None)
    log = open(work / "trainer.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "daedalus_trainer", "train", "--config", str(work / "config.json"),
                             "--out", str(work / "run")], env=env, stdout=log, stderr=subprocess.STDOUT)

    def drive() -> None:
        import requests

        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            assert proc.poll() is None, (work / "trainer.log").read_text()[-3000:]
            try:
                if requests.get(f"http://127.0.0.1:{port}/status", timeout=2).json()["phase"] == "finished":
                    return  # the process lingers, serving its final figures to Prometheus
            except requests.RequestException:
                pass
            time.sleep(1)
        raise AssertionError("the training run did not finish in 900 s")

    try:
        yield Exporter(address=f"127.0.0.1:{port}", drive=drive)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="session")
def operator_exporter() -> Iterator[Exporter | Missing]:
    try:
        from daedalus_operator.metrics import OperatorMetrics
    except ImportError as exc:
        yield Missing(f"waiting for operator metrics module (daedalus_operator.metrics): {exc}")
        return
    metrics = OperatorMetrics()
    metrics.serve(0, addr="127.0.0.1")
    httpd = metrics._server[0]   # prometheus-client's (server, thread); the port is the bound one

    def drive() -> None:
        # One job's life as the operator records it: provisioning, running, a lost worker, recovery, running again.
        phases = ["Pending", "Provisioning", "Running", "Recovering", "Running", "Running"]
        restarts = 0
        for tick, phase in enumerate(phases):
            if tick == 3:
                metrics.restarts.labels(namespace=NAMESPACE, job=JOB, reason="WorkerLost").inc()
                metrics.reconciles.labels(result="error").inc()
                restarts += 1
            if tick == 4:
                metrics.recovery_seconds.observe(42.0)
            metrics.observe_job(NAMESPACE, JOB, phase, restarts)
            metrics.observe_job(QUEUED_NAMESPACE, QUEUED_JOB, "Pending", 0)
            metrics.reconciles.labels(result="requeue").inc(3)
            # Quiet while training (not on tick 4, just after the recovery): the poll budget skips its ticks.
            if phase == "Running" and tick != 4:
                metrics.steady_poll_seconds.set(5.0)
                metrics.poll_skips.inc(4)
            if tick == 5:  # a pod of the quiet job changed: one tick reconciles it early
                metrics.poll_wakes.labels(reason="pods").inc()
            for seconds in (0.02, 0.05, 0.3):
                metrics.reconcile_seconds.observe(seconds)
            time.sleep(TICK)

    yield Exporter(address=f"127.0.0.1:{httpd.server_port}", drive=drive)
    metrics.shutdown()


@pytest.fixture(scope="session")
def exporters(trainer_exporter: Exporter | Missing, operator_exporter: Exporter | Missing) -> dict[str, Any]:
    """Scrape job name -> exporter. The names are the ones the rules and dashboards select on."""
    return {"daedalus-trainer": trainer_exporter, "daedalus-operator": operator_exporter}


@pytest.fixture(scope="session")
def prometheus(exporters: dict[str, Exporter | Missing],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """A real Prometheus (Debian package) with the chart's rules, after every live exporter was driven."""
    live = {job: e for job, e in exporters.items() if isinstance(e, Exporter)}
    if not live:
        pytest.skip("; ".join(e.reason for e in exporters.values()))
    binary = require_binary("prometheus")
    prom = Prometheus(binary, tmp_path_factory.mktemp("prometheus"), {j: e.address for j, e in live.items()},
                      [RULES])
    try:
        prom.wait_ready()
        for job in live:
            # The trainer's endpoint comes up once `daedalus train` has imported torch and started its local Ray.
            # In session 31's failed make test (a loaded 2-core machine, two kube-apiservers beside it) the trainer
            # log shows 14 s from Ray's first line to "Ray started" and the endpoint 3 s later; with the imports
            # before that (launch is not logged), the 30 s this waited before ran out.
            prom.wait_for(f'up{{job="{job}"}} == 1', timeout=180.0)
        threads = [threading.Thread(target=e.drive, name=f"drive-{job}") for job, e in live.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(2 * TICK + 0.5)  # two more scrapes after the last event, and a rule evaluation
        yield prom
    finally:
        prom.stop()
