"""Exporters and a real Prometheus for the observability tests.

Each exporter fixture returns an :class:`Exporter`: a live `/metrics` endpoint on a loopback port plus `drive()`,
which produces the activity (steps, checkpoints, reconciles, restarts) once Prometheus is already scraping it, so that
rate()/increase() panels see increments exactly as they would in a cluster. A fixture that cannot build its exporter
returns `Missing(reason)` and only the panels that need it skip.

Today the trainer exporter drives the real `daedalus_trainer.metrics.TrainerMetrics` served by the trainer's real HTTP
endpoint (`daedalus_trainer.server.TrainerServer`), and the operator exporter drives the real
`daedalus_operator.metrics.OperatorMetrics` (its `observe_job` bookkeeping and metric objects) served by its own
`serve()`. To prove the dashboards against a real (tiny) training run instead,
override `trainer_exporter` so that `drive()` runs a few steps of the trainer serving on `address`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from obslib import RULES, Prometheus, require_binary

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


@dataclasses.dataclass
class _Checkpoint:
    """What TrainerMetrics.observe_checkpoint reads (checkpoint.CheckpointInfo has the same fields)."""

    step: int
    time: float
    bytes: int
    seconds: float


@pytest.fixture(scope="session")
def trainer_exporter() -> Iterator[Exporter | Missing]:
    try:
        from daedalus_trainer.metrics import StepStats, TrainerMetrics
    except ImportError as exc:
        yield Missing(f"waiting for trainer metrics module (daedalus_trainer.metrics): {exc}")
        return
    metrics = TrainerMetrics(JOB, NAMESPACE, total_steps=12, checkpoint_interval=2)
    stop: Callable[[], None]
    try:
        from daedalus_trainer.server import ControlState, TrainerServer
        server = TrainerServer(metrics, ControlState(total_steps=12), host="127.0.0.1", port=0).start()
        address, stop = f"127.0.0.1:{server.port}", server.stop
    except ImportError:  # the HTTP endpoint module is optional here: serve the same registry with prometheus-client
        from prometheus_client import start_http_server
        httpd, _ = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
        address, stop = f"127.0.0.1:{httpd.server_port}", httpd.shutdown

    def drive() -> None:
        # Six steps of a tiny CPU run (numbers in the range the tiny model shows), a checkpoint every 2 steps and an
        # evaluation at steps 3 and 6.
        for step in range(1, 7):
            success = 0.25 + 0.05 * step
            metrics.observe_step(StepStats(
                step=step, success_ratio=success, reward_mean=success, episode_turns=6.0 - 0.3 * step,
                rollout_tokens=640 + 8 * step, zero_variance_groups=1 if step % 3 else 0,
                rollout_seconds=0.8 + 0.01 * step, learner_seconds=0.12, kl=0.001 * step,
                loss=0.05 - 0.004 * step, grad_norm=0.9 - 0.05 * step))
            if step % 2 == 0:
                metrics.observe_checkpoint(_Checkpoint(step=step, time=time.time(), bytes=3_400_000 + step,
                                                       seconds=0.04 + 0.001 * step))
            if step % 3 == 0:
                metrics.observe_eval(0.2 + 0.05 * step)
            time.sleep(TICK)

    yield Exporter(address=address, drive=drive)
    stop()


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
            metrics.reconciles.labels(result="requeue").inc(3)
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
            prom.wait_for(f'up{{job="{job}"}} == 1')
        threads = [threading.Thread(target=e.drive, name=f"drive-{job}") for job, e in live.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(2 * TICK + 0.5)  # two more scrapes after the last event, and a rule evaluation
        yield prom
    finally:
        prom.stop()
