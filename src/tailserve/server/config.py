"""ServerConfig: the HTTP-side settings of `tailserve serve` (bind address, auth, limits, drain).

A plain frozen value validated on construction; building one never opens a socket or loads a model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tailserve.errors import ConfigError
from tailserve.http.tls import TlsFiles
from tailserve.server.generation_defaults import GenerationDefaults
from tailserve.server.slo_classes import SloClasses

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class ServerConfig:
    """Bind address, API key, body limit, drain timeout, the default reply length and SLO classes.

    Admission limits (queue bound, running slots, TTFT target) are the engine's: SchedulerConfig."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    max_tokens_default: int = 1024  # a request without max_tokens generates at most this many tokens
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)  # the model's own
    warmup: bool = True
    slo_classes: SloClasses | None = None  # --slo-classes; None: the built-in interactive and batch
    # Python's GIL switch interval in this process (default: Python's own 5 ms): how long the engine
    # thread may wait for the GIL back from the HTTP thread after each model call (docs/ENGINE.md).
    switch_interval_s: float = 0.005
    # Admission scales the engine's TTFT predictions by the error it learned from admitted requests
    # (server/admission.py WaitCorrection); False: the engine's predictions as they are.
    admission_correction: bool = True
    # Each request's cache_salt is derived from its API key (and its own salt), so keys never share
    # prefix-cache blocks (docs/SERVER.md "cache_salt"); off: the request's own cache_salt, as vLLM.
    cache_salt_from_api_key: bool = False
    # The request's SLO choices (x-slo-ttft-ms / x-slo-tpot-ms headers, the body's `slo` and
    # `priority`) come from a trusted front, so they may tighten the caller's SLO class; off: they
    # only loosen it (docs/SERVER.md "Who may tighten"). --trust-request-slo (old: --trust-slo-headers).
    trust_request_slo: bool = False
    tls: TlsFiles | None = None  # --ssl-certfile and friends: HTTPS (vLLM's flags)
    root_path: str = ""  # --root-path: the ASGI root path behind a path-prefixing proxy
    access_log: bool = True  # off: --disable-uvicorn-access-log
    openapi: bool = True  # /openapi.json; off: --disable-fastapi-docs

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"--drain-timeout must not be negative, got {self.drain_timeout_s}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.max_tokens_default < 1:
            raise ConfigError(f"--max-tokens-default must be at least 1, got {self.max_tokens_default}")
        if not 1e-6 <= self.switch_interval_s <= 0.1:
            raise ConfigError(
                f"--switch-interval-ms must be in [0.001, 100], got {self.switch_interval_s * 1000:g}"
            )
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key must not be empty")
        if self.tls is not None:
            _check_tls(self.tls)


def _check_tls(tls: TlsFiles) -> None:
    """Every named file readable now, so a typo is exit 2 at start rather than a failed handshake."""
    named = {"--ssl-certfile": tls.certfile, "--ssl-keyfile": tls.keyfile, "--ssl-ca-certs": tls.ca_certs}
    for flag, path in named.items():
        if path is not None and not os.access(path, os.R_OK):
            raise ConfigError(f"{flag} {path}: no such readable file")
    if tls.cert_reqs not in (0, 1, 2):
        raise ConfigError(
            f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {tls.cert_reqs}"
        )
    if tls.cert_reqs and not tls.ca_certs:
        raise ConfigError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs to check client certificates against")
