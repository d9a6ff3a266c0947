"""Calibration, slowdown and queue delay against a fake server whose TTFT is a known line in prompt
length; /metrics samples (RSS, KV blocks) at start, end of warm-up and end of run."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest

from tailserve.bench.app import run_once
from tailserve.bench.calibration import calibrate, calibration_lengths, fit_line
from tailserve.bench.corpus import PromptSource
from tailserve.bench.lengths import parse_length_dist
from tailserve.bench.settings import settings_from_args
from tailserve.bench.summary import format_summary
from tailserve.bench.tokenizers import load_tokenizer
from tailserve.cli import build_parser, main
from tests.bench.conftest import FakeServerProcess, run_bench

# The fake server's prefill: 20 ms + 0.2 ms per prompt byte (= token with --tokenizer byte).
BASE_S, PER_TOKEN_S = 0.02, 0.0002
LINEAR = {"ttft_s": BASE_S, "ttft_per_prompt_byte_s": PER_TOKEN_S, "itl_s": 0.002, "tokens": 4}
ARGS = [
    "--tokenizer",
    "byte",
    "--input-len",
    "longtail:100,600,0.1",
    "--output-len",
    "fixed:4",
    "--no-progress",
]


def test_fit_line_recovers_a_line_and_stays_physical() -> None:
    points = [(n, 0.05 + 0.001 * n + e) for n in (10, 50, 100, 400) for e in (-0.001, 0.0, 0.004)]
    fit = fit_line(points)
    assert fit is not None and fit.slope_s_per_token == pytest.approx(0.001, rel=1e-6)
    assert fit.intercept_s == pytest.approx(0.05, abs=1e-9)  # medians remove the +0.004 outliers
    assert (fit.min_tokens, fit.max_tokens) == (10, 400)
    # Noise that would give a negative intercept: refitted through the origin, never below zero.
    through_origin = fit_line([(100, 0.09), (200, 0.21)])
    assert through_origin is not None and through_origin.intercept_s == 0.0
    assert through_origin.isolated_ttft_s(1) > 0
    flat = fit_line([(100, 0.2), (200, 0.1)])  # a falling line is noise: flat at the mean
    assert flat is not None and flat.slope_s_per_token == 0.0 and flat.intercept_s == pytest.approx(0.15)
    assert fit_line([]) is None


def test_calibration_lengths_span_the_body_and_the_long_tail() -> None:
    lengths = calibration_lengths(parse_length_dist("longtail:200,1500,0.05,0.5"), seed=0)
    assert len(lengths) >= 5 and lengths == sorted(set(lengths))
    assert lengths[0] < 150 and lengths[-1] > 1300  # the shortest prompts and the 5% tail at ~1500
    assert any(1300 < n < 1700 for n in lengths[:-1])  # the tail gets more than its maximum


def test_calibration_is_on_by_default_for_long_tail_workloads_only() -> None:
    def calibrates(*argv: str) -> bool:
        return settings_from_args(build_parser().parse_args(["bench", *argv])).calibrate

    assert calibrates() is True  # the cpu-chat preset's input is longtail
    assert calibrates("--input-len", "fixed:100") is False
    assert calibrates("--input-len", "fixed:100", "--calibrate") is True
    assert calibrates("--no-calibrate") is False


def test_calibration_fit_then_slowdown_and_queue_delay_near_one_and_zero(
    fake_server: FakeServerProcess,
) -> None:
    fake_server.script([LINEAR])
    result, records = run_bench(
        [*ARGS, "--base-url", fake_server.url, "--calibrate", "--calibration-repeats", "2", "--arrival", "constant",
         "--rate", "20", "-n", "40", "--warmup-requests", "0"]
    )  # fmt: skip
    cal = result["calibration"]
    assert result["config"]["calibrate"] is True and cal["failed"] == 0
    assert len(cal["points"]) == 2 * len(cal["lengths"]) and cal["fit"]["kind"] == "least_squares_line"
    # The points are the server's own prompt_tokens (bytes here), one sequential request at a time.
    assert {p["input_tokens"] for p in cal["points"]} == set(cal["lengths"])
    log = fake_server.log()
    assert all(entry["body"]["max_tokens"] == 1 for entry in log[: len(cal["points"])])
    assert cal["fit"]["slope_s_per_token"] == pytest.approx(PER_TOKEN_S, rel=0.15)
    assert 0.5 * BASE_S <= cal["fit"]["intercept_s"] <= BASE_S + 0.03
    # The load does not interfere (the fake server has no shared prefill): slowdown ~1, delay ~0.
    slowdown, delay = result["metrics"]["slowdown"], result["metrics"]["queue_delay_s"]
    assert slowdown["count"] == delay["count"] == result["counts"]["ok"] == 40
    assert 0.85 <= slowdown["p50"] <= 1.3 and abs(delay["p50"]) < 0.02
    assert slowdown["p99_ci"][0] is not None and "slowdown" in result["metrics"]
    assert any("slowdown P99 of 40 requests = their maximum" in w for w in result["warnings"])


def test_queue_delay_is_what_the_load_added(fake_server: FakeServerProcess) -> None:
    """Calibrate on the plain line, then serve with 500 ms of queueing added to every request (large
    against what a busy machine adds to either phase)."""
    args = build_parser().parse_args(
        ["bench", *ARGS, "--base-url", fake_server.url, "--arrival", "constant", "--rate", "20", "-n", "30",
         "--warmup-requests", "0"]
    )  # fmt: skip
    settings = settings_from_args(args)
    tokenizer = load_tokenizer("byte")
    source = PromptSource(tokenizer)
    fake_server.script([LINEAR])
    calibration = asyncio.run(calibrate(settings.target, tokenizer, source, [50, 200, 800], 2))
    assert calibration is not None and calibration.fit is not None
    fake_server.script([dict(LINEAR, ttft_s=BASE_S + 0.5)])
    result, records = asyncio.run(run_once(settings, tokenizer, source, calibration))
    fit = calibration.fit
    expected = sorted(r.ttft_s - fit.isolated_ttft_s(r.input_tokens) for r in records if r.ttft_s is not None)
    delay, slowdown = result["metrics"]["queue_delay_s"], result["metrics"]["slowdown"]
    assert delay["count"] == len(expected) == 30
    assert delay["p50"] == pytest.approx(expected[math.ceil(0.5 * len(expected)) - 1])  # nearest rank
    assert 0.4 <= delay["p50"] <= 0.65
    # Slowdown divides by each prompt's own isolated TTFT: short prompts are slowed down the most.
    short = min(records, key=lambda r: r.input_tokens)
    long = max(records, key=lambda r: r.input_tokens)
    assert short.ttft_s is not None and long.ttft_s is not None
    assert short.ttft_s / fit.isolated_ttft_s(short.input_tokens) > long.ttft_s / fit.isolated_ttft_s(
        long.input_tokens
    )
    assert slowdown["min"] > 1.5


def test_server_samples_from_metrics(fake_server: FakeServerProcess) -> None:
    mib = 2**20
    gauges = {
        "process_resident_memory_bytes": [100 * mib, 110 * mib, 111 * mib],
        "tailserve_kv_blocks_used": [0, 7, 0],
        "tailserve_engine_busy_seconds_total": [10.0, 10.2, 10.7],
        "tailserve_tp_allreduce_seconds_sum": [1.0, 1.05, 1.15],
        "tailserve_tp_compute_seconds_sum": [4.0, 4.2, 4.6],
    }
    httpx.post(fake_server.url + "/_metrics", json=gauges, timeout=10).raise_for_status()
    try:
        fake_server.script([LINEAR])
        result, _ = run_bench(
            [*ARGS, "--base-url", fake_server.url, "--no-calibrate", "--arrival", "constant", "--rate", "20",
             "--duration", "1.5", "--warmup", "0.5"]
        )  # fmt: skip
    finally:
        httpx.post(
            fake_server.url + "/_metrics", content=b"null", timeout=10
        ).raise_for_status()  # no /metrics again
    samples = result["server_samples"]
    assert samples["start"] == {
        "at_s": 0.0, "rss_bytes": 100 * mib, "kv_blocks_used": 0, "engine_busy_s": 10.0,
        "tp_allreduce_s": 1.0, "tp_compute_s": 4.0,
    }  # fmt: skip
    assert samples["warmup_end"]["rss_bytes"] == 110 * mib and samples["warmup_end"]["kv_blocks_used"] == 7
    assert samples["warmup_end"]["at_s"] >= 0.5
    assert samples["end"]["kv_blocks_used"] == 0 and samples["end"]["at_s"] > samples["warmup_end"]["at_s"]
    assert samples["rss_growth_after_warmup"] == pytest.approx(1 / 110)
    assert "RSS 100.0 / 110.0 / 111.0 MiB, KV blocks in use 0 / 7 / 0" in format_summary(result)
    # Counter deltas over the measured window (end of warm-up to the end): 0.5 s busy, and under
    # tensor parallelism 0.1 s of all-reduce against 0.4 s of compute.
    window = samples["engine_window"]
    assert window["busy_s"] == pytest.approx(0.5) and window["tp_comm_share"] == pytest.approx(0.2)
    assert window["wall_s"] == pytest.approx(samples["end"]["at_s"] - samples["warmup_end"]["at_s"])
    assert "all-reduce 20.0% of rank 0's forward" in format_summary(result)


def test_no_metrics_endpoint_gives_null_samples(fake_server: FakeServerProcess) -> None:
    fake_server.script([LINEAR])
    result, _ = run_bench([*ARGS, "--base-url", fake_server.url, "--no-calibrate", "-n", "3", "--rate", "20"])
    assert result["server_samples"] == {
        "start": None, "warmup_end": None, "end": None, "rss_growth_after_warmup": None,
        "engine_window": None,
    }  # fmt: skip
    assert result["calibration"] is None and result["metrics"]["slowdown"] is None


def test_capacity_calibrates_once_for_all_probes(fake_server: FakeServerProcess, tmp_path: Path) -> None:
    fake_server.script([LINEAR])
    out = tmp_path / "cap"
    code = main(
        ["bench", "capacity", *ARGS, "--base-url", fake_server.url, "--calibration-repeats", "1", "--rate-start", "2",
         "--rate-max", "4", "--probe-duration", "1", "--warmup", "0", "--slo-tpot-ms", "off", "--no-html",
         "--out", str(out)]
    )  # fmt: skip
    assert code in (0, 3)
    doc = json.loads(out.with_suffix(".json").read_text())
    calibration_requests = [e for e in fake_server.log() if e["body"]["max_tokens"] == 1]
    assert len(calibration_requests) == len(doc["calibration"]["lengths"])  # one pass, not one per probe
    if len(doc["capacity"]["points"]) < 2 and "client" in (doc["capacity"]["stopped_early"] or ""):
        pytest.skip("this machine is so busy that the client became the bottleneck after one probe")
    assert len(doc["capacity"]["points"]) >= 2 and doc["metrics"]["slowdown"]["count"] > 0
