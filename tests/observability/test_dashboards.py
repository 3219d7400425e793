"""The Grafana dashboards: (a) their JSON structure, (b) every panel query run against a real Prometheus.

(b) uses the session fixture `prometheus` (conftest.py): the Debian Prometheus server scraping the real trainer and
operator metric exporters every second. Grafana variables are replaced as Grafana would for one selected job:
`$namespace`/`$job` by that job's labels, `$__rate_interval`/`$__interval`/`$__range` by a window covering the
whole scrape history of the test. Each query must succeed and return at least one finite, non-zero sample for that
job.

(c) The chart's Prometheus rules evaluated by that same server (the rules' promtool tests are test_rules.py). It is
here, not there, because the `prometheus` fixture drives a real ~100 s training run per process, and `make test`
gives each test file to one pytest-xdist worker: with the live tests in two files, two workers paid for a run each.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest
from obslib import (DASHBOARDS, OPERATOR_GLOBAL, OPERATOR_METRICS, QUEUED_JOB, QUEUED_NAMESPACE, TRAINER_METRICS,
                    RECORDING, Prometheus, finite_values, load_rules, metric_names)

EXPECTED = {"training.json": ("Daedalus / Training", "daedalus-training"),
            "operator.json": ("Daedalus / Operator", "daedalus-operator")}

# What each dashboard must show (issue 6), as the metrics its panels must query.
REQUIRED_METRICS = {
    "training.json": {
        "daedalus_train_success_ratio", "daedalus_eval_success_ratio", "daedalus_train_reward_mean",
        "daedalus_train_kl", "daedalus_train_loss", "daedalus_train_grad_norm", "daedalus_train_episode_turns",
        "daedalus_rollout_seconds", "daedalus_learner_seconds", "daedalus_rollout_tokens_total",
        "daedalus_checkpoint_last_timestamp_seconds", "daedalus_checkpoint_save_seconds",
        "daedalus_operator_job_restarts", "daedalus_operator_restarts_total", "daedalus_operator_job_phase",
        "daedalus_train_step", "daedalus_train_total_steps",
    },
    "operator.json": {
        "daedalus_operator_reconciles_total", "daedalus_operator_reconcile_seconds", "daedalus_operator_jobs",
        "daedalus_operator_restarts_total", "daedalus_operator_recovery_seconds", "daedalus_operator_job_phase",
        "daedalus_operator_poll_skips_total", "daedalus_operator_poll_wakes_total",
        "daedalus_operator_steady_poll_seconds",
    },
}


def load(name: str) -> dict[str, Any]:
    return json.loads((DASHBOARDS / name).read_text())


def panel_targets() -> list[tuple[str, str, str, str]]:
    """(dashboard file, panel title, refId, expr) for every query of every panel."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], target["refId"], target["expr"]))
    return out


# --- (a) structure ------------------------------------------------------------------------------------------------

def test_dashboard_files() -> None:
    assert sorted(p.name for p in DASHBOARDS.glob("*.json")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dashboard_structure(name: str) -> None:
    dash = load(name)
    title, uid = EXPECTED[name]
    assert dash["title"] == title and dash["uid"] == uid
    assert dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for var in ("namespace", "job"):
        assert variables[var]["type"] == "query"
        assert variables[var]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert variables[var]["multi"] and variables[var]["includeAll"] and variables[var]["allValue"] == ".*"
    assert "$namespace" in variables["job"]["query"]["query"]    # job choices follow the namespace

    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    cells: set[tuple[int, int]] = set()
    for panel in dash["panels"]:
        where = f"{name}: {panel['title']}"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert panel["description"], where
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{where}: no unit"
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, where
        cover = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & cover, f"{where} overlaps another panel"
        cells |= cover
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), where
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["expr"].strip(), where


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dashboard_covers_required_metrics(name: str) -> None:
    used = set().union(*(metric_names(t["expr"]) for p in load(name)["panels"] for t in p["targets"]))
    assert REQUIRED_METRICS[name] <= used, f"missing: {sorted(REQUIRED_METRICS[name] - used)}"
    known = set(TRAINER_METRICS) | set(OPERATOR_METRICS) | {"up"}
    assert used <= known, f"unknown metrics (not in the contract): {sorted(used - known)}"


