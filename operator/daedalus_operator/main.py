"""``daedalus operator ARGS`` / ``python -m daedalus_operator ARGS``: run the operator with kopf.

Scope: ``--namespace NS`` (repeatable; globs like ``ml-*`` work as in kopf) or ``--all-namespaces`` (the default when
neither is given). High availability: ``--peering NAME --priority N`` (kopf peering: the highest priority operator
is active, the others pause) or ``--standalone`` (the default: no peering objects needed). Health: ``--liveness URL``
(kopf's endpoint, e.g. ``http://0.0.0.0:8080/healthz``; fails when the API server stopped answering). Metrics:
``--metrics-port`` (default 9090; 0 disables). Watches: ``--watch-timeout SECONDS`` (server-side watch timeout; a
stream silent for longer is restarted). Start: ``--api-wait SECONDS`` (how long to wait for the API server to answer
before exiting with one line; default 30, inside the chart's liveness-probe window).

:func:`run` is the same with a stop flag and a ready flag, for tests that run the operator in a thread.
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import shlex
import threading
import time
import urllib.parse
from typing import Any, Callable

import kopf
import yaml

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


def _number(unit: str, *, positive: bool, zero: str = "") -> Callable[[str], float]:
    """An argparse ``type``: a finite number of ``unit`` (e.g. seconds), > 0 when ``positive``, else >= 0 (``zero``
    says what 0 means, for the message).

    The returned function raises ``argparse.ArgumentTypeError`` (argparse prints it with the usage and exits 2)."""
    bound = "> 0" if positive else ">= 0"
    meaning = f" ({zero})" if zero else ""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number of {unit} {bound}{meaning}, got {text!r}")
        if not (value > 0 if positive else value >= 0):
            raise argparse.ArgumentTypeError(f"must be {bound} {unit}{meaning}, got {text}")
        return value

    return parse


def _whole_seconds(zero: str) -> Callable[[str], int]:
    """An argparse ``type``: a whole number of seconds >= 0 (``zero`` says what 0 means).

    The returned function raises ``argparse.ArgumentTypeError``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number of seconds >= 0 ({zero}), got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0 seconds ({zero}), got {text}")
        return value

    return parse


def _port(zero: str = "") -> Callable[[str], int]:
    """An argparse ``type``: a TCP port, 1-65535, or 0-65535 when 0 means something (``zero``).

    The returned function raises ``argparse.ArgumentTypeError``."""
    low = 0 if zero else 1
    meaning = f" ({zero})" if zero else ""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a port number {low}-65535{meaning}, got {text!r}") from None
        if not low <= value <= 65535:
            raise argparse.ArgumentTypeError(f"must be a port number {low}-65535{meaning}, got {text}")
        return value

    return parse


def _liveness_url(text: str) -> str:
    """An argparse ``type``: kopf's liveness endpoint, ``http://HOST:PORT/PATH`` (kopf serves only plain http).

    Raises:
        argparse.ArgumentTypeError: another scheme, no host, or no port (or one outside 1-65535).
    """
    parts = urllib.parse.urlsplit(text)
    try:
        port = parts.port
    except ValueError:  # not a number, or outside 0-65535
        port = None
    if parts.scheme != "http" or not parts.hostname or not port:
        raise argparse.ArgumentTypeError(f"must be a URL http://HOST:PORT/PATH (kopf serves only http), got {text!r}")
    return text


def _pod_label(text: str) -> str:
    """An argparse ``type``: ``KEY=VALUE`` (kept as given; :func:`settings_from_args` splits it).

    Raises:
        argparse.ArgumentTypeError: no ``=``.
    """
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expects KEY=VALUE, got {text!r}")
    return text


def _entrypoint(text: str) -> str:
    """An argparse ``type``: a Ray job entrypoint containing ``{config}``, with balanced shell quotes.

    Raises:
        argparse.ArgumentTypeError: no ``{config}``, or ``shlex`` cannot split it.
    """
    if "{config}" not in text:
        raise argparse.ArgumentTypeError(f"must contain {{config}} (the config file path), got {text!r}")
    try:
        shlex.split(text)
    except ValueError as e:  # unbalanced quotes
        raise argparse.ArgumentTypeError(f"cannot be split as a shell command ({e}): {text!r}") from None
    return text


