"""Against a real HTTP server whose token delays are scripted exactly, the bench's numbers are right.

Delays are hundreds of milliseconds so that OS timer noise (about a millisecond) stays far inside the
2% tolerance on a quiet machine; arrivals are staggered (37 ms apart) so streams do not tick in
lockstep. On a busy machine the instruments themselves run late: each check also allows what they
recorded of that in the same run (the test server's own slip, the client's loop lag and late sends),
which on a quiet machine is a few milliseconds and so leaves the 2% claim intact.
"""

from __future__ import annotations

import pytest

from tailserve.bench.records import RequestRecord
from tests.bench.conftest import FakeServerProcess, run_bench

REL = 0.02

NORMAL = {"ttft_s": 0.5, "itl_s": 0.25, "tokens": 5}
SLOW_PREFILL = {"ttft_s": 2.5, "itl_s": 0.25, "tokens": 5}
DECODE_STALL = {"ttft_s": 0.5, "itl_s": [0.25, 1.5, 0.25, 0.25], "tokens": 5}


def metric(result: dict, name: str, stat: str) -> float:
    return float(result["metrics"][name][stat])


def instrument_lateness_s(server: FakeServerProcess, result: dict, records: list[RequestRecord]) -> float:
    """How late the instruments ran in this run, by their own records: the test server's worst chunk
    past its schedule, plus the client's worst send past its due time or its event-loop lag p99."""
    slips = [0.0]
    for entry in server.log():
        b = entry["behaviour"]
        gaps = b["itl_s"] if isinstance(b["itl_s"], list) else [b["itl_s"]] * (len(entry["emits"]) - 1)
        due = entry["arrival"] + b["ttft_s"]
        for i, emitted in enumerate(entry["emits"]):
            due += gaps[i - 1] if i else 0.0
            slips.append(emitted - due)
    client = max([result["client"]["loop_lag_p99_s"] or 0.0] + [r.client_queue_s for r in records])
    return max(slips) + client


def assert_timing(measured: float, scripted: float, lateness_s: float) -> None:
    """`measured` is the scripted value to REL, give or take twice what the instruments ran late
    (a late server chunk and a late client read both move one timestamp)."""
    assert measured == pytest.approx(scripted, rel=REL, abs=2 * lateness_s), f"instruments {lateness_s=:.4f}"


def test_sharp_tail_workload_matches_known_values(fake_server: FakeServerProcess) -> None:
    # 100 requests, one behaviour each: 93 normal, 2 with a 2.5 s prefill, 5 with a 1.5 s decode stall.
    script = [NORMAL] * 100
    for i in (30, 80):
        script[i] = SLOW_PREFILL
    for i in (10, 25, 50, 65, 90):
        script[i] = DECODE_STALL
    fake_server.script(script)
    result, records = run_bench(
        [
            "--base-url", fake_server.url, "--model", "fake-model", "--arrival", "constant", "--rate", "27",
            "-n", "100", "--warmup", "0", "--input-len", "fixed:16", "--output-len", "fixed:5",
            "--no-progress", "--slo-ttft", "2", "--slo-tpot-ms", "400", "--slo-e2e", "5",
        ]
    )  # fmt: skip
    assert result["counts"]["ok"] == 100 and result["counts"]["failed"] == 0
    assert all(r.output_tokens == 5 and r.output_tokens_source == "usage" for r in records)
    late_s = instrument_lateness_s(fake_server, result, records)

    # TTFT: 98 x 0.5 s and 2 x 2.5 s -> p50 0.5, p99 2.5 (nearest rank 99 of 100), mean 0.54.
    assert_timing(metric(result, "ttft_s", "p50"), 0.5, late_s)
    assert_timing(metric(result, "ttft_s", "p99"), 2.5, late_s)
    assert_timing(metric(result, "ttft_s", "max"), 2.5, late_s)
    assert_timing(metric(result, "ttft_s", "mean"), 0.54, late_s)
    ttft = result["metrics"]["ttft_s"]
    assert ttft["p99_over_mean"] == pytest.approx(ttft["p99"] / ttft["mean"])

    # E2E = TTFT + sum of gaps: 93 x 1.5, 5 x 2.75 (stall), 2 x 3.5 (slow prefill).
    assert_timing(metric(result, "e2e_s", "p50"), 1.5, late_s)
    assert_timing(metric(result, "e2e_s", "p95"), 2.75, late_s)
    assert_timing(metric(result, "e2e_s", "p99"), 3.5, late_s)
    assert_timing(metric(result, "e2e_s", "mean"), 1.6025, late_s)

    # TPOT = (E2E - TTFT) / 4: 95 x 0.25, 5 x 0.5625.
    assert_timing(metric(result, "tpot_s", "p50"), 0.25, late_s)
    assert_timing(metric(result, "tpot_s", "p99"), 0.5625, late_s)
    assert_timing(metric(result, "tpot_s", "mean"), 0.265625, late_s)

    # ITL per token: 395 x 0.25 and 5 x 1.5 -> p99 (rank 396 of 400) is a stall.
    assert result["metrics"]["itl_s"]["count"] == 400
    assert_timing(metric(result, "itl_s", "p50"), 0.25, late_s)
    assert_timing(metric(result, "itl_s", "p99"), 1.5, late_s)
    assert_timing(metric(result, "itl_s", "mean"), 0.265625, late_s)

    # SLO verdicts on the measured tail: TTFT p99 2.5 > 2 FAIL, TPOT 0.56 > 0.4 FAIL, E2E 3.5 <= 5 PASS.
    # Every threshold sits hundreds of ms from the values it separates, beyond any client lateness.
    verdicts = {v["name"]: v["passed"] for v in result["slo"]["verdicts"]}
    assert verdicts == {"p99_ttft_s": False, "p99_tpot_s": False, "p99_e2e_s": True, "error_rate": True}
    # Goodput: the 2 slow prefills miss TTFT, the 5 stalls miss TPOT.
    assert result["slo"]["goodput_fraction"] == pytest.approx(0.93)


