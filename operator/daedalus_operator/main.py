"""``daedalus operator ARGS`` / ``python -m daedalus_operator ARGS``: run the operator with kopf.

Scope: ``--namespace NS`` (repeatable; globs like ``ml-*`` work as in kopf) or ``--all-namespaces`` (the default when
neither is given). High availability: ``--peering NAME --priority N`` (kopf peering: the highest priority operator
is active, the others pause) or ``--standalone`` (the default: no peering objects needed). Health: ``--liveness URL``
(kopf's endpoint, e.g. ``http://0.0.0.0:8080/healthz``; fails when the API server stopped answering). Metrics:
``--metrics-port`` (default 9090; 0 disables). Watches: ``--watch-timeout SECONDS`` (server-side watch timeout; a
stream silent for longer is restarted).

:func:`run` is the same with a stop flag and a ready flag, for tests that run the operator in a thread.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import threading
from typing import Any

import kopf

from daedalus_operator import api, kube
from daedalus_operator.handlers import IDLE_RESYNC_SECONDS, Runtime, register
from daedalus_operator.metrics import OperatorMetrics
from daedalus_operator.settings import OperatorSettings


class _QuietTimer(logging.Filter):
    """Drop kopf's "Timer 'poll' succeeded." / "Indexer '...' succeeded." lines (every poll, every pod event)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (record.levelno == logging.INFO and (msg.startswith("Timer 'poll' succeeded")
                                                        or (msg.startswith("Indexer '") and msg.endswith("succeeded."))))


#: ``--help``'s description: the module docstring's first paragraphs without their reStructuredText markup.
DESCRIPTION = "\n\n".join(__doc__.split("\n\n")[:2]).replace("``", "").replace(":func:", "")