#: ``--api-wait``'s default (seconds): with the last try's request timeout, shorter than the chart's liveness probe
#: takes to restart the container (the third failed probe: 10 s initial delay + 2 x 20 s = 50 s), so that the
#: operator's own one-line reason is logged first (tests/charts/test_chart.py checks the two against each other).
API_WAIT_SECONDS = 30.0

#: ``--help``'s epilog: what the exit codes mean.
EXIT_STATUS = """exit status:
  0  stopped by a signal (SIGTERM, Ctrl-C)
  1  the kubeconfig cannot be loaded, --metrics-port cannot be bound, or the API server does not answer within
     --api-wait seconds or refuses the credentials: one line says which
  2  a bad flag value (argparse)"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Flag defaults in the help (only those that say something: not None, False or an empty list), and the
    description and epilog as written (the epilog is a table)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, []):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The operator's argument parser. Every flag's value is checked here: a bad one is an argparse error (the usage,
    one ``daedalus operator: error: argument --FLAG: ...`` line, exit code 2) before any Kubernetes or network work."""
    p = argparse.ArgumentParser(prog="daedalus operator", description=DESCRIPTION, epilog=EXIT_STATUS,
                                formatter_class=_HelpFormatter)
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="serve this namespace (repeatable; kopf globs allowed)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="serve the whole cluster")
    ha = p.add_mutually_exclusive_group()
    ha.add_argument("--standalone", action="store_true",
                    help="no peering objects: one operator replica (also what happens without --peering)")
    ha.add_argument("--peering", metavar="NAME", help="kopf peering object name (KopfPeering/ClusterKopfPeering)")
    p.add_argument("--priority", type=int, default=0, help="peering priority (highest is active)")
    p.add_argument("--liveness", metavar="URL", type=_liveness_url, default=None,
                   help="liveness endpoint http://HOST:PORT/PATH (http only), e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--metrics-port", type=_port(zero="0: off"), default=9090, metavar="PORT",
                   help="Prometheus /metrics port, 0-65535 (0: off)")
    p.add_argument("--watch-timeout", type=_whole_seconds(zero="0: kopf's defaults"), default=None, metavar="SECONDS",
                   help="server-side watch timeout; silent streams are restarted after it (unset or 0: kopf's "
                        "defaults)")
    p.add_argument("--poll-interval", type=_number("seconds", positive=True), default=2.0, metavar="SECONDS",
                   help="seconds between looks at an active job (> 0)")
    p.add_argument("--poll-budget", type=_number("reconciles per second", positive=False, zero="0: no limit"),
                   default=20.0, metavar="PER_SECOND",
                   help="reconciles per second shared by quiet Running jobs (nothing planned last time; 0: every "
                        "job every poll): with more than poll-interval x budget of them each is looked at less "
                        "often, but at once when its pods, nodes, RayCluster or the job itself change; quiet jobs "
                        "in other phases (waiting for a RayCluster, ended) are looked at on such a change or every "
                        "--idle-resync seconds")
    p.add_argument("--idle-resync", type=_number("seconds", positive=True), default=IDLE_RESYNC_SECONDS,
                   metavar="SECONDS",
                   help="with a poll budget: seconds between looks at a quiet job outside Running (waiting for "
                        "its RayCluster, suspended, ended) when nothing it depends on changed (> 0)")
    p.add_argument("--unreachable-grace", type=_number("seconds", positive=False, zero="0: no grace"), default=60.0,
                   metavar="SECONDS",
                   help="seconds an unanswering Ray dashboard is tolerated before the head counts as lost (>= 0; "
                        "0: lost at the second unanswered look)")
    p.add_argument("--pod-ready-grace", type=_number("seconds", positive=False, zero="0: no grace"), default=60.0,
                   metavar="SECONDS",
                   help="seconds a Running job's pod may stay not Ready on a Ready node (a readiness probe failing "
                        "under load) before it counts as lost; then the trainer, if it answers, checkpoints before "
                        "the stop (>= 0; 0: lost at once; a pod on a gone or NotReady node is always lost at once); "
                        "while a job provisions or recovers, a pod Running but not Ready that long on a Ready node is "
                        "deleted for KubeRay to recreate (at least 60 s; 0: never)")
    p.add_argument("--request-timeout", type=_number("seconds", positive=True), default=5.0, metavar="SECONDS",
                   help="seconds per HTTP call to Ray/the trainer (> 0; calls to the API server get twice this)")
    p.add_argument("--deletion-timeout", type=_number("seconds", positive=False, zero="0: after one try"),
                   default=120.0, metavar="SECONDS",
                   help="release the finalizer after this many seconds even if cleanup failed (>= 0; 0: after "
                        "one cleanup try)")
    p.add_argument("--liveness-stale", type=_number("seconds", positive=False, zero="0: at the first unanswered call"),
                   default=120.0, metavar="SECONDS",
                   help="the liveness probe fails after this many seconds without an API answer (>= 0; 0: at the "
                        "first unanswered call)")
    p.add_argument("--control-port", type=_port(), default=api.CONTROL_PORT, metavar="PORT",
                   help="the trainer's control/metrics port, 1-65535")
    p.add_argument("--entrypoint", type=_entrypoint, default=api.ENTRYPOINT,
                   help="Ray job entrypoint; {config} becomes the config file path")
    p.add_argument("--config-dir", default=api.CONFIG_DIR, help="ConfigMap mount path in the Ray pods")
    p.add_argument("--operator-namespace", default=os.environ.get("POD_NAMESPACE", "daedalus-system"),
                   help="namespace of the operator's pods (NetworkPolicy source)")
    p.add_argument("--operator-pod-label", action="append", type=_pod_label, default=[], metavar="KEY=VALUE",
                   help="label of the operator's pods (NetworkPolicy source; repeatable; without it "
                        "app.kubernetes.io/name=daedalus, as the chart labels them)")
    p.add_argument("--metrics-namespace", action="append", default=[], metavar="NS",
                   help="namespace allowed to scrape the trainer's port (e.g. monitoring; repeatable)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster or $KUBECONFIG)")
    p.add_argument("--api-wait", type=_number("seconds", positive=False, zero="0: one try"), default=API_WAIT_SECONDS,
                   metavar="SECONDS",
                   help="at start, seconds to wait for the API server to answer before exiting with one line "
                        "(>= 0; 0: one try); wrong credentials exit at once")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def settings_from_args(args: argparse.Namespace) -> OperatorSettings:
    """Build :class:`OperatorSettings` from arguments parsed by :func:`build_parser` (which checked every value)."""
    labels: list[tuple[str, str]] = []
    for item in args.operator_pod_label:
        k, v = item.split("=", 1)
        labels.append((k, v))
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
        pod_ready_grace=args.pod_ready_grace,
        request_timeout=args.request_timeout,
        deletion_timeout=args.deletion_timeout,
        watch_timeout=args.watch_timeout,
        liveness_stale=args.liveness_stale,
        kubeconfig=args.kubeconfig,
    )