_SELECTOR_RE = re.compile(r"\b(daedalus_[a-z0-9_]+)\s*(\{[^}]*\})?")


@pytest.mark.parametrize("dashboard, title, ref, expr", panel_targets())
def test_per_job_queries_follow_the_variables(dashboard: str, title: str, ref: str, expr: str) -> None:
    """Every selector of a per-job metric filters on both variables; operator-wide metrics filter on neither."""
    for name, selector in _SELECTOR_RE.findall(expr):
        (family,) = metric_names(name)
        selector = selector or ""
        if family in OPERATOR_GLOBAL:
            assert "$job" not in selector and "$namespace" not in selector, f"{title}/{ref}: {name}{selector}"
        else:
            assert 'namespace=~"$namespace"' in selector and 'job=~"$job"' in selector, \
                f"{title}/{ref}: {name}{selector} ignores the dashboard variables"


#: Grafana units of time. A target shown in one must read a quantity in seconds.
TIME_UNITS = {"s", "ms", "us", "ns", "m", "h", "d", "dtdurations", "dtdurationms", "dthms", "dtdhms", "clocks",
              "clockms"}


def effective_unit(panel: dict[str, Any], ref: str) -> str | None:
    """The unit Grafana shows a target's series in: the panel's default, or the last override matching the target
    by its refId (``byFrameRefID``) that sets ``unit``."""
    unit = panel["fieldConfig"]["defaults"].get("unit")
    for override in panel["fieldConfig"].get("overrides", []):
        matcher = override.get("matcher", {})
        if matcher.get("id") == "byFrameRefID" and matcher.get("options") == ref:
            for prop in override.get("properties", []):
                if prop.get("id") == "unit":
                    unit = prop["value"]
    return unit


@pytest.mark.parametrize("dashboard, title, ref, expr", panel_targets())
def test_a_target_shown_as_a_duration_reads_seconds(dashboard: str, title: str, ref: str, expr: str) -> None:
    """A target displayed in a time unit reads only metrics measured in seconds (the Prometheus base unit: names
    ending in ``_seconds``), e.g. a checkpoint's step beside its age must not be drawn as "8.3 min"."""
    panel = next(p for p in load(dashboard)["panels"] if p["title"] == title)
    unit = effective_unit(panel, ref)
    if unit in TIME_UNITS:
        used = metric_names(expr)
        assert used and all(n.endswith("_seconds") for n in used), \
            f"{dashboard} / {title} / {ref} is shown in {unit!r} but reads {sorted(used)}"


def test_the_kl_panel_names_the_reference_the_trainer_uses() -> None:
    """The KL is to the SFT start (daedalus_train_kl's help): with a PEFT sftAdapter, as in the HyperPod example, a
    frozen copy of that adapter, not the base model the words "adapter disabled" alone would mean."""
    from daedalus_trainer import metrics
    (kl,) = [m for m in metrics.METRICS if m.name == "daedalus_train_kl"]
    assert "reference = the SFT start" in kl.help
    (panel,) = [p for p in load("training.json")["panels"]
                if any(metric_names(t["expr"]) == {"daedalus_train_kl"} for t in p["targets"])]
    assert "reference = the SFT start" in panel["description"], panel["description"]


# --- (b) every query against a real Prometheus ---------------------------------------------------------------------

def needs(expr: str) -> str:
    """The scrape job whose exporter a query reads."""
    return "daedalus-operator" if re.search(r'daedalus_operator_|job="daedalus-operator"', expr) else "daedalus-trainer"


def substitute(expr: str, prom: Prometheus, job: str, namespace: str) -> str:
    window = f"{max(15, int(time.time() - prom.started) + 10)}s"
    for macro in ("$__rate_interval", "$__interval", "$__range"):
        expr = expr.replace(macro, window)
    return expr.replace("$namespace", promql_regex(namespace)).replace("$job", promql_regex(job))


def promql_regex(value: str) -> str:
    """A variable value escaped as Grafana does for `=~"$var"`: regex-escaped, backslashes doubled for the PromQL
    string literal."""
    return re.escape(value).replace("\\", "\\\\")


