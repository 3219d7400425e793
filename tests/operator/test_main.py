"""The command line (``daedalus operator`` / ``python -m daedalus_operator``), the metric names other components rely
on, and kopf peering against the honest kmock API."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_kuberay import wait_for
from operator_env import OperatorEnv
from prometheus_client import generate_latest

from daedalus_operator import api
from daedalus_operator.main import build_parser, settings_from_args
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
    (["--operator-pod-label", "nokey"], "KEY=VALUE"),
    (["--entrypoint", "python train.py"], "{config}"),
    (["--poll-budget", "-1"], "--poll-budget must be >= 0"),
    (["--poll-budget", "nan"], "--poll-budget must be >= 0"),
    (["--idle-resync", "0"], "--idle-resync must be > 0"),
])
def test_bad_arguments_fail_clearly(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message.replace("{", r"\{").replace("}", r"\}")):
        settings_from_args(build_parser().parse_args(argv))


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


def test_exclusive_scopes() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["-n", "ml", "--all-namespaces"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--standalone", "--peering", "x"])


def _help(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--all-namespaces" in out.stdout and "--peering" in out.stdout and "--watch-timeout" in out.stdout


def test_python_m_daedalus_operator_help() -> None:
    _help([sys.executable, "-m", "daedalus_operator", "--help"])


def test_daedalus_operator_passes_leading_options_through() -> None:
    _help([str(Path(sys.executable).parent / "daedalus"), "operator", "--standalone", "--help"])


def test_metric_names_and_labels() -> None:
    m = OperatorMetrics()
    m.observe_job("ml", "a", "Running", 2)
    m.observe_job("ml", "b", "Running", 0)
    m.observe_job("ml", "b", "Succeeded", 0)
    m.restarts.labels(namespace="ml", job="a", reason="NodeReplacement").inc()
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
    # every per-job series of "a" is gone (the phase gauges and job_restarts), except the restarts counter, whose
    # history rate() queries still need
    kept = ("daedalus_operator_restarts_total", "daedalus_operator_restarts_created")
    left = [ln for ln in text.splitlines() if 'job="a"' in ln and not ln.startswith(kept)]
    assert left == []
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
