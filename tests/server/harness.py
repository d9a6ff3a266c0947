"""Start a tailserve server on a free loopback port: uvicorn in a thread (fake engine) or a subprocess.

Test plumbing only; it never picks a fixed port and always stops what it started.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from tailserve.server.app import create_app
from tailserve.server.config import ServerConfig
from tailserve.server.engine_api import Engine

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(base_url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll /ready until 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited early with {proc.returncode}")
        try:
            if httpx.get(f"{base_url}/ready", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{base_url} not ready after {timeout_s}s")


@contextmanager
def threaded_server(engine: Engine, config: ServerConfig | None = None, ready: bool = True) -> Iterator[str]:
    """uvicorn serving create_app(engine) in a thread; yields the base URL."""
    port = free_port()
    cfg = config or ServerConfig()
    cfg = dataclasses.replace(cfg, port=port, log_level="warning")
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, cfg), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        if ready:
            wait_ready(base, 10)
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def serve_process(
    args: list[str], ready_timeout_s: float = 120, fake: bool = False
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`tailserve serve ARGS` (or tests/server/fake_serve.py when fake) as a subprocess on a free port."""
    port = free_port()
    if fake:
        cmd = [sys.executable, str(REPO / "tests/server/fake_serve.py"), "--port", str(port), *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "tailserve.cli",
            "serve",
            "--port",
            str(port),
            "--log-level",
            "warning",
            *args,
        ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    log = open(f"/tmp/tailserve-test-{port}.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, ready_timeout_s, proc)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()