@pytest.mark.parametrize("dashboard, title, ref, expr", panel_targets())
def test_panel_query_returns_data(prometheus: Prometheus, exporters: dict[str, Any],
                                  dashboard: str, title: str, ref: str, expr: str) -> None:
    exporter = exporters[needs(expr)]
    if not hasattr(exporter, "address"):
        pytest.skip(exporter.reason)
    query = substitute(expr, prometheus, exporter.job, exporter.namespace)
    result = prometheus.query(query)
    # Every driven quantity is non-zero (a step, a token, a restart, an error...), so a panel that shows only zeros
    # or NaN reads the series wrongly (e.g. increase() over a counter whose series appeared at 1).
    assert [v for v in finite_values(result) if v != 0], \
        f"{dashboard} / {title} / {ref}: no finite non-zero sample for\n{query}\ngot {result}"
    if "$job" in expr:    # per-job panels return only the selected job
        assert {s["metric"]["job"] for s in result if "job" in s["metric"]} <= {exporter.job}, result


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_variable_queries_list_the_job(prometheus: Prometheus, exporters: dict[str, Any], name: str) -> None:
    variables = {v["name"]: v for v in load(name)["templating"]["list"]}
    source = "daedalus-operator" if name == "operator.json" else "daedalus-trainer"
    exporter = exporters[source]
    if not hasattr(exporter, "address"):
        pytest.skip(exporter.reason)
    listed = [(exporter.namespace, exporter.job)]
    if name == "training.json" and hasattr(exporters["daedalus-operator"], "address"):
        # A job the operator knows that never reported a step (stuck Pending) is listed too.
        listed.append((QUEUED_NAMESPACE, QUEUED_JOB))
    for namespace, job in listed:
        for var, expected in (("namespace", namespace), ("job", job)):
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variables[var]["query"]["query"])
            assert match, variables[var]["query"]
            selector = match.group(1).replace("$namespace", promql_regex(namespace))
            body = prometheus.get(f"/api/v1/label/{match.group(2)}/values", **{"match[]": selector})
            assert body["status"] == "success" and expected in body["data"], (var, namespace, job, body)
            if var == "job":  # the namespace filter holds: the other namespace's job is not offered
                others = {j for n, j in listed if n != namespace}
                assert not others & set(body["data"]), (namespace, body["data"])


# --- the contract the rules and dashboards are written against -------------------------------------------------------

def test_contract_matches_the_trainer_metric_table() -> None:
    """obslib's trainer contract is the trainer's own table (daedalus_trainer.metrics.METRICS): same names, types."""
    from daedalus_trainer import metrics
    assert {m.name: m.type for m in metrics.METRICS} == TRAINER_METRICS
    assert tuple(metrics.LABELS) == ("job", "namespace")


def test_contract_matches_the_operator_metrics() -> None:
    """Every operator metric of the contract exists in OperatorMetrics' registry with the contract's labels, and
    the registry has no metric the contract lacks."""
    from daedalus_operator import metrics as module
    registry = module.OperatorMetrics().registry
    families = {f.name: f.type for f in registry.collect()}
    contract = {n.removesuffix("_total") if k == "counter" else n for n, (k, _) in OPERATOR_METRICS.items()}
    assert set(families) == contract, sorted(set(families) ^ contract)
    collectors = dict(registry._names_to_collectors)
    for name, (kind, labels) in OPERATOR_METRICS.items():
        family = name.removesuffix("_total") if kind == "counter" else name
        assert families.get(family) == kind, (name, families.get(family))
        assert tuple(collectors[name]._labelnames) == labels, name


def test_real_prometheus_evaluates_the_rules_on_real_metrics(prometheus: Prometheus, exporters: dict) -> None:
    """The server loaded every rule, evaluated each without error, recorded steps/hour for the driven job, and
    fires none of the job alerts for a healthy run."""
    groups = prometheus.get("/api/v1/rules")["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == sum(len(g["rules"]) for g in load_rules()["groups"])
    for rule in rules:
        assert rule["health"] == "ok", rule
    trainer = exporters["daedalus-trainer"]
    if not hasattr(trainer, "address"):
        pytest.skip(trainer.reason)
    recorded = prometheus.query(f'{RECORDING}{{job="{trainer.job}"}}')
    assert len(recorded) == 1 and float(recorded[0]["value"][1]) > 0, recorded
    alerts = prometheus.get("/api/v1/alerts")["data"]["alerts"]
    job_alerts = [a for a in alerts if a["labels"].get("job") == trainer.job]
    assert not job_alerts, job_alerts