def build_parser() -> argparse.ArgumentParser:
    """The operator's argument parser."""
    p = argparse.ArgumentParser(prog="daedalus operator", description=DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="serve this namespace (repeatable; kopf globs allowed)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="serve the whole cluster")
    ha = p.add_mutually_exclusive_group()
    ha.add_argument("--standalone", action="store_true",
                    help="no peering objects: one operator replica (also what happens without --peering)")
    ha.add_argument("--peering", metavar="NAME", help="kopf peering object name (KopfPeering/ClusterKopfPeering)")
    p.add_argument("--priority", type=int, default=0, help="peering priority (highest is active)")
    p.add_argument("--liveness", metavar="URL", default=None, help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0: off)")
    p.add_argument("--watch-timeout", type=int, default=None, metavar="SECONDS",
                   help="server-side watch timeout; silent streams are restarted after it")
    p.add_argument("--poll-interval", type=float, default=2.0, help="seconds between looks at an active job")
    p.add_argument("--poll-budget", type=float, default=20.0, metavar="PER_SECOND",
                   help="reconciles per second shared by quiet Running jobs (nothing planned last time; 0: every "
                        "job every poll): with more than poll-interval x budget of them each is looked at less "
                        "often, but at once when its pods, nodes, RayCluster or the job itself change; quiet jobs "
                        "in other phases (waiting for a RayCluster, ended) are looked at on such a change or every "
                        "--idle-resync seconds")
    p.add_argument("--idle-resync", type=float, default=IDLE_RESYNC_SECONDS, metavar="SECONDS",
                   help="with a poll budget: seconds between looks at a quiet job outside Running (waiting for "
                        "its RayCluster, suspended, ended) when nothing it depends on changed")
    p.add_argument("--unreachable-grace", type=float, default=60.0,
                   help="seconds an unanswering Ray dashboard is tolerated before the head counts as lost")
    p.add_argument("--request-timeout", type=float, default=5.0, help="seconds per HTTP call to Ray/the trainer")
    p.add_argument("--deletion-timeout", type=float, default=120.0,
                   help="release the finalizer after this many seconds even if cleanup failed")
    p.add_argument("--liveness-stale", type=float, default=120.0,
                   help="the liveness probe fails after this many seconds without an API answer")
    p.add_argument("--control-port", type=int, default=api.CONTROL_PORT, help="the trainer's control/metrics port")
    p.add_argument("--entrypoint", default=api.ENTRYPOINT,
                   help="Ray job entrypoint; {config} becomes the config file path")
    p.add_argument("--config-dir", default=api.CONFIG_DIR, help="ConfigMap mount path in the Ray pods")
    p.add_argument("--operator-namespace", default=os.environ.get("POD_NAMESPACE", "daedalus-system"),
                   help="namespace of the operator's pods (NetworkPolicy source)")
    p.add_argument("--operator-pod-label", action="append", default=[], metavar="KEY=VALUE",
                   help="label of the operator's pods (NetworkPolicy source; repeatable; without it "
                        "app.kubernetes.io/name=daedalus, as the chart labels them)")
    p.add_argument("--metrics-namespace", action="append", default=[], metavar="NS",
                   help="namespace allowed to scrape the trainer's port (e.g. monitoring; repeatable)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster or $KUBECONFIG)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def settings_from_args(args: argparse.Namespace) -> OperatorSettings:
    """Build :class:`OperatorSettings` from parsed arguments.

    Raises:
        SystemExit: a malformed ``--operator-pod-label``, a negative ``--poll-budget``, a ``--idle-resync`` that is
            not positive or an entrypoint without ``{config}``.
    """
    labels: list[tuple[str, str]] = []
    for item in args.operator_pod_label:
        if "=" not in item:
            raise SystemExit(f"--operator-pod-label expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        labels.append((k, v))
    if not args.poll_budget >= 0:
        raise SystemExit(f"--poll-budget must be >= 0 reconciles per second (0: no limit), got {args.poll_budget}")
    if not args.idle_resync > 0:
        raise SystemExit(f"--idle-resync must be > 0 seconds, got {args.idle_resync}")
    if "{config}" not in args.entrypoint:
        raise SystemExit(f"--entrypoint must contain {{config}} (the config file path): {args.entrypoint!r}")
    shlex.split(args.entrypoint)  # fail early on unbalanced quotes
    return OperatorSettings(
        operator_namespace=args.operator_namespace,
        operator_pod_labels=tuple(labels) or OperatorSettings().operator_pod_labels,
        metrics_namespaces=tuple(args.metrics_namespace),
        control_port=args.control_port,
        config_dir=args.config_dir,
        entrypoint=args.entrypoint,
        poll_interval=args.poll_interval,
        poll_budget=args.poll_budget,
        idle_resync=args.idle_resync,
        unreachable_grace=args.unreachable_grace,
        request_timeout=args.request_timeout,
        deletion_timeout=args.deletion_timeout,
        watch_timeout=args.watch_timeout,
        liveness_stale=args.liveness_stale,
        kubeconfig=args.kubeconfig,
    )


def check_kube_config(kubeconfig: str | None) -> Any:
    """Load the client configuration once, before kopf starts (whose startup handler would otherwise log a traceback
    and retry every minute for ever), and return the API client the operator then uses.

    Raises:
        SystemExit: one line naming where the configuration was looked for and why it failed.
    """
    import kubernetes

    from daedalus_operator.handlers import _in_cluster
    from daedalus_operator.kube import api_client_from_environment

    where = kubeconfig or os.environ.get("KUBECONFIG") or (
        "the in-cluster service account" if _in_cluster() else "~/.kube/config")
    try:
        return api_client_from_environment(kubeconfig)
    except (kubernetes.config.ConfigException, OSError, ValueError) as e:
        raise SystemExit(f"daedalus operator: cannot load the Kubernetes client configuration from {where}: {e}")


def run(argv: list[str], *, stop_flag: threading.Event | None = None, ready_flag: threading.Event | None = None,
        metrics: OperatorMetrics | None = None) -> Runtime:
    """Run the operator until ``stop_flag`` is set (or a signal, in the main thread). Returns the runtime
    (metrics, API client) for inspection."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("kopf.objects").addFilter(_QuietTimer())
        logging.getLogger("urllib3").setLevel(logging.WARNING)
    settings = settings_from_args(args)
    client = check_kube_config(settings.kubeconfig)
    metrics = metrics or OperatorMetrics()
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    # the startup handler keeps this client (it builds one only when none is given), so the kubeconfig is read once
    rt = Runtime(settings=settings, metrics=metrics, kube=kube.KubeAPI(client, timeout=settings.request_timeout * 2))
    registry = kopf.OperatorRegistry()
    register(registry, rt)
    namespaces = tuple(args.namespace)
    kwargs: dict[str, Any] = {
        "registry": registry,
        "clusterwide": not namespaces,
        "namespaces": namespaces,
        "standalone": args.peering is None,
        "priority": args.priority,
        "liveness_endpoint": args.liveness,
        "stop_flag": stop_flag,
        "ready_flag": ready_flag,
        "memo": kopf.Memo(runtime=rt),
    }
    if args.peering:
        kwargs["peering_name"] = args.peering
    try:
        kopf.run(**kwargs)
    finally:
        metrics.shutdown()
    return rt


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``daedalus operator`` and ``python -m daedalus_operator``; returns the exit code."""
    import sys

    run(list(sys.argv[1:] if argv is None else argv))
    return 0
