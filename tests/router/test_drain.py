"""The router's shutdown as a load balancer and a supervisor see it: real `tailserve route` processes
in front of a real server stack (FakeEngine, so no model loads), driven by signals.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tailserve.http.serve import FORCED_EXIT_CODE
from tests.server.harness import ServerProcess, free_port, running_process, serve_process, tailserve_command
from tests.server.test_shutdown import (
    LONG,
    assert_clean_log,
    assert_cut_cleanly,
    open_request,
    read_to_close,
    read_until,
)


@contextmanager
def router_over_replica(drain_timeout_s: float) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A fake-engine replica (50 ms steps) and a `tailserve route` in front of it."""
    with serve_process(
        ["--step-s", "0.05", "--drain-timeout", "30"], fake=True, ready_timeout_s=60
    ) as replica:
        port = free_port()
        cmd = tailserve_command("route", "--replica", replica.base, "--port", str(port))
        cmd += ["--drain-timeout", str(drain_timeout_s), "--log-level", "warning", "--health-interval", "0.2"]
        with running_process(cmd, port, ready_timeout_s=60) as router:
            yield replica, router


def test_router_ready_turns_503_as_soon_as_its_drain_begins() -> None:
    with router_over_replica(drain_timeout_s=60) as (_, router):
        stream = open_request(router.base, {**LONG, "stream": True})  # keeps the drain waiting
        read_until(stream, b"data: ")
        router.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while httpx.post(f"{router.base}/v1/completions", json=LONG).status_code != 503:
            assert time.monotonic() < deadline, "the drain never began"
            time.sleep(0.05)
        # New requests are refused: a load balancer must stop sending them here.
        ready = httpx.get(f"{router.base}/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        assert httpx.get(f"{router.base}/health").status_code == 200  # alive, only leaving
        stream.close()  # the last request in flight goes: the drain ends
        assert router.proc.wait(timeout=60) == 0


def test_router_second_signal_ends_relayed_streams_and_exits_non_zero() -> None:
    with router_over_replica(drain_timeout_s=60) as (replica, router):
        streams = [open_request(router.base, {**LONG, "stream": True}) for _ in range(3)]
        for sock in streams:
            read_until(sock, b"data: ")
        router.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while httpx.get(f"{router.base}/ready").status_code != 503:  # the drain has begun
            assert time.monotonic() < deadline, "the drain never began"
            time.sleep(0.05)
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(timeout=45) == FORCED_EXIT_CODE  # not the 60 s drain, and not 0
        for sock in streams:
            assert_cut_cleanly(read_to_close(sock))
        assert_clean_log(router)
        # The router closed its upstream streams: the replica aborted them.
        deadline = time.monotonic() + 30
        while "tailserve_requests_running 0.0" not in httpx.get(f"{replica.base}/metrics").text:
            assert time.monotonic() < deadline, "the replica kept generating for a gone router"
            time.sleep(0.1)
