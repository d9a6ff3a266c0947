"""Bad input: a clear message, a non-zero exit code, and whatever was measured saved."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tailserve.cli import main
from tests.bench.conftest import FakeServerProcess, start_fake_server

FAST = {"ttft_s": 0.01, "itl_s": 0.005, "tokens": 3}


def bench(capsys: pytest.CaptureFixture[str], out: Path, *argv: str) -> tuple[int, str]:
    code = main(
        [
            "bench",
            "--no-progress",
            "--no-calibrate",
            "--warmup",
            "0",
            "--out",
            str(out),
            "--output-len",
            "fixed:3",
            *argv,
        ]
    )
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def saved(out: Path) -> tuple[dict, list[dict]]:
    doc = json.loads(out.with_suffix(".json").read_text())
    rows = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    return doc, rows


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[FakeServerProcess]:
    server = start_fake_server("--model", "fake-model", "--api-key", "secret")
    yield server
    server.proc.terminate()
    server.proc.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_server(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "r"
    code, text = bench(capsys, out, "--base-url", f"http://127.0.0.1:{free_port()}", "-n", "3")
    assert code == 1
    assert "cannot reach" in text
    doc, rows = saved(out)
    assert doc["status"] == "aborted" and "cannot reach" in doc["abort_reason"] and rows == []


def test_wrong_model_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_server: FakeServerProcess
) -> None:
    code, text = bench(capsys, tmp_path / "r", "--base-url", fake_server.url, "--model", "nope", "-n", "3")
    assert code == 1
    assert "'nope' is not served" in text and "fake-model" in text


def test_auth_failure_and_success(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, keyed_server: FakeServerProcess
) -> None:
    code, text = bench(
        capsys, tmp_path / "a", "--base-url", keyed_server.url, "-n", "3", "--api-key", "wrong"
    )
    assert code == 1 and "authentication failed" in text
    keyed_server.script([FAST])
    code, text = bench(
        capsys, tmp_path / "b", "--base-url", keyed_server.url, "-n", "3", "--api-key", "secret"
    )
    assert code == 0, text
    assert saved(tmp_path / "b")[0]["counts"]["ok"] == 3


@pytest.mark.parametrize("kind", ["not_json", "garbage"])
def test_malformed_sse_aborts_with_partial_results(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_server: FakeServerProcess, kind: str
) -> None:
    fake_server.script([{**FAST, "malformed": kind, "malformed_at": 1}])
    out = tmp_path / "r"
    code, text = bench(
        capsys, out, "--base-url", fake_server.url, "--arrival", "constant", "--rate", "20", "-n", "40"
    )
    assert code == 1
    assert "malformed_sse" in text and ("not JSON" in text or "not an SSE line" in text)
    doc, rows = saved(out)
    assert doc["status"] == "aborted"
    assert doc["errors"]["all_phases"]["malformed_sse"] >= 5
    assert len(rows) >= 5 and all(r["error_kind"] in ("malformed_sse", "cancelled") for r in rows)
    # The first chunk arrived before the bad one: it was measured and kept in the per-request rows.
    assert any(r["chunk_times_s"] for r in rows if r["error_kind"] == "malformed_sse")


def test_some_malformed_streams_keep_the_good_measurements(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_server: FakeServerProcess
) -> None:
    fake_server.script([FAST, FAST, FAST, {**FAST, "malformed": "not_json"}])
    out = tmp_path / "r"
    code, text = bench(
        capsys, out, "--base-url", fake_server.url, "--arrival", "constant", "--rate", "50", "-n", "20"
    )
    assert code == 1  # malformed SSE points at the server: a non-zero exit even though the run completed
    doc, _ = saved(out)
    assert doc["status"] == "complete"
    assert doc["counts"]["ok"] == 15 and doc["errors"]["by_kind"] == {"malformed_sse": 5}
    assert doc["metrics"]["ttft_s"]["count"] == 15
    assert any("malformed_sse" in w for w in doc["warnings"])


def test_overload_errors_are_counted_not_fatal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_server: FakeServerProcess
) -> None:
    fake_server.script(
        [FAST] * 3 + [{"status": 429}] + [{**FAST, "done": False, "usage": False, "tokens": 2}]
    )
    out = tmp_path / "r"
    code, _ = bench(
        capsys, out, "--base-url", fake_server.url, "--arrival", "constant", "--rate", "50", "-n", "20"
    )
    assert code == 0
    doc, _ = saved(out)
    # A stream that ends with a finish_reason but no [DONE] is still a success.
    assert doc["errors"]["by_kind"] == {"rate_limited": 4}
    verdicts = {v["name"]: v["passed"] for v in doc["slo"]["verdicts"]}
    assert verdicts["error_rate"] is False  # 20% failed > 1%


def test_request_timeout(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_server: FakeServerProcess
) -> None:
    fake_server.script([FAST, {"ttft_s": 3.0, "itl_s": 0.01, "tokens": 2}])
    out = tmp_path / "r"
    code, _ = bench(capsys, out, "--base-url", fake_server.url, "--arrival", "constant", "--rate", "20", "-n", "6",
                    "--timeout", "0.5")  # fmt: skip
    assert code == 0
    doc, rows = saved(out)
    assert doc["errors"]["by_kind"] == {"timeout": 3}
    assert all(r["done_s"] < 1.5 for r in rows)


def test_trace_with_bad_lines(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_tokens": 4, "output_tokens": 2}\n{"timestamp": 1}\nnope\n')
    code, text = bench(capsys, tmp_path / "r", "--trace", str(trace))
    assert code == 2
    assert "line 2" in text and "line 3" in text and "2 bad line(s)" in text


def test_trace_replay_runs_on_its_clock(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_server: FakeServerProcess
) -> None:
    """Each trace line is sent at its timestamp / speed from the run start: never early, and late by
    no more than the client's start-up and its own event loop were (the probe it reports).

    Trace lines are 1 s apart at speed 10: ignoring the speed would send the last one 4.5 s late, and
    sending all at once would send them up to 0.5 s early, both far beyond scheduler noise."""
    fake_server.script([FAST])
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "\n".join(json.dumps({"timestamp": 10 + i, "input_tokens": 8, "output_tokens": 3}) for i in range(6))
    )
    out = tmp_path / "r"
    code, text = bench(
        capsys, out, "--base-url", fake_server.url, "--trace", str(trace), "--trace-speed", "10"
    )
    assert code == 0, text
    doc, rows = saved(out)
    assert [r["scheduled_s"] for r in rows] == pytest.approx([i * 0.1 for i in range(6)])
    lateness = [r["sent_s"] - r["scheduled_s"] for r in rows]
    assert min(lateness) > -0.001, lateness  # an absolute clock from the run start: never early
    # A stall that delays a send delays the loop-lag probe too, which wakes every 50 ms. The first
    # send also carries the client's start-up (building the HTTP client), which the probe cannot see.
    loop_lag_s = doc["client"]["loop_lag_p99_s"] or 0.0
    assert max(lateness) < lateness[0] + 0.1 + 2 * loop_lag_s, (lateness, loop_lag_s)


def test_ctrl_c_ends_cleanly_with_a_partial_report(tmp_path: Path, fake_server: FakeServerProcess) -> None:
    fake_server.script([{"ttft_s": 0.05, "itl_s": 0.05, "tokens": 20}])
    out = tmp_path / "r"
    cmd = [
        sys.executable, "-m", "tailserve.cli", "bench", "--base-url", fake_server.url, "--arrival", "constant",
        "--rate", "10", "--duration", "60", "--warmup", "0", "--progress", "--no-calibrate", "--out", str(out), "--output-len", "fixed:20",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    assert proc.stderr is not None
    # Wait for the progress line: the run is under way and Ctrl-C is handled by the runner.
    deadline = time.monotonic() + 60
    seen = ""
    while "sent" not in seen and time.monotonic() < deadline:
        seen += proc.stderr.read(1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, seen + err
    doc, rows = saved(out)
    assert doc["status"] == "interrupted"
    assert any("partial" in w for w in doc["warnings"])
    assert rows and out.with_suffix(".html").exists()


def _main(capsys: pytest.CaptureFixture[str], out: Path, *argv: str) -> tuple[int, str]:
    code = main(
        [
            "bench",
            "--no-progress",
            "--no-calibrate",
            "--no-html",
            "--out",
            str(out),
            "--output-len",
            "fixed:3",
            *argv,
        ]
    )
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_short_n_run_counts_its_warm_up_in_requests(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_server: FakeServerProcess
) -> None:
    """The preset's 30 s warm-up once swallowed a whole -n run; with -n it is a tenth of the requests."""
    fake_server.script([FAST])
    out = tmp_path / "r"
    code, text = _main(capsys, out, "--base-url", fake_server.url, "--rate", "50", "-n", "20")
    assert code == 0, text
    doc, rows = saved(out)
    assert doc["counts"]["warmup"] == 2 and doc["counts"]["measured"] == 18
    first_two = sorted(rows, key=lambda r: r["sent_s"])[:2]
    assert all(r["phase"] == "warmup" for r in first_two)
    again = ["--base-url", fake_server.url, "--rate", "50", "-n", "20", "--warmup-requests", "5"]
    code, text = _main(capsys, tmp_path / "w", *again)
    assert code == 0 and saved(tmp_path / "w")[0]["counts"]["measured"] == 15


def test_time_warm_up_with_n_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, text = _main(
        capsys, tmp_path / "r", "--base-url", "http://127.0.0.1:9", "-n", "100", "--warmup", "30"
    )
    assert code == 2 and "--warmup-requests" in text
    code, text = _main(
        capsys, tmp_path / "r", "--base-url", "http://127.0.0.1:9", "-n", "5", "--warmup-requests", "5"
    )
    assert code == 2 and "none of the 5" in text


def test_nothing_measured_exits_non_zero(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_server: FakeServerProcess
) -> None:
    fake_server.script([FAST])
    out = tmp_path / "r"
    code, text = _main(
        capsys, out, "--base-url", fake_server.url, "--rate", "20", "--duration", "0.5", "--warmup", "5"
    )
    assert code == 1, text
    assert "no request was measured" in text
    assert saved(out)[0]["counts"]["measured"] == 0
