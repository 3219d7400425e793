"""The command line (``daedalus operator`` / ``python -m daedalus_operator``), the metric names other components rely
on, and kopf peering against the honest kmock API."""

from __future__ import annotations

import http.server
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_kuberay import wait_for
from operator_env import OperatorEnv
from prometheus_client import generate_latest

from daedalus_operator import api
from daedalus_operator.kube import KubeAPI, KubeError, api_client_from_environment
from daedalus_operator.main import build_parser, settings_from_args, wait_for_api_server
from daedalus_operator.metrics import OperatorMetrics

ROOT = Path(__file__).resolve().parents[2]


def test_arguments_become_settings() -> None:
    args = build_parser().parse_args(["-n", "ml", "-n", "team-*", "--peering", "daedalus", "--priority", "5",
                                      "--liveness", "http://0.0.0.0:8080/healthz", "--metrics-port", "9191",
                                      "--watch-timeout", "60", "--poll-interval", "1.5", "--control-port", "9500",
                                      "--operator-pod-label", "app=op", "--metrics-namespace", "monitoring",
                                      "--poll-budget", "5", "--idle-resync", "60"])
    assert args.namespace == ["ml", "team-*"] and args.peering == "daedalus" and args.priority == 5
    s = settings_from_args(args)
    assert (s.watch_timeout, s.poll_interval, s.control_port, s.poll_budget, s.idle_resync) == (60, 1.5, 9500, 5.0, 60.0)
    assert s.operator_pod_labels == (("app", "op"),) and s.metrics_namespaces == ("monitoring",)
    assert s.render_entrypoint() == "python -m daedalus_trainer train --config /etc/daedalus/config.json --resume latest"
    defaults = settings_from_args(build_parser().parse_args([]))
    assert defaults.control_port == api.CONTROL_PORT == 9400 and defaults.watch_timeout is None
    assert defaults.poll_budget == 20.0 and defaults.idle_resync == 300.0


