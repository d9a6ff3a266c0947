"""Monitoring kit: promtool validates and unit-tests the alert rules and config, and every metric
the rules and dashboard query is part of the contract in docs/INTERFACES.md.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tests.deploy.contract import (
    ALERTS,
    DASHBOARD,
    PROMETHEUS_BUILTINS,
    alert_exprs,
    contract,
    dashboard_exprs,
    referenced_names,
)

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (apt-get install prometheus)")
PROM_DIR = ALERTS.parent
LATENCY_HISTOGRAMS = (
    "tailserve_time_to_first_token_seconds",
    "tailserve_time_per_output_token_seconds",
    "tailserve_inter_token_latency_seconds",
    "tailserve_e2e_request_latency_seconds",
)


def promtool(*args: str, stdin: str | None = None, cwd: Path = PROM_DIR) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, input=stdin, capture_output=True, text=True, timeout=60)


@needs_promtool
def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_unit_tests_fire_above_and_stay_quiet_below_the_line() -> None:
    result = promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_promtool_check_config() -> None:
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    config = (PROM_DIR / "prometheus.yml").read_text()
    assert "job_name: tailserve-server" in config and "job_name: tailserve-router" in config


def test_alerts_cover_the_slo_at_one_and_a_half_times_target() -> None:
    exprs = " ".join(alert_exprs())
    for metric, line in (
        ("tailserve_time_to_first_token_seconds_bucket", "> 3"),  # 1.5 x 2 s
        ("tailserve_time_per_output_token_seconds_bucket", "> 0.045"),  # 1.5 x 30 ms
        ("tailserve_e2e_request_latency_seconds_bucket", "> 7.5"),  # 1.5 x 5 s
    ):
        assert re.search(rf"histogram_quantile\(0\.99,.*?{metric}.*?\)\s*{re.escape(line)}\b", exprs), metric
    text = ALERTS.read_text()
    for needle in ("tailserve_kv_cache_usage_ratio > 0.95", "up{", "tailserve_router_replica_healthy == 0"):
        assert needle in text


def test_rules_and_dashboard_only_use_contract_metrics() -> None:
    known = contract()
    assert len(known) >= 20, "the INTERFACES.md metric table was not parsed"
    unknown = referenced_names() - set(known) - PROMETHEUS_BUILTINS
    assert unknown == set(), f"not in docs/INTERFACES.md: {sorted(unknown)}"


def test_rules_and_dashboard_only_use_contract_labels() -> None:
    allowed = {"job", "instance", "le"} | {label for m in contract().values() for label in m.labels}
    used: set[str] = set()
    for expr in alert_exprs() + dashboard_exprs():
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            used |= {label.strip() for label in group.split(",")}
        used |= set(re.findall(r"[{,]\s*([a-z_]+)\s*(?:=~|!=|!~|=)", expr))
    assert used - allowed == set()


def test_dashboard_shows_p50_p95_p99_of_each_latency_and_the_operational_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    for metric in LATENCY_HISTOGRAMS:
        panel = next(p for p in panels if any(metric in t["expr"] for t in p["targets"]))
        quantiles = {re.search(r"histogram_quantile\(([\d.]+)", t["expr"]).group(1) for t in panel["targets"]}  # type: ignore[union-attr]
        assert quantiles == {"0.5", "0.95", "0.99"}, panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"] == "s"
    exprs = " ".join(dashboard_exprs())
    for metric in (
        "tailserve_generation_tokens_sum",  # throughput
        "tailserve_requests_finished_total",
        "tailserve_requests_waiting",  # queue
        "tailserve_kv_cache_usage_ratio",
        "tailserve_prefix_cache_hit_rate",
        "tailserve_requests_rejected_total",
    ):
        assert metric in exprs
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    # promtool has no "check expression", so the dashboard's queries go through it as recording rules.
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for i, expr in enumerate(dashboard_exprs()):
        promql = expr.replace("$__rate_interval", "5m").replace("$instance", ".*")
        lines += [f"      - record: dashboard:query_{i}", f"        expr: {json.dumps(promql)}"]
    (tmp_path / "dashboard_rules.yml").write_text("\n".join(lines) + "\n")
    result = promtool("check", "rules", "dashboard_rules.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def contract_exposition() -> str:
    """A /metrics page with every server metric of the contract, as prometheus_client renders it."""
    registry = CollectorRegistry()
    for metric in contract().values():
        if metric.owner != "server":
            continue
        kind = {"histogram": Histogram, "gauge": Gauge, "counter": Counter}[metric.kind]
        kind(metric.name, f"contract metric {metric.name}", metric.labels, registry=registry)
    return generate_latest(registry).decode()


@needs_promtool
def test_contract_metric_names_pass_promtool_lint() -> None:
    result = promtool("check", "metrics", stdin=contract_exposition())
    assert result.returncode == 0, result.stdout + result.stderr
