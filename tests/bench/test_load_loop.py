"""The load loop against the scripted server: closed loop, multi-turn, client-side limits, fallbacks."""

from __future__ import annotations

import pytest

from tests.bench.conftest import FakeServerProcess, run_bench

FAST = {"ttft_s": 0.01, "itl_s": 0.005, "tokens": 3}


def test_closed_loop_keeps_concurrency_bounded(fake_server: FakeServerProcess) -> None:
    fake_server.script([{"ttft_s": 0.05, "itl_s": 0.01, "tokens": 3}])
    result, records = run_bench(
        ["--base-url", fake_server.url, "--arrival", "closed", "--concurrency", "3", "-n", "12", "--warmup", "0",
         "--output-len", "fixed:3", "--no-progress"]
    )  # fmt: skip
    assert result["counts"]["ok"] == 12 and len(records) == 12
    # At any moment at most 3 requests were open.
    events = sorted([(r.sent_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    open_now = peak = 0
    for _, step in events:
        open_now += step
        peak = max(peak, open_now)
    assert peak == 3
    assert result["metrics"]["client_queue_s"] is None  # nothing is due on a clock in a closed loop


def test_closed_loop_duration_mode(fake_server: FakeServerProcess) -> None:
    """Each worker sends again as soon as its request ends, and none starts after the duration."""
    fake_server.script([FAST])
    result, records = run_bench(
        ["--base-url", fake_server.url, "--arrival", "closed", "--concurrency", "2", "--duration", "1.5",
         "--warmup", "0", "--no-progress"]
    )  # fmt: skip
    # A 20 ms request takes far less than half the 1.5 s even on a busy machine: 2 rounds of 2 at least.
    assert result["status"] == "complete" and len(records) >= 4
    # The deadline is checked just before each send; only the client's own lateness separates them.
    loop_lag_s = result["client"]["loop_lag_p99_s"] or 0.0
    assert max(r.sent_s for r in records) < 1.5 + 0.1 + 2 * loop_lag_s


def test_multi_turn_resends_the_history(fake_server: FakeServerProcess) -> None:
    fake_server.script([FAST])
    result, records = run_bench(
        ["--base-url", fake_server.url, "--endpoint", "chat", "--turns", "2", "-n", "4", "--rate", "20",
         "--warmup", "0", "--input-len", "fixed:20", "--output-len", "fixed:3", "--no-progress",
         "--shared-prefix-tokens", "8", "--shared-prefix-fraction", "1"]
    )  # fmt: skip
    assert result["counts"]["ok"] == 4
    bodies = [entry["body"] for entry in fake_server.log()]
    second_turns = [b for b in bodies if len(b["messages"]) == 4]
    assert len(second_turns) == 2
    roles = [m["role"] for m in second_turns[0]["messages"]]
    assert roles == ["system", "user", "assistant", "user"]
    assert second_turns[0]["messages"][2]["content"] == "tok tok tok "
    assert {r.turn for r in records} == {0, 1}
    assert all(r.scheduled_s is None for r in records if r.turn == 1)


def test_client_side_cap_is_reported_as_the_bottleneck(fake_server: FakeServerProcess) -> None:
    fake_server.script([{"ttft_s": 0.1, "itl_s": 0.01, "tokens": 2}])
    result, _ = run_bench(
        ["--base-url", fake_server.url, "--arrival", "constant", "--rate", "40", "-n", "15", "--max-concurrency", "1",
         "--warmup", "0", "--output-len", "fixed:2", "--no-progress"]
    )  # fmt: skip
    client = result["client"]
    assert client["bottleneck"]
    assert client["achieved_rate_per_s"] < 0.5 * client["scheduled_rate_per_s"]
    assert any("short of the scheduled" in reason for reason in client["reasons"])
    assert result["metrics"]["client_queue_s"]["max"] > 0.5
    assert any("CLIENT IS THE BOTTLENECK" in w for w in result["warnings"])


def test_token_counts_fall_back_without_usage(fake_server: FakeServerProcess) -> None:
    fake_server.script([{**FAST, "usage": False, "tokens": 4}])
    result, records = run_bench(
        ["--base-url", fake_server.url, "-n", "3", "--rate", "20", "--warmup", "0", "--output-len", "fixed:4",
         "--no-progress"]
    )  # fmt: skip
    assert all(r.output_tokens == 4 and r.output_tokens_source == "chunks" for r in records)
    assert any("no usage" in w for w in result["warnings"])
    result, records = run_bench(
        ["--base-url", fake_server.url, "-n", "3", "--rate", "20", "--warmup", "0", "--output-len", "fixed:4",
         "--no-progress", "--tokenizer", "byte"]
    )  # fmt: skip
    # The byte tokenizer counts the 16 bytes of "tok tok tok tok " as 16 tokens: a local estimate.
    assert all(r.output_tokens == 16 and r.output_tokens_source == "tokenizer" for r in records)


def test_server_that_ignores_max_tokens_is_flagged(fake_server: FakeServerProcess) -> None:
    fake_server.script([{**FAST, "tokens": 2}])
    result, _ = run_bench(
        ["--base-url", fake_server.url, "-n", "4", "--rate", "20", "--warmup", "0", "--output-len", "fixed:10",
         "--no-progress"]
    )  # fmt: skip
    assert result["output_length"]["short_fraction"] == pytest.approx(1.0)
    assert any("ignore_eos" in w for w in result["warnings"])


def test_closed_loop_honours_retry_after(fake_server: FakeServerProcess) -> None:
    # A refusal's own message says why (tailserve's: which target, the TPOT it predicted): kept whole.
    why = "Server overloaded: admitting this request would put 1 running request over " + "x" * 150
    fake_server.script([{"status": 429, "retry_after": 0.3, "message": why}])
    result, records = run_bench(
        ["--base-url", fake_server.url, "--arrival", "closed", "--concurrency", "1", "-n", "3", "--warmup", "0",
         "--no-progress"]
    )  # fmt: skip
    assert result["errors"]["by_kind"] == {"rate_limited": 3}
    assert all(r.retry_after_s == 0.3 and r.http_status == 429 for r in records)
    assert all(r.error_message == f"HTTP 429: {why}" for r in records)
    sent = sorted(r.sent_s for r in records)
    assert all(b - a >= 0.3 for a, b in zip(sent, sent[1:], strict=False))


def test_fatal_abort_stops_a_capped_open_loop(fake_server: FakeServerProcess) -> None:
    # The dispatcher is blocked waiting for a free slot when the abort comes: it must stop too.
    fake_server.script([{**FAST, "malformed": "garbage"}])
    result, records = run_bench(
        ["--base-url", fake_server.url, "--arrival", "constant", "--rate", "50", "-n", "200", "--max-concurrency", "1",
         "--warmup", "0", "--no-progress"]
    )  # fmt: skip
    assert result["status"] == "aborted" and "malformed_sse" in result["abort_reason"]
    assert 5 <= len(records) < 10
