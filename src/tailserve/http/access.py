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
_SGLANG = (
    "SGLang's worker route (its gateway sends the worker's key, and SGLang's own key guards every route "
    "but /health and /metrics)"
)

# What `tailserve serve` answers; the router forwards the keyed API rows to its replicas.
SERVER_ACCESS: tuple[RouteAccess, ...] = (
    RouteAccess(
        "/v1/",
        True,
        "the OpenAI API (completions, chat, responses, models): generation spends the server's capacity",
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
        "Prometheus scrapers rarely carry a key (vLLM and SGLang leave it open too); aggregate counts "
        "only, no prompt, key or URL",
    ),
    RouteAccess("/version", False, "the version string only, open as in vLLM"),
    RouteAccess(
        "/openapi.json",
        False,
        "the API's schema, open as in vLLM: no user data (--disable-fastapi-docs removes the route)",
    ),
    RouteAccess("/server_info", True, f"{_SGLANG}; shows the deployment's limits and model path"),
    RouteAccess("/get_server_info", True, "as /server_info (SGLang's older name)"),
    RouteAccess("/model_info", True, f"{_SGLANG}; shows the model path"),
    RouteAccess("/get_model_info", True, "as /model_info (SGLang's older name)"),
    RouteAccess("/get_load", True, f"{_SGLANG}; /metrics is the open view of the same load"),
    RouteAccess(
        "/flush_cache",
        True,
        "it changes state: emptying the prefix cache costs every later request its cached prefix",
    ),
)

# The router serves the API rows itself (forwarded to a replica), its own probes and /metrics, and the
# operator's view; SGLang's worker routes belong to a worker, not to a router in front of workers.
_ROUTED = ("/v1/", "/tokenize", "/detokenize", "/health", "/ready", "/metrics", "/version", "/openapi.json")
ROUTER_ACCESS: tuple[RouteAccess, ...] = (
    *(row for row in SERVER_ACCESS if row.path in _ROUTED),
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
