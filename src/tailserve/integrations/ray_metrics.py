"""A Ray Serve replica's engine metrics, mirrored from its own /metrics page into Ray's metrics
(`ray.serve.metrics`, i.e. `ray.util.metrics` with Ray's `deployment`/`replica`/`application` tags),
since replicas have no port Prometheus could scrape. Reads the page only: nothing here touches the
engine. Gauges are set, counters and histograms grow by what the page grew since the last export.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from ray.serve import metrics as serve_metrics

# The page's names, exported under the same names (Ray's Prometheus export prefixes `ray_`); a
# counter under its family name (the page's without `_total`).
GAUGES = (
    "tailserve_requests_running",
    "tailserve_requests_waiting",
    "tailserve_kv_cache_usage_ratio",
    "tailserve_prefix_cache_hit_rate",
)
COUNTERS = {"tailserve_requests_finished": "finish_reason", "tailserve_requests_rejected": "reason"}
HISTOGRAMS = ("tailserve_time_to_first_token_seconds", "tailserve_time_per_output_token_seconds")


@dataclass
class PageValues:
    """What one /metrics page says about the mirrored families."""

    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[tuple[str, str], float] = field(default_factory=dict)  # (name, label value) -> total
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # name -> [(le, cumulative)]


def read_page(text: str) -> PageValues:
    """The mirrored families' values from Prometheus text (a counter's family name, no `_total`)."""
    values = PageValues()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name in GAUGES and sample.name == family.name:
                values.gauges[family.name] = sample.value
            elif family.name in COUNTERS and sample.name == family.name + "_total":
                label = sample.labels.get(COUNTERS[family.name], "")
                values.counters[(family.name, label)] = sample.value
            elif family.name in HISTOGRAMS and sample.name == family.name + "_bucket":
                bound = float(sample.labels["le"])
                values.buckets.setdefault(family.name, []).append((bound, sample.value))
    for rows in values.buckets.values():
        rows.sort()
    return values


def bucket_points(rows: Iterable[tuple[float, float]], before: dict[float, float]) -> list[tuple[float, int]]:
    """(value, times) to observe so that a histogram with the same bounds gains what each bucket
    gained since `before`: one point inside each bucket (its middle; past the last bound, twice
    that bound). Counts per bucket are exact, the sum is not."""
    points: list[tuple[float, int]] = []
    lower, previous_total, previous_before = 0.0, 0.0, 0.0
    for bound, total in rows:
        gained = (total - previous_total) - (before.get(bound, 0.0) - previous_before)
        if gained > 0:
            value = 2 * lower if math.isinf(bound) else (lower + bound) / 2
            points.append((value, round(gained)))
        previous_total, previous_before = total, before.get(bound, 0.0)
        lower = bound if not math.isinf(bound) else lower
    return points


class ReplicaMetrics:
    """The Ray metrics of one replica; `export(page)` brings them up to that page."""

    def __init__(self) -> None:
        self._gauges = {
            name: serve_metrics.Gauge(name, description=f"{name} of this replica") for name in GAUGES
        }
        self._counters = {
            name: serve_metrics.Counter(name, description=name, tag_keys=(label,))
            for name, label in COUNTERS.items()
        }
        self._histograms: dict[str, serve_metrics.Histogram] = {}
        self._last = PageValues()

    def export(self, text: str) -> PageValues:
        """Sets and grows the Ray metrics to what `text` (this replica's /metrics page) says;
        returns the page's values, which are now what the Ray metrics show."""
        page = read_page(text)
        for name, value in page.gauges.items():
            self._gauges[name].set(value)
        for (name, label), total in page.counters.items():
            gained = total - self._last.counters.get((name, label), 0.0)
            if gained > 0:
                self._counters[name].inc(gained, tags={COUNTERS[name]: label})
        for name, rows in page.buckets.items():
            histogram = self._histograms.get(name)
            if histogram is None:
                bounds = [b for b, _ in rows if not math.isinf(b)]
                histogram = serve_metrics.Histogram(name, description=name, boundaries=bounds)
                self._histograms[name] = histogram
            for value, times in bucket_points(rows, dict(self._last.buckets.get(name, []))):
                for _ in range(times):
                    histogram.observe(value)
        self._last = page
        return page
