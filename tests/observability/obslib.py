"""Helpers for the observability tests: the metric contract, a real Prometheus server, and its HTTP API.

The metric contract (issue 6) is what the alert rules and dashboards are written against: every trainer series carries
the RLTrainingJob's `job` and `namespace` labels; the operator's per-job series do too.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray_head import free_port  # a server port outside the ephemeral range

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "daedalus"
RULES = CHART / "files" / "rules.yaml"
RULES_TEST = Path(__file__).resolve().parent / "rules_test.yaml"
#: The one recording rule of RULES (steps per hour over the last hour, per job).
RECORDING = "daedalus:train_steps_per_hour:deriv1h"
DASHBOARDS = CHART / "dashboards"

#: A second job the operator knows but which never starts training (Pending throughout, no trainer metrics): the
#: training dashboard must still list it, so a user can find a job stuck before its first step.
QUEUED_JOB = "maze-queued"
QUEUED_NAMESPACE = "ml-research"

TRAINER_METRICS = {
    # name: type
    "daedalus_train_step": "gauge",
    "daedalus_train_total_steps": "gauge",
    "daedalus_train_success_ratio": "gauge",
    "daedalus_train_reward_mean": "gauge",
    "daedalus_train_episode_turns": "gauge",
    "daedalus_train_kl": "gauge",
    "daedalus_train_loss": "gauge",
    "daedalus_train_grad_norm": "gauge",
    "daedalus_train_steps_per_hour": "gauge",
    "daedalus_eval_success_ratio": "gauge",
    "daedalus_checkpoint_last_step": "gauge",
    "daedalus_checkpoint_last_timestamp_seconds": "gauge",
    "daedalus_checkpoint_interval_steps": "gauge",
    "daedalus_checkpoint_bytes": "gauge",
    "daedalus_rollout_tokens_total": "counter",
    "daedalus_train_zero_variance_groups_total": "counter",
    "daedalus_rollout_seconds": "histogram",
    "daedalus_learner_seconds": "histogram",
    "daedalus_checkpoint_save_seconds": "histogram",
}
OPERATOR_METRICS = {
    # name: (type, labels)
    "daedalus_operator_reconciles_total": ("counter", ("result",)),
    "daedalus_operator_reconcile_seconds": ("histogram", ()),
    "daedalus_operator_jobs": ("gauge", ("phase",)),
    "daedalus_operator_job_phase": ("gauge", ("namespace", "job", "phase")),
    "daedalus_operator_restarts_total": ("counter", ("namespace", "job", "reason")),
    "daedalus_operator_recovery_seconds": ("histogram", ()),
    "daedalus_operator_job_restarts": ("gauge", ("namespace", "job")),
    "daedalus_operator_poll_skips_total": ("counter", ()),
    "daedalus_operator_poll_wakes_total": ("counter", ("reason",)),
    "daedalus_operator_steady_poll_seconds": ("gauge", ()),
}
#: Operator metrics without the RLTrainingJob's labels (dashboards must not filter them by $namespace/$job).
OPERATOR_GLOBAL = {n for n, (_, labels) in OPERATOR_METRICS.items() if "job" not in labels}
PHASES = ("Pending", "Provisioning", "Running", "Checkpointing", "Recovering", "Suspended", "Succeeded", "Failed")

_SUFFIXES = ("_bucket", "_sum", "_count")
_METRIC_RE = re.compile(r"\b(daedalus_[a-z0-9_]+|up)\b(?!\s*\()")


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects, with histogram suffixes folded onto the family name."""
    names = set()
    for name in _METRIC_RE.findall(expr):
        for suffix in _SUFFIXES:
            if name.endswith(suffix) and name[: -len(suffix)] in {**TRAINER_METRICS, **OPERATOR_METRICS}:
                name = name[: -len(suffix)]
        names.add(name)
    return names


def missing_tool(reason: str) -> None:
    """Skip with `reason`, or fail when DAEDALUS_REQUIRE_TOOLS=1 (CI) so a missing tool never passes silently."""
    if os.environ.get("DAEDALUS_REQUIRE_TOOLS") == "1":
        pytest.fail(f"{reason} (DAEDALUS_REQUIRE_TOOLS=1)")
    pytest.skip(reason)


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing_tool(f"{name} not found: install Debian's Prometheus with "
                     "`apt-get install -y --no-install-recommends prometheus`")
    return path


def load_rules() -> dict[str, Any]:
    return yaml.safe_load(RULES.read_text())


def alert_names() -> list[str]:
    return [r["alert"] for g in load_rules()["groups"] for r in g["rules"] if "alert" in r]


class Prometheus:
    """A real Prometheus server on a loopback port scraping the given targets every second.

    Args:
        binary: the `prometheus` executable (Debian package, 2.42).
        workdir: directory for its config, TSDB and log.
        targets: scrape job name -> "host:port". Every job keeps the exporter's own `job`/`namespace` labels
            (honor_labels), as the chart's ServiceMonitor and PodMonitor do.
        rule_files: rule files to load (the chart's rules.yaml).
    """

    def __init__(self, binary: str, workdir: Path, targets: dict[str, str], rule_files: list[Path]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": job, "honor_labels": True, "static_configs": [{"targets": [addr]}]}
                               for job, addr in targets.items()],
        }
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self._log = self.log_path.open("wb")
        self.started = time.time()
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h",
             "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def get(self, path: str, **params: Any) -> Any:
        url = f"{self.url}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(url, timeout=10) as rsp:
                return json.loads(rsp.read())
        except urllib.error.HTTPError as exc:   # 400/422 carry Prometheus' error message in the body
            raise AssertionError(f"{path} {params}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as rsp:
                    if rsp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {timeout}s:\n{self.log_tail()}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query at now; raises AssertionError with Prometheus' error on failure."""
        body = self.get("/api/v1/query", query=expr)
        assert body["status"] == "success", body
        assert body["data"]["resultType"] == "vector", body["data"]["resultType"]
        return body["data"]["result"]

    def wait_for(self, expr: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Poll until `expr` returns at least one sample."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result:
                return result
            time.sleep(0.25)
        raise TimeoutError(f"no result for {expr!r} after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    return [v for v in (float(s["value"][1]) for s in result) if math.isfinite(v)]