def test_multi_token_chunks_split_the_gap(fake_server: FakeServerProcess) -> None:
    # Chat endpoint, 9 tokens in 3 chunks of 3, 0.45 s apart: ITL 0.15 s per token, 0 for the
    # two tokens that came with the first one; TPOT = 0.9 / 8.
    fake_server.script([{"ttft_s": 0.5, "itl_s": 0.45, "tokens": 9, "chunk_tokens": 3}])
    result, records = run_bench(
        [
            "--base-url", fake_server.url, "--endpoint", "chat", "--arrival", "constant", "--rate", "27",
            "-n", "20", "--warmup", "0", "--output-len", "fixed:9", "--no-progress",
        ]
    )  # fmt: skip
    assert result["counts"]["ok"] == 20
    assert all(r.chunk_tokens == [3, 3, 3] for r in records)
    # The request asked for streaming usage and enforced the length with max_tokens + ignore_eos.
    body = fake_server.log()[0]["body"]
    assert body["max_tokens"] == 9 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"][-1]["role"] == "user"
    # The split itself, on what the client observed (exact whatever the machine's load): the two
    # tokens that came with the first one have gap 0, the others a third of their chunk's gap.
    for r in records:
        first, second, last = r.chunk_times_s
        a, b = (second - first) / 3, (last - second) / 3
        assert r.itl_s() == pytest.approx([0.0, 0.0, a, a, a, b, b, b])
        assert (r.ttft_s, r.e2e_s) == (first, last) and r.tpot_s == pytest.approx((last - first) / 8)
    assert result["metrics"]["itl_s"]["count"] == 20 * 8
    assert metric(result, "itl_s", "mean") == pytest.approx(sum(r.e2e_s - r.ttft_s for r in records) / 160)
    # And the numbers match the script: ITL p50 0.15 (not 0.45 per chunk, not 0.1125 per token).
    late_s = instrument_lateness_s(fake_server, result, records)
    assert_timing(metric(result, "ttft_s", "p50"), 0.5, late_s)
    assert_timing(metric(result, "e2e_s", "p50"), 1.4, late_s)
    assert_timing(metric(result, "tpot_s", "p50"), 0.1125, late_s)
    assert_timing(metric(result, "itl_s", "p50"), 0.15, late_s)
    assert_timing(metric(result, "itl_s", "mean"), 0.1125, late_s)


