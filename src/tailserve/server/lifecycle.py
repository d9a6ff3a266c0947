"""Runs an app under uvicorn with a graceful drain on SIGTERM/SIGINT.

First signal: stop admitting (503), wait for in-flight requests up to the drain timeout, then let
uvicorn shut down and exit 0. A second signal exits at once. Never re-raises the signal.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from tailserve.server.admission import Admission
from tailserve.server.config import ServerConfig

log = logging.getLogger("tailserve.server")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose signal handler drains the app before exiting."""

    def __init__(self, config: uvicorn.Config, admission: Admission, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._admission = admission
        self._drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the signal handler: only flags and a thread-safe hop onto the loop.
        if self._loop is None or self._drain_task is not None or self.should_exit:
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        in_flight = self._admission.in_flight
        log.info("draining: refusing new requests, waiting for %d in flight", in_flight)
        self._admission.begin_drain()
        if not await self._admission.wait_idle(self._drain_timeout_s):
            log.warning("drain timeout: %d requests still in flight", self._admission.in_flight)
        self.should_exit = True


def run_server(app: FastAPI, config: ServerConfig) -> int:
    """Serve until drained after a signal; 0 on a clean exit, 1 if the server could not start."""
    admission: Admission = app.state.tailserve.admission
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        lifespan="on",
        timeout_graceful_shutdown=max(1, int(config.drain_timeout_s)),
    )
    server = DrainingServer(uv_config, admission, config.drain_timeout_s)
    server.run()
    return 0 if server.started else 1
