"""`tailserve serve`'s app under uvicorn until drained (tailserve.http.serve), with the server's
GIL switch interval. Never builds the engine."""

from __future__ import annotations

import sys

from fastapi import FastAPI

from tailserve.http.drain import Drain
from tailserve.http.serve import serve_until_drained
from tailserve.server.config import ServerConfig


def run_server(app: FastAPI, config: ServerConfig) -> int:
    """`tailserve serve`'s app and ServerConfig: serve until drained."""
    drain: Drain = app.state.tailserve.admission.drain
    # The engine thread gives the GIL up at every model call (torch ops and the fused kernels run
    # without it) and wins it back from the HTTP thread within this interval (docs/ENGINE.md).
    sys.setswitchinterval(config.switch_interval_s)
    return serve_until_drained(
        app,
        drain,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        drain_timeout_s=config.drain_timeout_s,
        access_log=config.access_log,
        tls=config.tls,
        root_path=config.root_path,
    )