def test_server_timings_feed_queue_time_and_attribution(fake_server: FakeServerProcess) -> None:
    fast = {
        "queue_s": 0.01,
        "prefill_s": 0.04,
        "ttft_s": 0.05,
        "decode_s": 0.02,
        "e2e_s": 0.07,
        "preemptions": 0,
        "admission_estimate_s": 0.1,
        "admission_tpot_estimate_s": 0.02,
    }
    slow = {
        "queue_s": 0.5,
        "prefill_s": 0.04,
        "ttft_s": 0.54,
        "decode_s": 0.02,
        "e2e_s": 0.56,
        "preemptions": 1,
        "admission_estimate_s": 0.27,
        "admission_tpot_estimate_s": 0.005,
    }
    unpriced = fast | {"admission_estimate_s": 0.0, "admission_tpot_estimate_s": 0.0}  # nothing priced
    fake_server.script(
        [{"ttft_s": 0.05, "itl_s": 0.01, "tokens": 3, "timings": fast}] * 8
        + [{"ttft_s": 0.05, "itl_s": 0.01, "tokens": 3, "timings": unpriced}]
        + [{"ttft_s": 0.55, "itl_s": 0.01, "tokens": 3, "timings": slow}]
    )
    result, _ = run_bench(
        ["--base-url", fake_server.url, "--arrival", "constant", "--rate", "40", "-n", "20", "--warmup", "0",
         "--no-progress"]
    )  # fmt: skip
    assert metric(result, "queue_s", "p99") == pytest.approx(0.5)
    assert metric(result, "queue_s", "p50") == pytest.approx(0.01)
    # Admission's predictions against the server's TTFT: 0.05 / 0.1 and 0.54 / 0.27, unpriced ones left out.
    assert result["metrics"]["admission_ratio"]["count"] == 18
    assert metric(result, "admission_ratio", "p50") == pytest.approx(0.5)
    assert metric(result, "admission_ratio", "max") == pytest.approx(2.0)
    # And against its TPOT price: 0.02 s over 3 tokens' 2 gaps, against 0.02 and 0.005.
    assert result["metrics"]["admission_tpot_ratio"]["count"] == 18
    assert metric(result, "admission_tpot_ratio", "p50") == pytest.approx(0.5)
    assert metric(result, "admission_tpot_ratio", "max") == pytest.approx(2.0)
    att = result["attribution"]
    assert att["slowest_count"] == 1
    assert att["queue_s"] == pytest.approx(0.5) and att["preempted_fraction"] == 1.0
    # Whatever the server does not account for (network, client) is the client E2E minus its timings.
    assert att["outside_server_s"] == pytest.approx(att["e2e_s"] - 0.56)


def test_last_token_time_is_the_chunk_that_closes_the_choice(fake_server: FakeServerProcess) -> None:
    """tailserve sends the finish reason alone when the last token's text was held back: that chunk,
    not the last one with text, ends E2E and TPOT. The bounds sit halfway between the right answer
    (4 gaps of 250 ms after the first token) and the old one (3 gaps): 125 ms from either, beyond
    what a busy machine adds to a read."""
    behaviour = {"ttft_s": 0.2, "itl_s": 0.25, "tokens": 5, "empty_final": True}
    fake_server.script([behaviour])
    for endpoint in ("completions", "chat"):
        result, records = run_bench(
            [
                "--base-url", fake_server.url, "--model", "fake-model", "--endpoint", endpoint,
                "--arrival", "constant", "--rate", "5", "-n", "4", "--warmup-requests", "0",
                "--input-len", "fixed:16", "--output-len", "fixed:5", "--no-progress",
            ]
        )  # fmt: skip
        assert result["counts"]["ok"] == 4
        for r in records:
            assert r.output_tokens == 5 and len(r.chunk_times_s) == 5
            assert r.e2e_s == r.chunk_times_s[-1]
            assert r.e2e_s is not None and r.ttft_s is not None and r.tpot_s is not None
            assert r.e2e_s - r.ttft_s > 0.875  # 1 s scripted; stopping at the last text gives 0.75
            assert r.tpot_s > 0.21875  # 0.25 s scripted; 0.1875 when the closing chunk is missed
