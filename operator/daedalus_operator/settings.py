"""Operator-wide settings (command-line flags of ``daedalus operator``), passed to the builders and handlers.

Production defaults match the Helm chart: the operator runs in namespace ``daedalus-system`` with pod label
``app.kubernetes.io/name: daedalus``, the trainer serves on port 9400, the config is mounted at ``/etc/daedalus``
(the control token reaches the head container as an environment variable from the job's Secret). Tests change the
paths and ports (a shared machine: fixed ports collide) without changing any code path.
"""

from __future__ import annotations

import dataclasses
import os

from daedalus_operator import api


@dataclasses.dataclass(frozen=True)
class OperatorSettings:
    """Settings of one operator process.

    Attributes:
        operator_namespace: namespace of the operator's pods (NetworkPolicy source); ``$POD_NAMESPACE`` or
            ``daedalus-system``.
        operator_pod_labels: labels of the operator's pods (NetworkPolicy source).
        metrics_namespaces: namespaces (e.g. ``monitoring``) whose pods may also scrape the trainer's port.
        control_port: the trainer's metrics/control port on the head (9400).
        config_dir: mount path of the ConfigMap in the Ray pods.
        entrypoint: the Ray job entrypoint; ``{config}`` becomes ``<config_dir>/config.json``.
        poll_interval: seconds between looks at an active job (Ray job status, trainer /status, nodes).
        poll_budget: reconciles per second that the poll timer spends on quiet Running jobs, together (0: every job
            on every tick). A job is quiet when its last reconcile planned no action and no event and kept its phase
            (``handlers.is_quiet``); a quiet Running job is then reconciled every ``max(poll_interval, quiet Running
            jobs / poll_budget)`` seconds, a quiet job in another phase (waiting for its RayCluster, suspended, ended)
            every ``idle_resync`` seconds, and either at once when something it depends on changes (its
            body, pods, RayCluster, RayService, or the nodes of its pods). Only the time to notice what no
            Kubernetes object shows (a Ray job that failed, the trainer's step) grows with the number of jobs.
        idle_resync: seconds between looks at a quiet job outside ``Running`` whose dependencies did not change
            (a safety net for what a watch could miss; default ``handlers.IDLE_RESYNC_SECONDS``, 300).
        unreachable_grace: seconds an unanswering dashboard is tolerated before the head counts as lost.
        pod_ready_grace: seconds a Running job's pod may stay not Ready on a Ready node (its ``Ready`` condition's
            ``lastTransitionTime`` that long ago: a readiness probe failing under load) before it counts as lost
            (0: at once). A pod on a gone or NotReady node, a failed or replaced pod is lost at once whatever this is.
            While a job is Provisioning or Recovering, a pod Running but not Ready on a Ready node for longer than
            this (from the later of its Ready condition's flip and its containers' start; at least 60 s) is deleted so
            that KubeRay recreates it (0: never).
        request_timeout: seconds for one HTTP call to the Ray dashboard or the trainer.
        deletion_timeout: seconds after ``deletionTimestamp`` after which the finalizer is released whatever failed.
        watch_timeout: server-side watch timeout (``timeoutSeconds``) in seconds; the client gives up 30 s later and
            restarts a stream that delivered nothing for ``watch_timeout + 10`` s. ``None``: kopf's defaults.
        liveness_stale: the liveness probe fails once the API server has not answered for this many seconds.
        max_workers: threads for kopf's sync handlers.
        kubeconfig: explicit kubeconfig path (else in-cluster, ``$KUBECONFIG`` or ``~/.kube/config``).
    """

    operator_namespace: str = dataclasses.field(
        default_factory=lambda: os.environ.get("POD_NAMESPACE", "daedalus-system"))
    # as the chart labels the operator's pods (``daedalus.name``)
    operator_pod_labels: tuple[tuple[str, str], ...] = (("app.kubernetes.io/name", "daedalus"),)
    metrics_namespaces: tuple[str, ...] = ()
    control_port: int = api.CONTROL_PORT
    config_dir: str = api.CONFIG_DIR
    entrypoint: str = api.ENTRYPOINT
    poll_interval: float = 2.0
    poll_budget: float = 20.0
    idle_resync: float = 300.0
    unreachable_grace: float = 60.0
    pod_ready_grace: float = 60.0
    request_timeout: float = 5.0
    deletion_timeout: float = 120.0
    watch_timeout: int | None = None
    liveness_stale: float = 120.0
    max_workers: int = 8
    kubeconfig: str | None = None

    @property
    def config_path(self) -> str:
        """``<config_dir>/config.json``."""
        return f"{self.config_dir.rstrip('/')}/{api.CONFIG_KEY}"

    def render_entrypoint(self) -> str:
        """The Ray job entrypoint with the config path filled in."""
        return self.entrypoint.format(config=self.config_path)
