"""The Prometheus rules (charts/daedalus/files/rules.yaml): promtool check and unit tests, coverage of every alert
firing and not firing, and mutation checks that prove the fixtures can fail. The rules evaluated by a real server on
the real exporters: ``test_dashboards.py`` (it shares that file's live Prometheus and real training run)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from obslib import (OPERATOR_METRICS, RECORDING, RULES, RULES_TEST, TRAINER_METRICS, alert_names, load_rules,
                    metric_names, require_binary)

REQUIRED_ALERTS = {
    "DaedalusJobFailed", "DaedalusJobRestartingOften", "DaedalusJobNoProgress", "DaedalusJobStuck",
    "DaedalusCheckpointStale",
    "DaedalusSuccessRatioDropping", "DaedalusOperatorDown", "DaedalusOperatorReconcileErrors",
}


@pytest.fixture(scope="module")
def promtool() -> str:
    return require_binary("promtool")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=120)


def test_promtool_check_rules(promtool: str) -> None:
    proc = run(promtool, "check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in load_rules()['groups'])} rules found" in proc.stdout


def test_promtool_test_rules(promtool: str) -> None:
    proc = run(promtool, "test", "rules", str(RULES_TEST))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_required_rules_exist() -> None:
    assert set(alert_names()) == REQUIRED_ALERTS
    records = [r["record"] for g in load_rules()["groups"] for r in g["rules"] if "record" in r]
    assert records == [RECORDING]
    for group in load_rules()["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
                assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for case in yaml.safe_load(RULES_TEST.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    assert firing >= set(alert_names()), f"never shown firing: {set(alert_names()) - firing}"
    assert silent >= set(alert_names()), f"never shown silent: {set(alert_names()) - silent}"
    promql_tests = [t for case in yaml.safe_load(RULES_TEST.read_text())["tests"]
                    for t in case.get("promql_expr_test", [])]
    assert any(RECORDING in t["expr"] for t in promql_tests)


def test_rules_use_only_contract_metrics() -> None:
    known = set(TRAINER_METRICS) | set(OPERATOR_METRICS) | {"up"}
    for group in load_rules()["groups"]:
        for rule in group["rules"]:
            used = metric_names(rule["expr"])
            assert used and used <= known, f"{rule.get('alert') or rule.get('record')}: {used - known}"


@pytest.mark.parametrize("mutant", ["never", "always"])
def test_fixtures_catch_broken_alerts(promtool: str, tmp_path: Path, mutant: str) -> None:
    """Replace every alert's expression by one that never (or always) fires: `promtool test rules` must fail, and
    report a failed check for each alert, so each alert's firing (and silent) cases really constrain it."""
    rules = load_rules()
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["expr"] = "vector(1) > 2" if mutant == "never" else 'label_replace(vector(1), "job", "x", "", "")'
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    tests = yaml.safe_load(RULES_TEST.read_text())
    tests["rule_files"] = ["rules.yaml"]
    (tmp_path / "rules_test.yaml").write_text(yaml.safe_dump(tests))
    proc = run(promtool, "test", "rules", str(tmp_path / "rules_test.yaml"))
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    uncaught = [a for a in sorted(REQUIRED_ALERTS) if f"alertname: {a}," not in output]
    assert not uncaught, f"{mutant}-firing expressions pass the fixtures of {uncaught}"
