"""Start a tailserve server on a free loopback port: uvicorn in a thread (fake engine) or a process.

The one "start a process, poll /ready, stop it" helper of the tests (server, router, bench). Test
plumbing only; it never picks a fixed port and always stops what it started.
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
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from tailserve.router import launcher
from tailserve.server.app import create_app
from tailserve.server.config import ServerConfig
from tailserve.server.engine_api import Engine

REPO = Path(__file__).resolve().parents[2]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a test's child process runs in: this one, importing this tree's src and tests."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]), **(extra or {})}


PORT_TRIES = 3  # serve_process's ports to try


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(base_url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll /ready until 200 (the launcher's own loop: one implementation for src and tests)."""
    launcher.wait_ready([base_url], [proc] if proc is not None else [], timeout_s, poll_s=0.05)


@dataclass
class ServerProcess:
    """A server (or router, or fake) process started by `running_process`, with its log file."""

    base: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def tailserve_command(*args: str) -> list[str]:
    """`python -m tailserve.cli ARGS`, with this interpreter."""
    return [sys.executable, "-m", "tailserve.cli", *args]


class PortTaken(RuntimeError):
    """The process exited before it was ready because another socket had taken its port meanwhile
    (free_port's port is free when it answers, not later: on a busy machine a client's connection
    can get it as its own ephemeral port first)."""


@contextmanager
def running_process(
    cmd: list[str], port: int, ready_timeout_s: float = 120, env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    """Start `cmd` (which listens on `port`), wait for /ready, yield it; always stop it (SIGKILL if
    still up). PortTaken if it could not bind its port."""
    env = child_env(env)
    log_path = Path(f"/tmp/tailserve-test-{port}.log")
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            handle = ServerProcess(f"http://127.0.0.1:{port}", proc, log_path)
            try:
                wait_ready(handle.base, ready_timeout_s, proc)
            except RuntimeError as exc:
                if proc.poll() is not None and "address already in use" in handle.log():
                    raise PortTaken(f"port {port} was taken before {cmd[:4]} could bind it") from exc
                raise
            yield handle
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)


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
) -> Iterator[ServerProcess]:
    """`tailserve serve ARGS` (or tests/server/fake_serve.py when fake) as a subprocess on a free
    port; on another free port if something took the first before the server could bind it."""
    for attempt in range(PORT_TRIES):
        port = free_port()
        if fake:
            cmd = [sys.executable, str(REPO / "tests/server/fake_serve.py"), "--port", str(port), *args]
        else:
            cmd = tailserve_command("serve", "--port", str(port), "--log-level", "warning", *args)
        try:
            with running_process(cmd, port, ready_timeout_s) as handle:
                yield handle
            return
        except PortTaken:  # raised before the yield: the caller's block has not run
            if attempt + 1 == PORT_TRIES:
                raise
