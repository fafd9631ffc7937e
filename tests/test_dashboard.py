"""Issue 26: the Grafana dashboard in ``deploy/grafana/`` and the alert rules in ``deploy/prometheus/`` query only
metrics the code exports (a misspelt metric makes a panel empty and an alert that never fires, silently), and the
dashboard is well formed: every panel reads the dashboard's Prometheus data source and fits Grafana's 24 columns."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "georep-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "georep-alerts.yml"
NAME = re.compile(r"\bgeorep_[a-z_]*[a-z]\b")


def exported() -> set[str]:
    """Every metric name the node and the audit define (a counter's ``_total`` sample included): the names in
    their source, and the audit's ``PREFIX + name`` ones (``spark_jobs/audit_metrics.py``)."""
    names: set[str] = set()
    for path in [*(ROOT / "georep").rglob("*.py"), *(ROOT / "spark_jobs").rglob("*.py")]:
        if "proto" in path.parts:
            continue
        text = path.read_text()
        names |= set(re.findall(r'"(georep_[a-z_]*[a-z])"', text))
        names |= {"georep_audit_" + n for n in re.findall(r'(?:_gauge\(|PREFIX \+)\s*"([a-z_]+)"', text)}
    return names | {n + "_total" for n in names}


def queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every query of the dashboard."""
    doc = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in doc["panels"] if p["type"] != "row" for t in p["targets"]]


def test_every_panel_and_every_alert_queries_exported_metrics() -> None:
    known = exported()
    assert {"georep_link_state", "georep_cluster_under_replicated_segments", "georep_audit_divergent"} <= known
    unknown = {(title, name) for title, expr in queries() for name in NAME.findall(expr) if name not in known}
    assert not unknown, f"dashboard panels querying metrics nothing exports: {sorted(unknown)}"
    rules = set(NAME.findall(RULES.read_text()))
    assert rules - known == set(), f"alert rules on metrics nothing exports: {sorted(rules - known)}"


def test_a_misspelt_metric_would_be_caught() -> None:
    assert "georep_link_states" not in exported() and "georep_replication_lag_ms" not in exported()


def test_the_dashboard_covers_sites_links_lag_cluster_health_and_audits_from_its_data_source() -> None:
    doc = json.loads(DASHBOARD.read_text())
    rows = {p["title"] for p in doc["panels"] if p["type"] == "row"}
    assert rows == {"Sites", "Links", "Lag", "Cluster health (multi-node sites)", "Audits"}
    assert [v["name"] for v in doc["templating"]["list"]] == ["datasource", "site"]
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for p in doc["panels"]:
        grid = p["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]
