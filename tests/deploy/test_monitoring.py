"""Monitoring kit: promtool validates and unit-tests the alert rules and config; every tailserve
metric the rules and dashboard query is part of the contract in docs/INTERFACES.md, and every DCGM
one is a documented field of the pinned dcgm-exporter that our counters file turns on.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tailserve.plan.dcgm import CLOCK_EVENT_LABELS, DCGM_WATCH
from tests.deploy.contract import (
    ALERTS,
    DASHBOARD,
    PROMETHEUS_BUILTINS,
    alert_exprs,
    contract,
    dashboard_exprs,
    dcgm_clock_events,
    dcgm_counters,
    dcgm_field_names,
    dcgm_labels,
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
    assert "job_name: dcgm-exporter" in config


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
    dcgm = {name for name in referenced_names() if name.startswith("DCGM_")}
    unknown = referenced_names() - set(known) - PROMETHEUS_BUILTINS - dcgm
    assert unknown == set(), f"not in docs/INTERFACES.md: {sorted(unknown)}"
    assert {"DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_EXP_CLOCK_EVENTS_COUNT"} <= dcgm
    assert dcgm - dcgm_field_names() == set(), (
        "not a field of the pinned dcgm-exporter (deploy/dcgm/fields.txt)"
    )
    assert dcgm - set(dcgm_counters()) == set(), "queried but not turned on in deploy/dcgm/counters.csv"


def test_counters_file_enables_the_issue_fields_with_valid_types() -> None:
    counters = dcgm_counters()
    assert set(counters) - dcgm_field_names() == set()
    assert set(counters.values()) <= {"gauge", "counter", "histogram", "summary", "label"}
    for field in (
        "DCGM_FI_PROF_SM_OCCUPANCY",
        "DCGM_FI_PROF_SM_ACTIVE",
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",  # DCGM_FI_DEV_CLOCK_THROTTLE_REASONS before DCGM 3.3
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "DCGM_FI_DEV_FB_USED",
    ):
        assert field in counters, field
    assert counters["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"] == "counter"


def test_doctor_and_rules_speak_the_exporters_language() -> None:
    """`tailserve doctor` names fields the exporter has and our counters file turns on, and spells
    throttle reasons as its clock_event label does; so do the rules and panels."""
    named = {re.match(r"DCGM_[A-Z0-9_]+", f).group(0) for fields in DCGM_WATCH.values() for f in fields}  # type: ignore[union-attr]
    assert named - dcgm_field_names() == set()
    assert named - set(dcgm_counters()) == set()
    assert set(CLOCK_EVENT_LABELS.values()) == dcgm_clock_events()
    used = set()
    for expr in alert_exprs() + dashboard_exprs():
        for values in re.findall(r'clock_event!?=~?"([^"]*)"', expr):
            used |= set(values.split("|"))
    assert used and used - dcgm_clock_events() == set()


def test_rules_and_dashboard_only_use_contract_labels() -> None:
    # namespace/pod join a replica and its GPU (prometheus.yml, the Kubernetes scrape job).
    allowed = {"job", "instance", "le", "namespace", "pod"} | dcgm_labels()
    allowed |= {label for m in contract().values() for label in m.labels}
    used: set[str] = set()
    for expr in alert_exprs() + dashboard_exprs():
        for group in re.findall(r"\b(?:by|on|ignoring|group_left|group_right) \(([^)]*)\)", expr):
            used |= {label.strip() for label in group.split(",") if label.strip()}
        used |= set(re.findall(r"[{,]\s*([A-Za-z_]+)\s*(?:=~|!=|!~|=)", expr))
    assert used - allowed == set()


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule}
    tests = yaml.safe_load((PROM_DIR / "alerts_test.yml").read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert alerts - fired == set()


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


def test_gpu_row_sits_right_below_the_latency_panels() -> None:
    """SM occupancy, clocks and throttle reasons directly under the P99 panels, so a spike lines up by eye."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    latency = [
        p for p in panels if any(m in t["expr"] for t in p.get("targets", []) for m in LATENCY_HISTOGRAMS)
    ]
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in latency)
    rows = sorted((p for p in panels if p["type"] == "row"), key=lambda p: p["gridPos"]["y"])
    gpu_row = next(r for r in rows if r["gridPos"]["y"] >= bottom)
    assert gpu_row["title"].startswith("GPU") and gpu_row["gridPos"]["y"] == bottom
    end = next((r["gridPos"]["y"] for r in rows if r["gridPos"]["y"] > bottom), 10**6)
    gpu_exprs = " ".join(
        t["expr"] for p in panels if bottom < p["gridPos"]["y"] < end for t in p.get("targets", [])
    )
    for field in (
        "DCGM_FI_PROF_SM_OCCUPANCY",
        "DCGM_FI_PROF_SM_ACTIVE",
        "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_EXP_CLOCK_EVENTS_COUNT",
    ):
        assert field in gpu_exprs, field
    assert "tailserve_engine_busy_ratio" in gpu_exprs  # engine busy beside SM activity: starved or saturated
    exprs = " ".join(dashboard_exprs())
    for metric in (
        "tailserve_step_duration_seconds_bucket",
        "tailserve_step_tokens_bucket",
        "tailserve_steps_total",
    ):
        assert metric in exprs


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
