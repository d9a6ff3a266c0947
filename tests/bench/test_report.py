"""Reports: the HTML renders in headless Chromium with its plots; compare; the capacity search."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from tailserve.bench.arrivals import ArrivalSpec
from tailserve.bench.calibration import Calibration, fit_line
from tailserve.bench.capacity_search import (
    CapacityPoint,
    CapacitySearch,
    capacity_section,
    find_capacity,
    point_from_result,
)
from tailserve.bench.client import TargetConfig
from tailserve.bench.client_health import ClientHealth
from tailserve.bench.html_report import cdf_points, render_html
from tailserve.bench.load_loop import RunControl, RunOutcome
from tailserve.bench.records import RequestRecord
from tailserve.bench.result import BenchSettings, build_result, load_result, write_json
from tailserve.bench.stats import SloTargets
from tailserve.bench.summary import format_capacity, format_summary, upper_end_note
from tailserve.bench.verdicts import format_compare
from tailserve.cli import main
from tests.bench.conftest import CHROMIUM, make_record, render_in_chromium


def _settings() -> BenchSettings:
    return BenchSettings(
        target=TargetConfig("http://127.0.0.1:1", "m", api_key="sk-secret"),
        arrival=ArrivalSpec("poisson", 5.0),
        control=RunControl(num_requests=301, warmup_s=5.0),
        slo=SloTargets(),
        workload=None,
        tokenizer="approx",
        window_s=10.0,
    )


def _outcome(records: list[RequestRecord]) -> RunOutcome:
    health = ClientHealth(5.0, 5.0, 5.0, 0.05, 0.001, 0.002, False, [])
    return RunOutcome(records, "complete", None, "m", "2026-01-01T00:00:00+00:00", 61.0, health, 60.0)


def constructed_result(
    scale: float = 1.0, capacity: bool = False, n: int = 300
) -> tuple[dict, list[RequestRecord]]:
    """An n-request run (300) with a slow tail and server timings, built without any network."""
    timings = {"queue_s": 0.01, "prefill_s": 0.05, "decode_s": 0.2, "preemptions": 0}
    records = [
        make_record(i, i * 0.2, (0.1 if i % 50 else 1.5) * scale, 0.02 * scale, 11, timings=timings)
        for i in range(n)
    ]
    records.append(make_record(n, n * 0.2, 0, 0, 0, error="rate_limited"))
    settings, outcome = _settings(), _outcome(records)
    points = [(10, 0.05), (10, 0.052), (200, 0.4), (200, 0.41)]
    calibration = Calibration([10, 200], 2, 1, points, fit_line(points), 0)
    sample = {"at_s": 0.0, "rss_bytes": 200.0 * 2**20, "kv_blocks_used": 0.0}
    samples = {"start": sample, "warmup_end": dict(sample, at_s=5.0), "end": dict(sample, at_s=61.0)}
    result = build_result(outcome, settings, calibration, dict(samples, rss_growth_after_warmup=0.0))
    if capacity:
        points = [
            CapacityPoint(r, r * 0.99, 0.1 * r, 0.02, 0.5 * r, r * 0.98, 0.0, r <= 4, False, "complete")
            for r in (1.0, 2.0, 4.0, 8.0, 6.0)
        ]
        result["capacity"] = capacity_section(6.0, points, None, {"TTFT": 2.0})
    return result, records


def test_result_document_is_complete_and_redacted() -> None:
    result, _ = constructed_result()
    assert result["schema"] == "tailserve-bench-result" and result["schema_version"] == 1
    assert result["config"]["target"]["api_key"] == "***"
    assert result["counts"]["warmup"] == 25 and result["counts"]["measured"] == 276
    assert result["errors"]["by_kind"] == {"rate_limited": 1}
    assert result["attribution"]["slowest_count"] == 3
    assert len(result["windows"]["rows"]) == 6
    json.dumps(result, allow_nan=False)  # strict JSON, no NaN
    text = format_summary(result)
    assert "TTFT (s)" in text and "PASS" in text and "rate_limited 1" in text and "slowest 1%" in text
    assert result["slo"]["admission"] == {
        "admitted": 275,
        "refused": 1,
        "missed_ttft": 0,
        "missed_tpot": 0,
        "missed_e2e": 0,
    }
    assert "admission: 275 admitted, 1 refused (429, 0.4%); of the admitted, 0 missed TTFT <= 2.00 s" in text


def test_slo_verdicts_carry_the_p99_interval() -> None:
    few, _ = constructed_result()  # 275 successful measured requests: no upper end for P99
    ttft = next(v for v in few["slo"]["verdicts"] if v["name"] == "p99_ttft_s")
    assert ttft["passed"] and ttft["passed_upper"] is None and ttft["observed_ci"][1] is None
    many, _ = constructed_result(n=1000)  # TTFT is 1.5 s on every 50th request, 0.1 s otherwise
    ttft = next(v for v in many["slo"]["verdicts"] if v["name"] == "p99_ttft_s")
    assert ttft["observed_ci"] == [1.5, 1.5] and ttft["passed_upper"] is True
    assert not any("their maximum" in w for w in many["warnings"])


def test_prompts_the_server_counted_longer_than_planned_are_flagged() -> None:
    exact, records = constructed_result()  # the server counted the 10 tokens planned
    assert not any("prompt tokens" in w for w in exact["warnings"])
    for r in records:
        r.input_tokens = 11  # 10% over: what an approximate tokenizer's prompts do on a real server
    drifted = build_result(_outcome(records), _settings(), None, None)
    warning = next(w for w in drifted["warnings"] if "prompt tokens" in w)
    assert "11 prompt tokens a request on average against 10 planned" in warning
    assert "--tokenizer" in warning
    assert "11 prompt tokens" in format_summary(drifted)


def test_conservative_capacity_needs_the_upper_ends_within_the_slos() -> None:
    few, _ = constructed_result()  # P99s pass, but 275 requests give them no upper end
    many, _ = constructed_result(n=1000)
    assert point_from_result(5.0, few).passed and not point_from_result(5.0, few, conservative=True).passed
    point = point_from_result(5.0, many, conservative=True)
    assert point.passed and point.passed_upper and point.ttft_p99_ci == (1.5, 1.5)
    section = capacity_section(5.0, [point], None, {}, conservative=True)
    assert section["definition"] == "p99 interval upper ends within the SLOs"
    assert "(a pass: p99 interval upper ends within the SLOs)" in format_capacity(section)


def test_a_late_client_loop_alone_does_not_void_a_probe() -> None:
    """On a 2-core box a saturated server starves the client's event loop (seen probing vLLM at 10
    req/s: loop lag P99 23 ms, every send on time). The lag only adds to the latencies measured, so a
    pass stands, and a fail stands where every missed target is missed by more than the lag."""

    def with_client(doc: dict, lag: float, late_sends: bool | None) -> dict:
        client = dict(doc["client"], bottleneck=True, loop_lag_p99_s=lag)
        if late_sends is None:
            client.pop("late_sends", None)  # a document written before the field existed
        else:
            client["late_sends"] = late_sends
        return dict(doc, client=client)

    passing, _ = constructed_result(n=1000)  # P99 TTFT 1.5 s, TPOT 20 ms against 2 s / 30 ms
    point = point_from_result(5.0, with_client(passing, 0.023, False))
    assert point.passed and not point.client_bottleneck
    assert point_from_result(5.0, with_client(passing, 0.023, False), conservative=True).passed_upper
    assert not point_from_result(5.0, with_client(passing, 0.023, False), conservative=True).client_bottleneck
    failing, _ = constructed_result(scale=2.0, n=1000)  # P99 TTFT 3 s (1 s over), TPOT 40 ms (10 ms over)
    point = point_from_result(5.0, with_client(failing, 0.005, False))
    assert not point.passed and not point.client_bottleneck
    # A lag as wide as a miss (TPOT's 10 ms) could have made it: the client may have set the verdict.
    assert point_from_result(5.0, with_client(failing, 0.02, False)).client_bottleneck
    # Late sends (the server saw less load) and documents without the field: the client may have.
    assert point_from_result(5.0, with_client(passing, 0.0, True)).client_bottleneck
    assert point_from_result(5.0, with_client(failing, 0.005, None)).client_bottleneck


def test_conservative_capacity_says_how_few_requests_decide_a_probe() -> None:
    """975 requests with a TTFT: the P99's upper end is the 4th slowest, the table says so, and how
    many requests would make it the 8th. The point-P99 rule prints no such note."""
    many, _ = constructed_result(n=1000)
    point = point_from_result(5.0, many, conservative=True)
    assert point.latency_count == many["metrics"]["ttft_s"]["count"] == 975
    text = format_capacity(capacity_section(5.0, [point], None, {}, conservative=True))
    assert (
        "with 975 requests a probe, the upper end of the 95% P99 interval is its 4th slowest request" in text
    )
    assert "1439 requests a probe would make it the 8th slowest" in text
    assert "upper end" not in format_capacity(capacity_section(5.0, [point_from_result(5.0, many)], None, {}))
    assert "its slowest request" in upper_end_note(368) and "no upper end" in upper_end_note(275)


def test_cdf_points_keep_the_tail() -> None:
    values = [float(i) for i in range(10_000)]
    pts = cdf_points(values)
    assert len(pts) <= 501
    assert pts[0] == (0.0, 0.0) and pts[-1] == (9999.0, 1.0)
    assert sum(1 for v, _ in pts if v >= 9900) == 100


def test_html_is_self_contained_with_plots() -> None:
    result, records = constructed_result(capacity=True)
    page = render_html(result, records)
    # 4 CDFs + TTFT, TPOT and throughput over time + P99 TTFT/TPOT per window + calibration + 2 capacity.
    assert page.count("<svg") == 12
    # Nothing that would load from elsewhere: no scripts, stylesheets, images, fonts or imports.
    assert not re.search(r"<script|<link|<img|<iframe|\bsrc=|\bhref=|url\(|@import", page)
    assert "warm-up" in page and "window P99" in page
    # The new parts: intervals under the percentiles, slowdown, calibration, server samples.
    assert "[0.100, +inf]" in page and "slowdown (x)" in page and "queue delay (s)" in page
    assert "isolated TTFT = 0.0324 s + 1.8632 ms/token" in page and "KV blocks in use" in page
    # Interval bars for the windows' P99 and P95 on both over-time charts.
    assert page.count('class="intervals"') == 4 and "window P95 TPOT" in page


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (scripts/test.sh installs it)")
def test_html_renders_in_headless_chromium(tmp_path: Path) -> None:
    result, records = constructed_result(capacity=True)
    page = tmp_path / "report.html"
    page.write_text(render_html(result, records))
    dom, shot = render_in_chromium(page, tmp_path)
    assert dom.count("<svg") == 12
    assert "Latency CDFs" in dom and "Capacity curve" in dom and "P99 TTFT over time" in dom
    assert "Calibration: idle TTFT vs prompt length" in dom and "RSS growth after warm-up: +0.0%" in dom
    assert shot.stat().st_size > 10_000  # a real picture, not a blank page


def test_compare_gives_verdicts_from_intervals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, _ = constructed_result(1.0)
    b, _ = constructed_result(2.0)
    write_json(a, tmp_path / "a.json")
    write_json(b, tmp_path / "b.json")
    assert load_result(tmp_path / "a.json")["label"] == a["label"]
    table = format_compare([a, b], ["a", "b"])
    rows = {(line[:16].strip(), line[16:21].strip()): line for line in table.splitlines()}
    # Every TTFT is 2x: the medians' intervals are far apart; 276 requests give P99 no upper end.
    assert "differ (2.00x)" in rows[("TTFT (s)", "p50")]
    assert "not enough data" in rows[("TTFT (s)", "p99")] and "x)" not in rows[("TTFT (s)", "p99")]
    out = tmp_path / "ab"
    assert (
        main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(out)]) == 0
    )
    assert "differ (2.00x)" in capsys.readouterr().out
    doc = json.loads(out.with_suffix(".json").read_text())
    assert (
        doc["schema"] == "tailserve-bench-compare" and doc["runs"] == ["a", "b"] and doc["ci_level"] == 0.95
    )
    rows = {(r["metric"], r["stat"]): r for r in doc["rows"]}
    p50, p99 = rows[("ttft_s", "p50")], rows[("ttft_s", "p99")]
    assert p50["verdicts"] == [{"against": 0, "run": 1, "verdict": "differ", "ratio": pytest.approx(2.0)}]
    assert p50["values"][0] == {"value": pytest.approx(0.1), "ci": [pytest.approx(0.1), pytest.approx(0.1)]}
    assert p99["verdicts"][0]["verdict"] == "not enough data" and p99["verdicts"][0]["ratio"] is None
    assert p99["values"][1]["ci"][1] is None
    # The same run twice: overlapping intervals, no ratio anywhere.
    same = format_compare([b, b], ["b", "b2"])
    assert "no difference shown (intervals overlap)" in same and "differ (" not in same
    (tmp_path / "bad.json").write_text("{}")
    assert main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "bad.json")]) == 2
    assert "not a tailserve bench result" in capsys.readouterr().err


def fake_probe(limit: float, calls: list[float], bottleneck_from: float = 1e9):
    """A server that meets its SLOs up to `limit` req/s."""

    async def probe(rate: float) -> CapacityPoint:
        calls.append(rate)
        passed = rate <= limit
        return CapacityPoint(
            rate, rate, 0.1, 0.01, 1.0, rate, 0.0, passed, rate >= bottleneck_from, "complete"
        )

    return probe


def test_capacity_ramps_then_bisects() -> None:
    calls: list[float] = []
    best, points, note = asyncio.run(
        find_capacity(CapacitySearch(1.0, 256.0, 2.0, 0.05), fake_probe(11.0, calls))
    )
    assert calls[:5] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert best is not None and 11.0 * 0.95 <= best <= 11.0
    assert note is None and len(points) == len(calls)
    text = format_capacity(capacity_section(best, points, note, {}))
    assert "highest rate meeting every SLO" in text


def test_capacity_when_nothing_passes_or_the_client_limits() -> None:
    calls: list[float] = []
    best, _, note = asyncio.run(find_capacity(CapacitySearch(1.0, 8.0, 2.0, 0.05), fake_probe(0.0, calls)))
    assert best is None and calls == [1.0, 0.5, 0.25, 0.125] and note and "misses the SLOs" in note
    # The start rate fails but a lower one passes: step down, then bisect.
    calls = []
    best, _, note = asyncio.run(find_capacity(CapacitySearch(1.0, 8.0, 2.0, 0.05), fake_probe(0.3, calls)))
    assert calls[:3] == [1.0, 0.5, 0.25] and best is not None and 0.285 <= best <= 0.3 and note is None
    best, _, note = asyncio.run(find_capacity(CapacitySearch(1.0, 8.0), fake_probe(100.0, [])))
    assert best == 8.0 and note and "rate-max" in note
    # The client cannot drive 4 req/s (its own figures may be the client's): that probe counts as a
    # fail, the search bisects below it, and the answer is a lower bound that says so.
    calls = []
    best, _, note = asyncio.run(
        find_capacity(CapacitySearch(1.0, 64.0), fake_probe(100.0, calls, bottleneck_from=4.0))
    )
    assert calls[:4] == [1.0, 2.0, 4.0, 3.0] and best is not None and 3.8 <= best < 4.0
    assert note and "could not keep up at 4 req/s" in note and "lower bound" in note
    # Even the start rate is past the client: no capacity to state.
    best, _, note = asyncio.run(
        find_capacity(CapacitySearch(1.0, 64.0), fake_probe(100.0, [], bottleneck_from=1.0))
    )
    assert best is None and note and "before any rate passed" in note


def test_progress_line_shows_live_p99s() -> None:
    from tailserve.bench.load_loop import progress_line

    records = [make_record(i, i * 0.1, 0.2 if i < 99 else 1.0, 0.01, 5) for i in range(100)]
    line = progress_line(records, 12.0, 3)
    assert "sent 100 done 100 err 0 in-flight 3" in line
    assert "p99 TTFT 0.200s" in line and "TPOT 10.0ms" in line
