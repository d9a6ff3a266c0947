"""Server processes for benchmarks: start one in its own process group, poll a readiness URL, stop
the whole group however the caller leaves. Standard library only, so any venv (a peer's included)
can import it; it never imports tailserve.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def thread_env(threads: int) -> dict[str, str]:
    """The variables that cap torch's / OpenMP's / MKL's worker threads."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    """The status of a GET, or None when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return None


def get_json(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """GET and decode a JSON answer (HTTP errors raise)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def post_json(url: str, body: Mapping[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
    """POST a JSON body and return the decoded JSON answer (HTTP errors raise)."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def stop_process_group(proc: subprocess.Popen[Any], grace_s: float = 20.0, sig: int = signal.SIGTERM) -> None:
    """Signal the child's process group (it was started in a new session), SIGKILL what lingers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):  # stragglers left in its group
        os.killpg(proc.pid, signal.SIGKILL)


class ServerProcess:
    """One server process: `with ServerProcess(...) as server: server.wait_ready()`.

    Output goes to `log_path`; the server runs in its own session, so Ctrl-C reaches us and we stop
    it (and whatever it forked) ourselves."""

    def __init__(
        self,
        command: Sequence[str],
        port: int,
        log_path: Path,
        ready_path: str = "/ready",
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.command = list(command)
        self.port = port
        self.log_path = log_path
        self.ready_path = ready_path
        self.env = dict(env or {})
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0  # time.monotonic() at start
        self.ready_after_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log_file:  # the child keeps its own handle
            self.started_at = time.monotonic()
            self.proc = subprocess.Popen(
                self.command,
                cwd=self.cwd,
                env={**os.environ, **self.env},
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self, timeout_s: float = 600.0, poll_s: float = 0.25) -> float:
        """Poll `ready_path` until it answers 200; returns seconds since start. Raises RuntimeError
        when the process exits first or the timeout passes (the log's tail is in the message)."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        url = self.url + self.ready_path
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"exited with code {self.proc.returncode} before {url} answered:\n{self.log_tail()}"
                )
            if http_status(url) == 200:
                self.ready_after_s = time.monotonic() - self.started_at
                return self.ready_after_s
            time.sleep(poll_s)
        raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is not None:
            proc, self.proc = self.proc, None
            stop_process_group(proc, grace_s)

    def log_tail(self, lines: int = 12) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])
