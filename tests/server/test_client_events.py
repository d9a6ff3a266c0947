"""Clients that vanish are client events, not server errors: real `tailserve serve` and `tailserve
route` processes on loopback, raw sockets that stop half-way.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from urllib.parse import urlparse

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.harness import ServerProcess, free_port, running_process, serve_process, tailserve_command

CLIENTS = 5
HALF_UPLOAD_LOG = "closed the connection before its request body arrived"


def errors_by_status(base: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for sample in family.samples:
            if sample.name == "tailserve_request_errors_total":
                counts[sample.labels["status"]] = sample.value
    return counts


def abandon_uploads(base: str, clients: int) -> None:
    """Each client announces 10 kB of JSON, sends 100 bytes, and hangs up."""
    url = urlparse(base)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 10000\r\n\r\n"
    )
    for _ in range(clients):
        with socket.create_connection((url.hostname, url.port), timeout=20) as sock:
            sock.sendall(head.encode() + b'{"model": "dummy-tiny", "prompt": "' + b"a" * 64)
            time.sleep(0.05)  # the request is in the app, waiting for the rest of its body


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def assert_one_line_each(process: ServerProcess) -> None:
    log = process.log()
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]
    assert log.count(HALF_UPLOAD_LOG) == CLIENTS, log[-3000:]


def test_client_gone_mid_upload_is_one_log_line_and_a_499_not_a_500() -> None:
    with serve_process(["--model", "dummy:tiny", "--no-warmup", "--log-level", "info"]) as server:
        before = errors_by_status(server.base)
        abandon_uploads(server.base, CLIENTS)

        def settled() -> bool:
            now = errors_by_status(server.base)
            return sum(now.values()) - sum(before.values()) >= CLIENTS

        wait_for(settled, "the server never answered the abandoned uploads")
        after = errors_by_status(server.base)
        assert after.get("500", 0) == before.get("500", 0), after
        assert after.get("499", 0) - before.get("499", 0) == CLIENTS, after
        assert_one_line_each(server)

        port = free_port()
        cmd = tailserve_command("route", "--replica", server.base, "--port", str(port), "--log-level", "info")
        with running_process(cmd, port, ready_timeout_s=60) as router:
            abandon_uploads(router.base, CLIENTS)
            wait_for(
                lambda: router.log().count(HALF_UPLOAD_LOG) >= CLIENTS or "Traceback" in router.log(),
                "the router logged nothing about the abandoned uploads",
            )
            assert_one_line_each(router)