def _yaml_problem(e: yaml.YAMLError) -> str:
    """One line from a PyYAML error (whose text spans several lines): the problem, where (1-based line and column,
    as the parser counts) and its context."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem and e.problem_mark is not None:
        mark = e.problem_mark
        context = f" ({e.context})" if e.context else ""
        return f"not valid YAML: {e.problem} at line {mark.line + 1}, column {mark.column + 1}{context}"
    return "not valid YAML: " + " ".join(str(e).split())


def check_kube_config(kubeconfig: str | None) -> Any:
    """Load the client configuration once, before kopf starts (whose startup handler would otherwise log a traceback
    and retry every minute for ever), and return the API client the operator then uses.

    Raises:
        SystemExit: one line naming where the configuration was looked for and why it failed (a missing or
            incomplete file, YAML the parser rejects with its line and column, or YAML that is not a kubeconfig
            mapping).
    """
    import kubernetes

    from daedalus_operator.handlers import _in_cluster
    from daedalus_operator.kube import api_client_from_environment

    where = kubeconfig or os.environ.get("KUBECONFIG") or (
        "the in-cluster service account" if _in_cluster() else "~/.kube/config")
    prefix = f"daedalus operator: cannot load the Kubernetes client configuration from {where}"
    # the client would say "No configuration found."; $KUBECONFIG may list several files (it skips missing ones)
    named = [kubeconfig] if kubeconfig else [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    if named and not any(os.path.exists(os.path.expanduser(p)) for p in named):
        raise SystemExit(f"{prefix}: no such file" + ("" if len(named) == 1 else "s"))
    try:
        return api_client_from_environment(kubeconfig)
    except (kubernetes.config.ConfigException, OSError, ValueError) as e:
        raise SystemExit(f"{prefix}: {e}") from None
    except yaml.YAMLError as e:
        raise SystemExit(f"{prefix}: {_yaml_problem(e)}") from None
    except (TypeError, AttributeError) as e:  # valid YAML, but a list or a string where the client expects a mapping
        raise SystemExit(f"{prefix}: not a kubeconfig (a mapping with clusters, contexts and users): {e}") from None


def wait_for_api_server(api_: kube.KubeAPI, wait: float, *, interval: float = 2.0,
                        log: logging.Logger | None = None) -> None:
    """Ask the API server for its API groups (``GET /apis``, what kopf's first request is too) until it answers,
    for at most ``wait`` seconds (0: one try), so that an unreachable server or refused credentials give one line
    instead of kopf's minute of retries and its aiohttp tracebacks.

    A request that gets no answer (connection refused, DNS, TLS, ``api_.timeout`` seconds without a reply) or a 5xx is
    retried every ``interval`` seconds and logged once per attempt; 401 and 403 are final at once (waiting does not
    mend credentials or RBAC).

    Raises:
        SystemExit: one line naming the server and why (code 1).
    """
    log = log or logging.getLogger("daedalus_operator")
    server = api_.client.configuration.host
    deadline = time.monotonic() + wait
    attempt = 0
    while True:
        attempt += 1
        try:
            api_.api_groups()
            return
        except kube.KubeError as e:
            if e.status in (401, 403):
                what = "refused the credentials" if e.status == 401 else "forbids API discovery to this identity"
                raise SystemExit(f"daedalus operator: the Kubernetes API server at {server} {what} ({e.status} "
                                 f"{e.reason}): check the kubeconfig's user or the service account and its RBAC"
                                 ) from None
            why = e.reason if e.status == 0 else f"{e.status} {e.reason}"
            if e.status not in (0, 500, 502, 503, 504) or time.monotonic() + interval > deadline:
                waited = f" after {attempt} tries in {wait:g} s (--api-wait)" if attempt > 1 else ""
                raise SystemExit(f"daedalus operator: cannot reach the Kubernetes API server at {server}{waited}: "
                                 f"{why}") from None
            log.warning("the Kubernetes API server at %s does not answer (%s); trying again for up to %.0f s",
                        server, why, max(0.0, deadline - time.monotonic()))
            time.sleep(interval)


def serve_metrics(metrics: OperatorMetrics, port: int) -> None:
    """``metrics.serve(port)`` on all addresses.

    Raises:
        SystemExit: one line naming the port and ``--metrics-port`` when it cannot be bound (in use, or a privileged
            port without the permission).
    """
    try:
        metrics.serve(port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise SystemExit(f"daedalus operator: --metrics-port {port} is in use (another process listens on it; "
                             f"choose another port, or 0 to turn metrics off)") from None
        raise SystemExit(f"daedalus operator: cannot serve metrics on --metrics-port {port}: "
                         f"{e.strerror or e}") from None


def run(argv: list[str], *, stop_flag: threading.Event | None = None, ready_flag: threading.Event | None = None,
        metrics: OperatorMetrics | None = None) -> Runtime:
    """Run the operator until ``stop_flag`` is set (or a signal, in the main thread). Returns the runtime
    (metrics, API client) for inspection.

    Raises:
        SystemExit: a bad flag value (argparse: code 2), or one line with code 1 when the Kubernetes client
            configuration cannot be loaded, ``--metrics-port`` cannot be bound, or the API server does not answer
            within ``--api-wait`` seconds or refuses the credentials.
    """
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
        serve_metrics(metrics, args.metrics_port)
    # the startup handler keeps this client (it builds one only when none is given), so the kubeconfig is read once
    kube_api = kube.KubeAPI(client, timeout=settings.request_timeout * 2)
    try:
        wait_for_api_server(kube_api, args.api_wait)
    except SystemExit:
        metrics.shutdown()
        raise
    rt = Runtime(settings=settings, metrics=metrics, kube=kube_api)
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
