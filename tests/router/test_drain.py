"""The router's shutdown as a load balancer and a supervisor see it: real `tailserve route` processes
in front of a real server stack (FakeEngine, so no model loads), driven by signals.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tests.server.harness import ServerProcess, free_port, running_process, serve_process, tailserve_command
from tests.server.test_shutdown import LONG, open_request, read_until


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
