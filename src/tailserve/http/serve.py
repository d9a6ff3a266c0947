"""Runs an ASGI app (the server's or the router's) under uvicorn with a graceful drain on SIGTERM/SIGINT.

First signal: stop admitting (503), wait for in-flight requests up to the drain timeout, then end
every response still open (SSE streams get an error event and [DONE]) and exit 0 promptly. A second
signal cuts the drain: every open response ends the same way at once (given FORCED_GRACE_S to
flush), and the process exits FORCED_EXIT_CODE; a third exits without waiting. Never re-raises the signal. Malformed HTTP (e.g. oversized headers) gets an
OpenAI JSON error with h11's status (431 for headers) instead of a reset connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tailserve.http.drain import Drain
from tailserve.http.errors import error_body
from tailserve.http.tls import TlsFiles, refresh_certificates

log = logging.getLogger("tailserve.server")
# Responses ended at the drain deadline need a moment to flush before uvicorn closes connections.
SHUTDOWN_GRACE_S = 2
FORCED_GRACE_S = 0.5  # after a second signal, for the open responses' last events to go out
FORCED_EXIT_CODE = 3  # the drain was cut by a second signal (0: drained; 1: could not start)
LINGER_S = 2.0  # how long a rejected connection keeps reading (so closing it sends no RST)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose signal handler drains the app before exiting."""

    def __init__(
        self, config: uvicorn.Config, drain: Drain, drain_timeout_s: float, tls: TlsFiles | None = None
    ) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signalled = False
        self._tls = tls
        self.forced = False  # a second signal cut the drain

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        refresh = None
        if self._tls is not None and self._tls.refresh:
            # uvicorn builds its SSL context in config.load(), before serving: reload into that one.
            self.config.load()
            assert self.config.ssl is not None
            refresh = asyncio.create_task(refresh_certificates(self.config.ssl, self._tls))
        try:
            await super().serve(sockets)
        finally:
            if refresh is not None:
                refresh.cancel()
                await asyncio.gather(refresh, return_exceptions=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the signal handler: only flags and a thread-safe hop onto the loop.
        if self._loop is None or self.forced:
            log.warning("signal during start-up, or a third signal: exiting now")
            self.forced = True
            self.force_exit = True
            self.should_exit = True
            return
        if self._signalled:
            self.forced = True
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._cut_drain()))
            return
        self._signalled = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._run_drain()))

    async def _cut_drain(self) -> None:
        """A second signal: end every open response now (an SSE error event and [DONE], or a 503),
        give them FORCED_GRACE_S to go out, then exit."""
        drain = self._drain
        log.warning("second signal: ending %d requests in flight now and exiting", drain.in_flight)
        drain.close_streams()
        await drain.wait_idle(FORCED_GRACE_S)
        self.should_exit = True

    async def _run_drain(self) -> None:
        drain = self._drain
        log.info(
            "draining: refusing new requests, waiting up to %gs for %d in flight",
            self._drain_timeout_s,
            drain.in_flight,
        )
        drain.begin()
        if not await drain.wait_idle(self._drain_timeout_s):
            log.warning("drain timeout: ending %d requests still in flight", drain.in_flight)
            drain.close_streams()
            await drain.wait_idle(SHUTDOWN_GRACE_S)
        self.should_exit = True


class JSONErrorH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering unparseable requests with h11's status hint as OpenAI JSON."""

    _rejected = False

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this inside `except h11.RemoteProtocolError`, so the error is at hand.
        exc = sys.exc_info()[1]
        status = exc.error_status_hint if isinstance(exc, h11.RemoteProtocolError) else 400
        message = "Request headers too large" if status == 431 else "Invalid HTTP request"
        body = json.dumps(error_body(message, "invalid_request_error", None, "bad_http_request")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=status, headers=headers),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        # Closing with unread request bytes makes the kernel send RST, and the client never reads
        # the answer: keep discarding what arrives for a moment, then close.
        self._rejected = True
        self.loop.call_later(LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if not self._rejected:
            super().data_received(data)


def serve_until_drained(
    app: Any,
    drain: Drain,
    *,
    host: str,
    port: int,
    log_level: str,
    drain_timeout_s: float,
    access_log: bool,
    tls: TlsFiles | None = None,
    root_path: str = "",
) -> int:
    """Serve until drained after a signal; 0 on a clean exit, 1 if the server could not start.
    `tls`: serve HTTPS (and reload the certificate when it changes, if asked)."""
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        http=JSONErrorH11Protocol,
        access_log=access_log,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        root_path=root_path,
        **(tls.uvicorn_options() if tls is not None else {}),
    )
    server = DrainingServer(uv_config, drain, drain_timeout_s, tls)
    try:
        server.run()
    except SystemExit:
        # uvicorn exits with its STARTUP_FAILURE, 3 (our FORCED_EXIT_CODE), when it cannot bind the
        # port (it has logged why): not started is 1 here.
        if server.started:
            raise
        return 1
    if not server.started:
        return 1
    return FORCED_EXIT_CODE if server.forced else 0
