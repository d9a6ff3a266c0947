"""Which paths need the API key: one table per app, read by ApiKeyMiddleware and checked by a test
against every route the server and the router declare (tests/server/test_access.py).

Fail closed: a path no open row covers needs the key. A row covers its exact path, or every path
under it when it ends in "/". docs/SERVER.md and docs/ROUTER.md print these tables.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouteAccess:
    """One row: a path (or a prefix ending in "/"), whether it needs the key, and why."""

    path: str
    needs_key: bool
    why: str

    def covers(self, path: str) -> bool:
        """Whether a request path falls under this row."""
        return path.startswith(self.path) if self.path.endswith("/") else path == self.path


_PROBE = "probes (Kubernetes, load balancers) carry no key; the answer holds no user data"

# What `tailserve serve` answers; the router forwards the keyed rows to its replicas.
SERVER_ACCESS: tuple[RouteAccess, ...] = (
    RouteAccess(
        "/v1/", True, "the OpenAI API: generation spends the server's capacity, models name what it serves"
    ),
    RouteAccess(
        "/tokenize",
        True,
        "stricter than vLLM (whose key guards /v1 only): tokenizing a body of up to --max-body-bytes "
        "costs CPU on the serving thread and shows the chat template, so strangers do not get it",
    ),
    RouteAccess("/detokenize", True, "as /tokenize"),
    RouteAccess("/health", False, _PROBE),
    RouteAccess("/ready", False, _PROBE),
    RouteAccess(
        "/metrics",
        False,
        "Prometheus scrapers rarely carry a key (as vLLM); aggregate counts only, no prompt, key or URL",
    ),
)

ROUTER_ACCESS: tuple[RouteAccess, ...] = (
    *SERVER_ACCESS,
    RouteAccess("/router/", True, "the operator's view: replica URLs and their health"),
)


def needs_key(table: tuple[RouteAccess, ...], path: str) -> bool:
    """True unless an open row covers `path` (unknown paths need the key, so a new route is never
    open by accident)."""
    return not any(row.covers(path) and not row.needs_key for row in table)


def row_for(table: tuple[RouteAccess, ...], path: str) -> RouteAccess | None:
    """The row covering `path` (an exact row before a prefix), or None when the table misses it."""
    exact = [row for row in table if row.path == path]
    return exact[0] if exact else next((row for row in table if row.covers(path)), None)