@pytest.mark.parametrize("argv,message", [
    (["--operator-pod-label", "nokey"], "argument --operator-pod-label: expects KEY=VALUE, got 'nokey'"),
    (["--entrypoint", "python train.py"], "argument --entrypoint: must contain {config}"),
    (["--entrypoint", "python 'train.py {config}"], "argument --entrypoint: cannot be split as a shell command"),
    (["--poll-budget", "-1"], "argument --poll-budget: must be >= 0 reconciles per second (0: no limit), got -1"),
    (["--poll-budget", "nan"], "argument --poll-budget: must be a finite number of reconciles per second >= 0"),
    (["--idle-resync", "0"], "argument --idle-resync: must be > 0 seconds, got 0"),
    (["--poll-interval", "0"], "argument --poll-interval: must be > 0 seconds, got 0"),
    (["--poll-interval", "inf"], "argument --poll-interval: must be a finite number of seconds > 0, got 'inf'"),
    (["--poll-interval", "soon"], "argument --poll-interval: must be a finite number of seconds > 0, got 'soon'"),
    (["--request-timeout", "0"], "argument --request-timeout: must be > 0 seconds, got 0"),
    (["--request-timeout", "-5"], "argument --request-timeout: must be > 0 seconds, got -5"),
    (["--unreachable-grace", "-1"], "argument --unreachable-grace: must be >= 0 seconds (0: no grace), got -1"),
    (["--pod-ready-grace", "-1"], "argument --pod-ready-grace: must be >= 0 seconds (0: no grace), got -1"),
    (["--pod-ready-grace", "inf"], "argument --pod-ready-grace: must be a finite number of seconds >= 0"),
    (["--deletion-timeout", "-0.5"], "argument --deletion-timeout: must be >= 0 seconds (0: after one try), got -0.5"),
    (["--liveness-stale", "-1"], "argument --liveness-stale: must be >= 0 seconds"),
    (["--liveness-stale", "nan"], "argument --liveness-stale: must be a finite number of seconds >= 0"),
    (["--api-wait", "-1"], "argument --api-wait: must be >= 0 seconds (0: one try), got -1"),
    (["--api-wait", "later"], "argument --api-wait: must be a finite number of seconds >= 0"),
    (["--watch-timeout", "-5"], "argument --watch-timeout: must be >= 0 seconds (0: kopf's defaults), got -5"),
    (["--watch-timeout", "1.5"], "argument --watch-timeout: must be a whole number of seconds >= 0"),
    (["--metrics-port", "99999"], "argument --metrics-port: must be a port number 0-65535 (0: off), got 99999"),
    (["--metrics-port", "-1"], "argument --metrics-port: must be a port number 0-65535 (0: off), got -1"),
    (["--control-port", "0"], "argument --control-port: must be a port number 1-65535, got 0"),
    (["--control-port", "65536"], "argument --control-port: must be a port number 1-65535, got 65536"),
    (["--control-port", "http"], "argument --control-port: must be a port number 1-65535, got 'http'"),
    (["--liveness", "not-a-url"], "argument --liveness: must be a URL http://HOST:PORT/PATH (kopf serves only http), "
                                  "got 'not-a-url'"),
    (["--liveness", "https://0.0.0.0:8080/healthz"], "argument --liveness: must be a URL http://HOST:PORT/PATH"),
    (["--liveness", "http://0.0.0.0/healthz"], "argument --liveness: must be a URL http://HOST:PORT/PATH"),
    (["--liveness", "http://:8080/healthz"], "argument --liveness: must be a URL http://HOST:PORT/PATH"),
    (["--liveness", "http://0.0.0.0:99999/healthz"], "argument --liveness: must be a URL http://HOST:PORT/PATH"),
])
def test_bad_arguments_fail_clearly(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad flag value is an argparse error: the usage, one error line naming the flag and the bound, exit 2."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(f"daedalus operator: error: {message}"), err


def test_bounds_that_mean_something_are_accepted() -> None:
    """0 where it has a meaning (metrics off, kopf's watch defaults, no grace, release after one cleanup try, fail
    the probe at the first unanswered call) and the ends of the port range."""
    args = build_parser().parse_args(["--metrics-port", "0", "--watch-timeout", "0", "--unreachable-grace", "0",
                                      "--deletion-timeout", "0", "--liveness-stale", "0", "--control-port", "65535",
                                      "--liveness", "http://[::]:1/healthz", "--poll-interval", "0.01",
                                      "--api-wait", "0", "--pod-ready-grace", "0"])
    s = settings_from_args(args)
    assert (args.metrics_port, s.watch_timeout, s.unreachable_grace, s.deletion_timeout, s.liveness_stale,
            s.control_port, s.poll_interval, s.pod_ready_grace) == (0, 0, 0.0, 0.0, 0.0, 65535, 0.01, 0.0)
    assert settings_from_args(build_parser().parse_args([])).pod_ready_grace == 60.0
    assert settings_from_args(build_parser().parse_args(["--pod-ready-grace", "90"])).pod_ready_grace == 90.0
    assert build_parser().parse_args(["--control-port", "1", "--metrics-port", "65535"]).control_port == 1
    assert args.api_wait == 0.0 and build_parser().parse_args([]).api_wait == 30.0


def _operator(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daedalus_operator", "-A", *argv], capture_output=True, text=True,
                          timeout=60)


def test_bad_flag_exits_before_reading_the_kubeconfig(tmp_path: Path) -> None:
    """The argparse error (exit 2) comes before the client configuration is read (a missing file would exit 1)."""
    out = _operator("--kubeconfig", str(tmp_path / "missing.yaml"), "--liveness", "not-a-url")
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines()[-1] == ("daedalus operator: error: argument --liveness: must be a URL "
                                           "http://HOST:PORT/PATH (kopf serves only http), got 'not-a-url'")
    assert "Traceback" not in out.stderr and "Kubernetes" not in out.stderr


def test_unloadable_kubeconfig_exits_at_once_with_one_line(tmp_path: Path) -> None:
    """A missing or broken kubeconfig: exit 1 in seconds, naming the file, instead of kopf retrying its startup
    handler every minute with a traceback."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    for path in (tmp_path / "missing.yaml", broken):
        out = subprocess.run([sys.executable, "-m", "daedalus_operator", "-A", "--metrics-port", "0",
                              "--kubeconfig", str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1, out.stderr
        assert f"cannot load the Kubernetes client configuration from {path}" in out.stderr
        assert "Traceback" not in out.stderr
    assert _operator("--metrics-port", "0", "--kubeconfig", str(tmp_path / "missing.yaml")).stderr == (
        f"daedalus operator: cannot load the Kubernetes client configuration from {tmp_path / 'missing.yaml'}: "
        f"no such file\n")


def test_malformed_kubeconfig_exits_with_one_line(tmp_path: Path) -> None:
    """YAML the parser rejects: one line naming the file and the parser's line and column; YAML that is no mapping:
    one line naming the file. Exit 1, as for a missing file."""
    bad_yaml = tmp_path / "bad-yaml.yaml"
    bad_yaml.write_text("apiVersion: v1\nclusters: [\n  - {name: a\nkind: Config\n")
    not_a_mapping = tmp_path / "list.yaml"
    not_a_mapping.write_text("- apiVersion: v1\n")
    for path, why in ((bad_yaml, "not valid YAML: expected the node content, but found '-' at line 3, column 3"),
                      (not_a_mapping, "not a kubeconfig")):
        out = _operator("--metrics-port", "0", "--kubeconfig", str(path))
        assert out.returncode == 1, out.stderr
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith(f"daedalus operator: cannot load the Kubernetes client configuration from {path}: "
                                     f"{why}"), out.stderr


KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
"""


def test_metrics_port_in_use_exits_with_one_line(tmp_path: Path) -> None:
    """Another process listens on --metrics-port: one line naming the flag and the port, exit 1, before kopf starts
    (the kubeconfig loads; its API server is never asked)."""
    config = tmp_path / "kubeconfig.yaml"
    config.write_text(KUBECONFIG)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _operator("--kubeconfig", str(config), "--metrics-port", str(port))
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith(f"daedalus operator: --metrics-port {port} is in use"), out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr


def _kubeconfig(tmp_path: Path, server: str) -> Path:
    config = tmp_path / "kubeconfig.yaml"
    config.write_text(KUBECONFIG.replace("https://127.0.0.1:1", server))
    return config


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _APIServer:
    """A real HTTP server that answers every GET with the next status of ``statuses`` (the last one repeats) and a
    Kubernetes ``Status`` or ``APIGroupList`` body; it records the paths asked for."""

    def __init__(self, *statuses: int):
        self.statuses = list(statuses)
        self.paths: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                outer.paths.append(self.path)
                code = outer.statuses.pop(0) if len(outer.statuses) > 1 else outer.statuses[0]
                body = ({"kind": "APIGroupList", "apiVersion": "v1", "groups": []} if code == 200 else
                        {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                         "reason": {401: "Unauthorized", 503: "ServiceUnavailable"}.get(code, "Error")})
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_unreachable_api_server_exits_with_one_line_after_api_wait(tmp_path: Path) -> None:
    """Nothing listens at the kubeconfig's server: a warning per try for --api-wait seconds, then one line and exit
    1 (kopf alone retried for about a minute and printed 238 lines with five tracebacks)."""
    server = f"http://127.0.0.1:{_closed_port()}"
    config = _kubeconfig(tmp_path, server)
    started = time.monotonic()
    out = _operator("--kubeconfig", str(config), "--metrics-port", "0", "--api-wait", "3")
    took = time.monotonic() - started
    assert out.returncode == 1, out.stderr
    last = out.stderr.splitlines()[-1]
    assert last == (f"daedalus operator: cannot reach the Kubernetes API server at {server} after 2 tries in 3 s "
                    f"(--api-wait): Connection refused"), out.stderr
    warnings = [ln for ln in out.stderr.splitlines() if "does not answer (Connection refused)" in ln]
    assert len(warnings) == 1, out.stderr
    assert "Traceback" not in out.stderr and "kopf" not in out.stderr, out.stderr
    assert took < 30, took
    once = _operator("--kubeconfig", str(config), "--metrics-port", "0", "--api-wait", "0")
    assert once.returncode == 1 and once.stderr == (f"daedalus operator: cannot reach the Kubernetes API server at "
                                                    f"{server}: Connection refused\n"), once.stderr


def test_refused_credentials_exit_at_once(tmp_path: Path) -> None:
    """A 401 is not waited out: one line naming the server and the status, after one request."""
    api_server = _APIServer(401)
    try:
        out = _operator("--kubeconfig", str(_kubeconfig(tmp_path, api_server.url)), "--metrics-port", "0")
    finally:
        api_server.close()
    assert out.returncode == 1, out.stderr
    assert out.stderr == (f"daedalus operator: the Kubernetes API server at {api_server.url} refused the credentials "
                          f"(401 Unauthorized): check the kubeconfig's user or the service account and its RBAC\n")
    assert api_server.paths == ["/apis"]


def test_wait_for_api_server_waits_out_an_unavailable_server(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """503 twice, then the API groups: the wait returns after the third request, having warned twice."""
    api_server = _APIServer(503, 503, 200)
    try:
        client = api_client_from_environment(str(_kubeconfig(tmp_path, api_server.url)))
        with caplog.at_level(logging.WARNING):
            wait_for_api_server(KubeAPI(client), 30, interval=0.1)
    finally:
        api_server.close()
    assert api_server.paths == ["/apis"] * 3
    assert [r.getMessage().split(" (")[1].split(")")[0] for r in caplog.records] == ["503 ServiceUnavailable"] * 2


def test_kube_error_names_why_a_request_got_no_answer(tmp_path: Path) -> None:
    """KubeError.reason with no answer (status 0) is the innermost cause in a few words, for conditions, logs and
    the startup line: refused, unknown host, or a server that accepts and never replies (read timeout)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    cases = {f"http://127.0.0.1:{_closed_port()}": "Connection refused",
             "http://no-such-host.invalid": None,  # the resolver's words differ between libcs
             f"http://127.0.0.1:{silent.getsockname()[1]}": "timed out"}
    try:
        for i, (server, reason) in enumerate(cases.items()):
            (tmp_path / str(i)).mkdir()
            client = api_client_from_environment(str(_kubeconfig(tmp_path / str(i), server)))
            with pytest.raises(KubeError) as err:
                KubeAPI(client, timeout=0.5).api_groups()
            assert err.value.status == 0, server
            if reason is None:
                assert err.value.reason not in ("", "NewConnectionError", "MaxRetryError"), err.value.reason
                assert " " in err.value.reason, err.value.reason  # words, e.g. "Name or service not known"
            else:
                assert err.value.reason == reason, (server, err.value.reason)
    finally:
        silent.close()


def test_liveness_answers_degraded_in_time_when_the_api_server_is_silent(tmp_path: Path) -> None:
    """A server that accepts and never replies: the check answers "degraded" after LIVENESS_API_TIMEOUT, not after
    the client's 10 s request timeout (the kubelet's probe gives up at 5 s), and fails once nothing has answered for
    --liveness-stale seconds."""
    import kopf

    from daedalus_operator.handlers import LIVENESS_API_TIMEOUT, Runtime, liveness
    from daedalus_operator.settings import OperatorSettings

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    try:
        client = api_client_from_environment(str(_kubeconfig(tmp_path, f"http://127.0.0.1:{silent.getsockname()[1]}")))
        rt = Runtime(settings=OperatorSettings(liveness_stale=120.0), metrics=OperatorMetrics(),
                     kube=KubeAPI(client, timeout=10.0))
        started = time.monotonic()
        assert liveness(rt).startswith("degraded (")
        took = time.monotonic() - started
        assert LIVENESS_API_TIMEOUT - 0.1 <= took < LIVENESS_API_TIMEOUT + 1.5, took
        rt.last_api_ok -= 600
        with pytest.raises(kopf.PermanentError, match="has not answered for 6"):
            liveness(rt)
    finally:
        silent.close()


def test_kubeconfig_env_naming_a_missing_file_exits_with_one_line(tmp_path: Path) -> None:
    """$KUBECONFIG naming no file gets the same one line as --kubeconfig (the client said 'No configuration found.')."""
    missing = tmp_path / "gone.yaml"
    out = subprocess.run([sys.executable, "-m", "daedalus_operator", "--metrics-port", "0"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "KUBECONFIG": str(missing)})
    assert out.returncode == 1, out.stderr
    assert out.stderr == (f"daedalus operator: cannot load the Kubernetes client configuration from {missing}: "
                          f"no such file\n"), out.stderr


def test_exclusive_scopes() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["-n", "ml", "--all-namespaces"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--standalone", "--peering", "x"])


def _help(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--all-namespaces" in out.stdout and "--peering" in out.stdout and "--watch-timeout" in out.stdout
    # defaults that say something are shown; None / False / [] are not ("-A ... (default: False)" read as a contradiction)
    assert "(default: 30.0)" in out.stdout and "(default: daedalus-system)" in " ".join(out.stdout.split())
    assert "(default: None)" not in out.stdout and "(default: False)" not in out.stdout
    assert "(default: [])" not in out.stdout
    assert "exit status:" in out.stdout


def test_python_m_daedalus_operator_help() -> None:
    _help([sys.executable, "-m", "daedalus_operator", "--help"])


def test_daedalus_operator_passes_leading_options_through() -> None:
    _help([str(Path(sys.executable).parent / "daedalus"), "operator", "--standalone", "--help"])


def test_metric_names_and_labels() -> None:
    m = OperatorMetrics()
    m.observe_job("ml", "a", "Running", 2)
    m.observe_job("ml", "b", "Running", 0)
    m.observe_job("ml", "b", "Succeeded", 0)
    m.count_restart("ml", "a", "NodeReplacement")
    m.count_restart("ml", "b", "HeadLost")
    m.recovery_seconds.observe(12.5)
    m.reconciles.labels(result="ok").inc()
    m.reconcile_seconds.observe(0.02)
    text = generate_latest(m.registry).decode()
    for line in [
        'daedalus_operator_jobs{phase="Running"} 1.0', 'daedalus_operator_jobs{phase="Succeeded"} 1.0',
        'daedalus_operator_jobs{phase="Failed"} 0.0',
        'daedalus_operator_job_phase{job="a",namespace="ml",phase="Running"} 1.0',
        'daedalus_operator_job_phase{job="a",namespace="ml",phase="Pending"} 0.0',
        'daedalus_operator_job_phase{job="b",namespace="ml",phase="Running"} 0.0',
        'daedalus_operator_job_restarts{job="a",namespace="ml"} 2.0',
        'daedalus_operator_restarts_total{job="a",namespace="ml",reason="NodeReplacement"} 1.0',
        'daedalus_operator_recovery_seconds_bucket{le="20.0"} 1.0', 'daedalus_operator_recovery_seconds_sum 12.5',
        'daedalus_operator_reconciles_total{result="ok"} 1.0', 'daedalus_operator_reconciles_total{result="error"} 0.0',
        'daedalus_operator_reconciles_total{result="requeue"} 0.0', "daedalus_operator_reconcile_seconds_count 1.0",
    ]:
        assert line in text, line
    m.forget_job("ml", "a")
    text = generate_latest(m.registry).decode()
    # every per-job series of "a" is gone (the phase gauges, job_restarts, the restart counters); b's stay
    assert [ln for ln in text.splitlines() if 'job="a"' in ln] == []
    assert 'daedalus_operator_restarts_total{job="b",namespace="ml",reason="HeadLost"} 1.0' in text
    assert 'daedalus_operator_jobs{phase="Running"} 0.0' in text


def test_peering_with_priority(tmp_path: Path) -> None:
    env = OperatorEnv(tmp_path, None, poll=0.5, extra_args=("--peering", "daedalus", "--priority", "7"))
    env.start(operator=False, fake_kuberay=False)
    try:
        # the chart creates the peering object; kopf records itself in it with its priority
        env.kube.create("kopf.dev/v1/clusterkopfpeerings", None, {"metadata": {"name": "daedalus"}})
        args = [a for a in env.operator_args() if a != "--standalone"]
        env.operator_args = lambda: args  # type: ignore[method-assign]
        env.start_operator()
        peers = wait_for(lambda: (env.kube.get("kopf.dev/v1/clusterkopfpeerings", None, "daedalus") or {})
                         .get("status"), timeout=30, message="kopf's peering record")
        assert any(p.get("priority") == 7 for p in peers.values()), peers
        env.apply(env.job_manifest())
        env.wait_phase("Provisioning", timeout=30)  # the only peer is active
    finally:
        env.stop()
        time.sleep(0.1)
