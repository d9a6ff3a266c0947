"""End to end: `tailserve bench` (the real CLI) against a live `tailserve serve --model dummy:tiny`.

Checks the JSON, JSONL and HTML outputs, the server-side attribution from `tailserve_timings`, the
output length enforced by max_tokens + ignore_eos, and a short `bench capacity` run. No assertion is
made on the server's speed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tailserve.cli import main
from tests.bench.conftest import CHROMIUM, render_in_chromium
from tests.server.harness import serve_process, tailserve_command

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tailserve.server.cli") is None, reason="tailserve.server has not landed"
)
READY_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def live_server() -> Iterator[str]:
    # Lax TTFT and TPOT targets: admission must not refuse requests because other jobs load the machine.
    args = ["--model", "dummy:tiny", "--slo-ttft", "60", "--slo-tpot", "60"]
    with serve_process(args, ready_timeout_s=READY_TIMEOUT_S) as server:
        yield server.base


def bench(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        tailserve_command("bench", *argv),
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )


def test_bench_run_against_live_server(live_server: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = bench(
        "--base-url", live_server, "--tokenizer", "byte", "--input-len", "longtail:48,200,0.1",
        "--output-len", "uniform:8,24", "--arrival", "poisson", "--rate", "10", "-n", "30", "--warmup-requests", "5",
        "--shared-prefix-tokens", "16", "--shared-prefix-fraction", "0.5", "--out", str(out), "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TTFT (s)" in done.stdout and "SLOs:" in done.stdout
    doc = json.loads(out.with_suffix(".json").read_text())
    rows = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert doc["status"] == "complete" and doc["model"] == "dummy-tiny"
    assert len(rows) == 30 and doc["counts"]["failed"] == 0
    assert doc["counts"]["ok"] == doc["counts"]["measured"] > 0
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s"):
        assert doc["metrics"][key]["count"] > 0
    # ignore_eos + max_tokens: every output has exactly the requested length, counted from usage.
    assert all(r["output_tokens"] == r["requested_output_tokens"] for r in rows)
    assert doc["output_length"]["token_sources"] == {"usage": doc["counts"]["ok"]}
    assert doc["attribution"] is not None and doc["attribution"]["slowest_count"] >= 1
    # Half the requests share a 16-token system prefix: the server reports cached prompt tokens.
    assert doc["prefix_cache"]["requests_reporting"] == doc["counts"]["ok"]
    # Long-tail input: the idle-server calibration ran first and every request has a slowdown.
    cal = doc["calibration"]
    assert doc["config"]["calibrate"] and cal["failed"] == 0 and cal["fit"] is not None
    assert len(cal["points"]) == 3 * len(cal["lengths"]) and cal["fit"]["slope_s_per_token"] >= 0
    assert (
        doc["metrics"]["slowdown"]["count"] == doc["metrics"]["queue_delay_s"]["count"] == doc["counts"]["ok"]
    )
    assert doc["metrics"]["ttft_s"]["p50_ci"][0] is not None
    assert any("P99 of 25 requests = their maximum" in w for w in doc["warnings"])
    # tailserve's own /metrics: every KV block is back in the pool once the run is over.
    samples = doc["server_samples"]
    assert samples["start"] is not None and samples["end"]["kv_blocks_used"] == 0
    # RSS from the process gauges, sampled at the start, the end of warm-up (request 5's due time), the end.
    assert all(samples[k]["rss_bytes"] > 0 for k in ("start", "warmup_end", "end"))
    assert samples["rss_growth_after_warmup"] is not None
    # The engine worked during the measured window, and no tensor parallelism means no all-reduce share.
    window = samples["engine_window"]
    assert 0.0 < window["busy_share"] <= 1.0 and window["tp_comm_share"] is None
    html = out.with_suffix(".html")
    assert html.exists()
    if CHROMIUM:
        dom, _ = render_in_chromium(html, tmp_path)
        # 4 CDFs, TTFT/TPOT over time, throughput, P99 TTFT/TPOT per window, calibration
        assert dom.count("<svg") == 10


def test_bench_capacity_and_compare_against_live_server(
    live_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cap"
    done = bench(
        "capacity", "--base-url", live_server, "--tokenizer", "byte", "--input-len", "fixed:32",
        "--output-len", "fixed:8", "--rate-start", "2", "--rate-max", "4", "--probe-duration", "2",
        "--warmup", "0", "--slo-tpot-ms", "off", "--out", str(out), "--no-progress",
    )  # fmt: skip
    assert done.returncode in (0, 3), done.stdout + done.stderr
    assert "highest rate meeting every SLO" in done.stdout
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["kind"] == "capacity" and len(doc["capacity"]["points"]) >= 1
    assert "<svg" in out.with_suffix(".html").read_text()
    copy = tmp_path / "copy.json"
    shutil.copy(out.with_suffix(".json"), copy)
    assert main(["bench", "compare", str(out.with_suffix(".json")), str(copy)]) == 0
    table = capsys.readouterr().out
    # A run against itself: never "differ", and no ratio printed without a difference.
    assert "differ (" not in table and "x)" not in table
    assert "no difference shown (intervals overlap)" in table or "not enough data" in table
