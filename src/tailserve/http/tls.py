"""TLS for uvicorn (vLLM's --ssl-* flags) and --enable-ssl-refresh: the certificate files re-read
into the live SSL context when they change, so a rotated certificate (cert-manager, KServe) takes
effect for new connections without a restart. Never touches open connections.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("tailserve.server")


@dataclass(frozen=True)
class TlsFiles:
    """The certificate, its key, the CA bundle for client certificates, and whether to reload them."""

    certfile: str
    keyfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = int(ssl.CERT_NONE)
    refresh: bool = False

    def uvicorn_options(self) -> dict[str, Any]:
        """uvicorn.Config's ssl_* keyword arguments."""
        return {
            "ssl_certfile": self.certfile,
            "ssl_keyfile": self.keyfile,
            "ssl_ca_certs": self.ca_certs,
            "ssl_cert_reqs": self.cert_reqs,
        }

    def stamps(self) -> tuple[tuple[int, int] | None, ...]:
        """(mtime_ns, size) of each file; None for a file missing at this instant (mid-rotation)."""
        out = []
        for path in (self.certfile, self.keyfile, self.ca_certs):
            try:
                st = os.stat(path) if path else None
            except OSError:
                st = None
            out.append((st.st_mtime_ns, st.st_size) if st is not None else None)
        return tuple(out)


async def refresh_certificates(context: ssl.SSLContext, tls: TlsFiles, poll_s: float = 1.0) -> None:
    """Until cancelled: when a file changes, load the chain (and CA bundle) into `context` again.
    A half-written file fails to load, the old chain keeps serving, and the write that completes
    it is the next change."""
    seen = tls.stamps()
    while True:
        await asyncio.sleep(poll_s)
        now = tls.stamps()
        if now == seen or None in now[: 2 if tls.keyfile else 1]:
            continue
        seen = now
        try:
            context.load_cert_chain(tls.certfile, tls.keyfile)
            if tls.ca_certs:
                context.load_verify_locations(tls.ca_certs)
        except (OSError, ssl.SSLError) as exc:
            log.warning(
                "TLS refresh: cannot load %s yet (%s); serving the previous certificate", tls.certfile, exc
            )
            continue
        log.info("TLS refresh: reloaded %s", tls.certfile)
