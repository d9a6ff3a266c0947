"""Helpers for the monitoring tests: the metric contract from docs/INTERFACES.md, the DCGM field
names of the pinned dcgm-exporter (deploy/dcgm), and the metric names our alert rules and dashboard
query. Parsing only; no network, no promtool.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INTERFACES = REPO / "docs" / "INTERFACES.md"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboard.json"
DCGM_FIELDS = REPO / "deploy" / "dcgm" / "fields.txt"
DCGM_COUNTERS = REPO / "deploy" / "dcgm" / "counters.csv"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
PROMETHEUS_BUILTINS = frozenset({"up"})


@dataclass(frozen=True)
class ContractMetric:
    """One metric the server or router promises to expose."""

    name: str
    kind: str  # histogram, gauge or counter
    labels: tuple[str, ...]
    owner: str  # "server" or "router"


def _section(text: str, heading: str) -> str:
    """The body of a `## heading` section of a markdown file."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"{INTERFACES} has no section {heading!r}"
    return match.group(1)


def server_metrics(text: str) -> list[ContractMetric]:
    """Rows of the `## Prometheus metrics` table: | `name` [/ `name`] | type ... | labels |."""
    metrics: list[ContractMetric] = []
    for line in _section(text, "Prometheus metrics (server `/metrics`)").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        kind = cells[1].split()[0]
        labels = tuple(re.findall(r"`([a-z_]+)`", cells[2].split("(")[0]))
        metrics += [
            ContractMetric(n, kind, labels, "server") for n in re.findall(r"`(tailserve_\w+)`", cells[0])
        ]
    return metrics


def router_metrics(text: str) -> list[ContractMetric]:
    """The router's `name{labels}` list; the kind comes from the prose or the `_total` suffix."""
    metrics: list[ContractMetric] = []
    body = _section(text, "Router metrics (router `/metrics`)")
    for match in re.finditer(r"`(tailserve_router_\w+)(?:\{([^}]*)\})?`(\s*\((\w+))?", body):
        name, labels, note = match.group(1), match.group(2) or "", match.group(4)
        kind = note if note in ("histogram", "gauge") else ("counter" if name.endswith("_total") else "gauge")
        metrics.append(ContractMetric(name, kind, tuple(filter(None, labels.split(","))), "router"))
    return metrics


def contract() -> dict[str, ContractMetric]:
    """Every metric in the contract, by name."""
    text = INTERFACES.read_text(encoding="utf-8")
    return {m.name: m for m in server_metrics(text) + router_metrics(text)}


def _dcgm_header(key: str) -> str:
    """The value of the one-line `# key: value` entry of fields.txt's header."""
    match = re.search(rf"^# {key}: (.+)$", DCGM_FIELDS.read_text(), re.M)
    assert match, f"{DCGM_FIELDS} has no {key!r} line"
    return match.group(1).strip()


def dcgm_field_names() -> frozenset[str]:
    """Every field name the pinned dcgm-exporter accepts (deploy/dcgm/fields.txt)."""
    lines = DCGM_FIELDS.read_text().splitlines()
    return frozenset(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def dcgm_labels() -> frozenset[str]:
    """Labels the exporter puts on its series, as fields.txt lists them."""
    return frozenset(_dcgm_header("labels").split())


def dcgm_clock_events() -> frozenset[str]:
    """The clock_event label values of DCGM_EXP_CLOCK_EVENTS_COUNT."""
    return frozenset(_dcgm_header("clock_events").split())


def dcgm_exporter_image() -> str:
    """The exporter image the field list came from."""
    return _dcgm_header("image")


def dcgm_counters() -> dict[str, str]:
    """Field -> Prometheus type of each line of the counters file, parsed as the exporter's CSV reader does."""
    fields: dict[str, str] = {}
    for line in DCGM_COUNTERS.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        cells = [cell.strip() for cell in line.split(",")]
        assert len(cells) == 3, f"counters.csv: not 3 fields: {line!r}"
        fields[cells[0]] = cells[1]
    return fields


def promql_names(expr: str) -> set[str]:
    """Metric names an expression selects (tailserve_*, DCGM_* and Prometheus' own `up`)."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)  # label values such as "tailserve.*" are not names
    names = set(re.findall(r"\b(tailserve_[a-z0-9_]+|DCGM_[A-Z0-9_]+)\b", without_strings))
    names |= {n for n in PROMETHEUS_BUILTINS if re.search(rf"\b{n}\s*(\{{|==|\[|\)|$)", without_strings)}
    return names


def base_name(name: str, known: dict[str, ContractMetric]) -> str:
    """`x_bucket` / `x_sum` / `x_count` -> `x` when `x` is a histogram of the contract."""
    for suffix in HISTOGRAM_SUFFIXES:
        stem = name.removesuffix(suffix)
        if stem != name and stem in known and known[stem].kind == "histogram":
            return stem
    return name


def alert_exprs() -> list[str]:
    """The `expr:` of every rule in alerts.yml (block scalars included), without a YAML library."""
    exprs: list[str] = []
    lines = ALERTS.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped.startswith("expr:"):
            continue
        value = stripped.removeprefix("expr:").strip()
        if value != "|":
            exprs.append(value)
            continue
        indent = len(line) - len(line.lstrip()) + 2
        block = []
        for follow in lines[i + 1 :]:
            if follow.strip() and len(follow) - len(follow.lstrip()) < indent:
                break
            block.append(follow.strip())
        exprs.append(" ".join(block).strip())
    return exprs


def dashboard_exprs() -> list[str]:
    """Every target expression of every panel in the Grafana dashboard."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def referenced_names() -> set[str]:
    """Base metric names the rules and dashboard query."""
    known = contract()
    names: set[str] = set()
    for expr in alert_exprs() + dashboard_exprs():
        names |= {base_name(n, known) for n in promql_names(expr)}
    return names
