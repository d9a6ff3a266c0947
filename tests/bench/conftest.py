"""Fixtures for bench tests: the scripted SSE server in its own process, and a way to run the bench."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tailserve.bench.app import run_once
from tailserve.bench.corpus import PromptSource
from tailserve.bench.records import RequestRecord
from tailserve.bench.settings import settings_from_args
from tailserve.bench.tokenizers import load_tokenizer
from tailserve.cli import build_parser

FAKE_SERVER = Path(__file__).with_name("fake_server.py")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class FakeServerProcess:
    """Handle on a running fake_server.py."""

    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def script(self, behaviours: list[dict[str, Any]]) -> None:
        httpx.post(self.url + "/_script", json=behaviours, timeout=10).raise_for_status()

    def log(self) -> list[dict[str, Any]]:
        return list(httpx.get(self.url + "/_log", timeout=10).json())


def start_fake_server(*extra: str) -> FakeServerProcess:
    proc = subprocess.Popen(
        [sys.executable, str(FAKE_SERVER), *extra], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("PORT "), f"fake server did not start: {line!r}"
    return FakeServerProcess(proc, int(line.split()[1]))


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServerProcess]:
    server = start_fake_server("--model", "fake-model")
    yield server
    server.proc.terminate()
    server.proc.wait(timeout=10)


def run_bench(argv: list[str]) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Parse `tailserve bench ARGV` with the real CLI parser and run it in-process. Calibration is
    off unless asked for: it would send requests of its own ahead of a test's scripted ones."""
    if "--calibrate" not in argv:
        argv = ["--no-calibrate", *argv]
    args = build_parser().parse_args(["bench", *argv])
    settings = settings_from_args(args)
    tokenizer = load_tokenizer(args.tokenizer)
    return asyncio.run(run_once(settings, tokenizer, PromptSource(tokenizer)))


def make_record(
    index: int,
    sent_s: float,
    ttft_s: float,
    itl_s: float,
    tokens: int,
    error: str | None = None,
    timings: dict[str, float] | None = None,
) -> RequestRecord:
    """A successful request with one token per chunk, or a failed one when `error` is set."""
    r = RequestRecord(index, index, 0, tokens, 10, scheduled_s=sent_s, sent_s=sent_s)
    if error:
        r.error_kind, r.error_message, r.done_s = error, "boom", 0.01
        return r
    r.chunk_times_s = [ttft_s + i * itl_s for i in range(tokens)]
    r.chunk_tokens = [1] * tokens
    r.output_tokens, r.input_tokens = tokens, 10
    r.done_s = r.chunk_times_s[-1] + 0.001
    r.server_timings = timings
    return r


def render_in_chromium(page: Path, tmp_path: Path) -> tuple[str, Path]:
    """Dump the rendered DOM and take a screenshot of `page` with headless Chromium."""
    assert CHROMIUM is not None
    flags = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
    ]  # fmt: skip
    dom = subprocess.run(
        [*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120
    ).stdout
    shot = tmp_path / "report.png"
    subprocess.run(
        [*flags, f"--screenshot={shot}", "--window-size=1400,3000", page.as_uri()],
        capture_output=True,
        timeout=120,
    )
    assert shot.exists(), "chromium took no screenshot"
    return dom, shot
