"""Shutdown as a process sees it: SIGTERM drains, the deadline ends open responses cleanly, a second
signal exits at once; the same for the router in front of a server.

Real processes and signals (the server stack around FakeEngine, so no model loads). Times are only
generous upper bounds: the point is the order of events and that nothing waits for the tokens.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

import httpx

from tailserve.http.serve import FORCED_EXIT_CODE
from tests.server.harness import (
    REPO,
    ServerProcess,
    child_env,
    free_port,
    running_process,
    serve_process,
    tailserve_command,
)

LONG = {"model": "fake-model", "prompt": "hello", "max_tokens": 400}  # 400 steps of 50 ms: 20 s


def open_request(base: str, body: dict[str, object]) -> socket.socket:
    """A raw HTTP/1.1 POST, so the test reads exactly what the server sent before closing."""
    url = urlparse(base)
    sock = socket.create_connection((url.hostname, url.port))
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    sock.settimeout(60)
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    got = b""
    while marker not in got:
        chunk = sock.recv(65536)
        assert chunk, f"closed before {marker!r}: {got[-300:]!r}"
        got += chunk
    return got


def read_to_close(sock: socket.socket) -> bytes:
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    sock.close()
    return got


def sse_payloads(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]


def assert_cut_cleanly(raw: bytes) -> None:
    """A stream ended at the deadline: tokens, then one error event, then [DONE], then the chunked end."""
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]", payloads[-3:]
    error = json.loads(payloads[-2])["error"]
    assert error["code"] == "draining" and error["type"] == "service_unavailable_error"
    assert all("error" not in json.loads(p) for p in payloads[:-2])
    assert raw.endswith(b"0\r\n\r\n"), raw[-50:]  # the chunked body was terminated, not cut


def waiting(base: str) -> float:
    """The engine's queue length, from /metrics."""
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("tailserve_requests_waiting "):
            return float(line.split()[1])
    raise AssertionError("no tailserve_requests_waiting in /metrics")


def assert_clean_log(server: ServerProcess) -> None:
    log = server.log()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]


def test_drain_deadline_ends_every_open_response_and_the_process_exits() -> None:
    args = ["--step-s", "0.05", "--drain-timeout", "1"]
    with serve_process(args, fake=True, ready_timeout_s=60) as server:
        streams = [open_request(server.base, {**LONG, "stream": True}) for _ in range(4)]
        for sock in streams:
            read_until(sock, b"data: ")
        plain = open_request(server.base, LONG)
        # The plain request is queued in the engine (4 run at once) before the signal: a fixed sleep
        # left a busy machine's request still on its way when the drain began.
        deadline = time.monotonic() + 30
        while waiting(server.base) < 1:
            assert time.monotonic() < deadline, "the plain request never reached the engine"
            time.sleep(0.05)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        # Far below the 20 s the tokens would take; the bound only has to be generous.
        assert time.monotonic() - started < 15
        for sock in streams:
            assert_cut_cleanly(read_to_close(sock))
        head, _, body = read_to_close(plain).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), head
        assert json.loads(body)["error"]["code"] == "draining"
        assert_clean_log(server)


def test_second_signal_ends_open_responses_at_once_and_exits_non_zero() -> None:
    with serve_process(
        ["--step-s", "0.05", "--drain-timeout", "60"], fake=True, ready_timeout_s=60
    ) as server:
        streams = [open_request(server.base, {**LONG, "stream": True}) for _ in range(4)]
        for sock in streams:
            read_until(sock, b"data: ")
        plain = open_request(server.base, LONG)
        deadline = time.monotonic() + 30
        while waiting(server.base) < 1:  # the plain request is queued in the engine
            assert time.monotonic() < deadline, "the plain request never reached the engine"
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.base}/ready").status_code != 503:  # the drain has begun
            assert time.monotonic() < deadline
            time.sleep(0.05)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        # Non-zero: a supervisor must know the drain was cut short.
        assert server.proc.wait(timeout=45) == FORCED_EXIT_CODE
        assert time.monotonic() - started < 15  # not the 60 s drain
        for sock in streams:  # each open stream still got its error event and [DONE]
            assert_cut_cleanly(read_to_close(sock))
        head, _, body = read_to_close(plain).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), head
        assert json.loads(body)["error"]["code"] == "draining"
        assert_clean_log(server)


def test_router_drains_like_the_server_and_exits_zero() -> None:
    with serve_process(
        ["--step-s", "0.05", "--drain-timeout", "30"], fake=True, ready_timeout_s=60
    ) as replica:
        port = free_port()
        cmd = tailserve_command(
            "route",
            "--replica",
            replica.base,
            "--port",
            str(port),
            "--drain-timeout",
            "1",
            "--log-level",
            "warning",
        )
        with running_process(cmd, port, ready_timeout_s=60) as router:
            streams = [open_request(router.base, {**LONG, "stream": True}) for _ in range(3)]
            for sock in streams:
                read_until(sock, b"data: ")
            started = time.monotonic()
            router.proc.send_signal(signal.SIGTERM)
            assert router.proc.wait(timeout=60) == 0
            assert time.monotonic() - started < 15
            for sock in streams:
                assert_cut_cleanly(read_to_close(sock))
            assert_clean_log(router)
        # The router closed its upstream streams: the replica aborted them and is idle again.
        deadline = time.monotonic() + 30
        while "tailserve_requests_running 0.0" not in httpx.get(f"{replica.base}/metrics").text:
            assert time.monotonic() < deadline, "the replica kept generating for a gone router"
            time.sleep(0.1)


def test_a_server_that_cannot_bind_its_port_exits_1_not_the_forced_drain_status() -> None:
    """A port another process listens on: the server says why and exits 1 ("could not start"), not
    uvicorn's own 3, which is this server's status for a drain cut short by a second signal."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        cmd = [sys.executable, str(REPO / "tests/server/fake_serve.py"), "--port", str(port)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=child_env(), cwd=REPO)
    assert done.returncode == 1 != FORCED_EXIT_CODE, done.stderr[-2000:]
    assert "address already in use" in done.stderr, done.stderr[-2000:]
