"""The operator's Prometheus metrics (prometheus-client), served on ``--metrics-port`` (default 9090).

Names are a contract: dashboards and alerts (charts/daedalus) query them.

============================================== ========= ======================= ====================================
name                                           type      labels                  meaning
============================================== ========= ======================= ====================================
``daedalus_operator_reconciles_total``         counter   result=ok|error|requeue reconciles; ``error``: the status
                                                                                 write or an action failed;
                                                                                 ``requeue``: the job is active and
                                                                                 will be looked at again; ``ok``:
                                                                                 nothing left to do (terminal,
                                                                                 suspended)
``daedalus_operator_reconcile_seconds``        histogram                         wall time of one reconcile (seconds)
``daedalus_operator_jobs``                     gauge     phase                   RLTrainingJobs per phase (every
                                                                                 phase is exported, 0 when none)
``daedalus_operator_job_phase``                gauge     namespace, job, phase   1 for the job's current phase, 0 for
                                                                                 the others
``daedalus_operator_restarts_total``           counter   namespace, job, reason  resubmissions after a failure, by
                                                                                 the failure reason (NodeReplacement,
                                                                                 WorkerLost, ApplicationError, ...)
``daedalus_operator_recovery_seconds``         histogram                         detection of a failure -> the
                                                                                 resubmitted attempt completes a new
                                                                                 step (seconds)
``daedalus_operator_job_restarts``             gauge     namespace, job          ``status.restarts`` of the job
``daedalus_operator_poll_skips_total``         counter                           poll-timer ticks that did not
                                                                                 reconcile a quiet job
                                                                                 (``--poll-budget``)
``daedalus_operator_poll_wakes_total``         counter   reason=job|pods|nodes|  poll-timer ticks that reconciled a
                                                         raycluster|rayservice   quiet job before its interval was
                                                                                 over because what it depends on
                                                                                 changed (the first difference found)
``daedalus_operator_steady_poll_seconds``      gauge                             seconds between reconciles of a
                                                                                 quiet Running job
============================================== ========= ======================= ====================================

Each :class:`OperatorMetrics` has its own ``CollectorRegistry`` (several operators can live in one test process).
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from daedalus_operator.api import Phase

RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: The ``reason`` values of ``daedalus_operator_poll_wakes_total``, in the order they are checked
#: (:meth:`daedalus_operator.handlers.PollGate.changed`).
WAKE_REASONS = ("job", "pods", "nodes", "raycluster", "rayservice")
RECOVERY_BUCKETS = (5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)


class OperatorMetrics:
    """The metric objects and the bookkeeping behind the per-phase gauges."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reconciles = Counter("daedalus_operator_reconciles_total", "Reconciles of RLTrainingJobs by result.",
                                  ["result"], registry=r)
        self.reconcile_seconds = Histogram("daedalus_operator_reconcile_seconds",
                                           "Wall time of one reconcile in seconds.", buckets=RECONCILE_BUCKETS,
                                           registry=r)
        self.jobs = Gauge("daedalus_operator_jobs", "RLTrainingJobs per phase.", ["phase"], registry=r)
        self.job_phase = Gauge("daedalus_operator_job_phase", "1 for the job's current phase, 0 for the others.",
                               ["namespace", "job", "phase"], registry=r)
        self.restarts = Counter("daedalus_operator_restarts_total", "Resubmissions after a failure, by reason.",
                                ["namespace", "job", "reason"], registry=r)
        self.recovery_seconds = Histogram("daedalus_operator_recovery_seconds",
                                          "Failure detection to the first new step of the resubmitted attempt, "
                                          "in seconds.", buckets=RECOVERY_BUCKETS, registry=r)
        self.job_restarts = Gauge("daedalus_operator_job_restarts", "status.restarts of the job.",
                                  ["namespace", "job"], registry=r)
        self.poll_skips = Counter("daedalus_operator_poll_skips_total",
                                  "Timer ticks that did not reconcile: a quiet job, nothing it depends on changed "
                                  "and its steady poll interval not yet over.", registry=r)
        self.poll_wakes = Counter("daedalus_operator_poll_wakes_total",
                                  "Timer ticks that reconciled a quiet job before its interval was over, by what it "
                                  "depends on that changed first: job, pods, nodes, raycluster, rayservice.",
                                  ["reason"], registry=r)
        self.steady_poll_seconds = Gauge("daedalus_operator_steady_poll_seconds",
                                         "Seconds between reconciles of a quiet job: the poll interval, or longer "
                                         "when the quiet jobs would exceed the poll budget.", registry=r)
        for result in ("ok", "error", "requeue"):
            self.reconciles.labels(result=result)
        for reason in WAKE_REASONS:
            self.poll_wakes.labels(reason=reason)
        self._phases: dict[tuple[str, str], str] = {}
        self._restart_reasons: dict[tuple[str, str], set[str]] = {}
        self._lock = threading.Lock()
        self._refresh_jobs()
        self._server: Any = None

    def _refresh_jobs(self) -> None:
        counts = {p.value: 0 for p in Phase}
        for phase in self._phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        for phase, n in counts.items():
            self.jobs.labels(phase=phase).set(n)

    def observe_job(self, namespace: str, job: str, phase: str, restarts: int) -> None:
        """Record a job's current phase and restart count."""
        with self._lock:
            self._phases[(namespace, job)] = phase
            for p in Phase:
                self.job_phase.labels(namespace=namespace, job=job, phase=p.value).set(1 if p.value == phase else 0)
            self.job_restarts.labels(namespace=namespace, job=job).set(restarts)
            self._refresh_jobs()

    def count_restart(self, namespace: str, job: str, reason: str) -> None:
        """Count one resubmission of ``job`` after a failure of ``reason`` (``daedalus_operator_restarts_total``)."""
        with self._lock:
            self._restart_reasons.setdefault((namespace, job), set()).add(reason)
            self.restarts.labels(namespace=namespace, job=job, reason=reason).inc()

    def forget_job(self, namespace: str, job: str) -> None:
        """Drop a deleted job's series, its restart counters included: what Prometheus scraped stays in its storage
        (a range query over the job's life still sees the restarts), and an operator that runs for months does not
        export a series for every job it ever saw."""
        with self._lock:
            self._phases.pop((namespace, job), None)
            for reason in self._restart_reasons.pop((namespace, job), ()):
                try:
                    self.restarts.remove(namespace, job, reason)
                except KeyError:
                    pass
            for p in Phase:
                try:
                    self.job_phase.remove(namespace, job, p.value)
                except KeyError:
                    pass
            try:
                self.job_restarts.remove(namespace, job)
            except KeyError:
                pass
            self._refresh_jobs()

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``addr:port`` in a background thread.

        Raises:
            OSError: the address cannot be bound (the port is taken).
        """
        self._server = start_http_server(port, addr=addr, registry=self.registry)

    def shutdown(self) -> None:
        """Stop the HTTP server started by :meth:`serve` (prometheus-client >= 0.17 returns it)."""
        if isinstance(self._server, tuple):
            server, thread = self._server
            server.shutdown()
            server.server_close()
            thread.join(5)
        self._server = None
