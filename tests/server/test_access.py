"""Who needs the API key, as a client meets it: real `tailserve serve` and `tailserve route` processes
with --api-key on loopback; and every route either app declares checked against the one access
table (tailserve/http/access.py) and its copy in the docs, so a new route cannot slip past it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator, Sequence

import httpx
import pytest
from starlette.applications import Starlette

from tailserve.http.access import ROUTER_ACCESS, SERVER_ACCESS, RouteAccess, needs_key, row_for
from tailserve.router.app import create_app as create_router_app
from tailserve.router.config import RouterConfig
from tailserve.server.app import create_app as create_server_app
from tailserve.server.config import ServerConfig
from tests.router.fake_replica import ThreadedServer
from tests.server.bad_inputs import TINY
from tests.server.fake_engine import FakeEngine
from tests.server.harness import (
    REPO,
    ServerProcess,
    free_port,
    running_process,
    serve_process,
    tailserve_command,
    threaded_server,
)

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A dummy:tiny server and a router in front of it, both with --api-key."""
    with serve_process(["--model", "dummy:tiny", "--api-key", KEY, "--no-warmup"]) as server:
        port = free_port()
        cmd = tailserve_command("route", "--replica", server.base, "--port", str(port), "--api-key", KEY)
        cmd += ["--health-interval", "0.2", "--log-level", "warning"]
        with running_process(cmd, port, ready_timeout_s=60) as router:
            yield server, router


def test_tokenize_and_detokenize_need_the_key_on_server_and_router(
    keyed: tuple[ServerProcess, ServerProcess],
) -> None:
    server, router = keyed
    calls = [
        ("/tokenize", {"model": TINY, "prompt": "hi!"}),
        ("/detokenize", {"model": TINY, "tokens": [107]}),
    ]
    for base in (server.base, router.base):
        for path, body in calls:
            refused = httpx.post(f"{base}{path}", json=body)
            assert refused.status_code == 401, (base, path, refused.text)
            assert refused.json()["error"]["code"] == "invalid_api_key"
        for path in ("/health", "/ready", "/metrics"):  # probes and scrapers carry no key
            assert httpx.get(f"{base}{path}").status_code == 200, (base, path)
    for path, body in calls:  # the router forwards what the server serves, answer for answer
        direct = httpx.post(f"{server.base}{path}", json=body, headers=AUTH)
        routed = httpx.post(f"{router.base}{path}", json=body, headers=AUTH)
        assert direct.status_code == routed.status_code == 200, (path, routed.text)
        assert routed.json() == direct.json()


# --- the route-by-route table: every declared route is in it, behaves as it says, and the docs print it


def _routes(app: Starlette) -> list[tuple[str, str]]:
    """(path with its parameters filled in, one method) for every route the app declares, those of
    mounted apps and included routers too."""
    out = []
    for path, methods in _declared(app.routes, ""):
        chosen = sorted(m for m in (methods or {"GET"}) if m != "HEAD")[0]
        out.append((re.sub(r"\{[^}]*\}", "x", path), chosen))
    return out


def _declared(routes: Sequence[object], prefix: str) -> Iterator[tuple[str, set[str] | None]]:
    for route in routes:
        path = getattr(route, "path", None)
        included = getattr(route, "original_router", None)  # FastAPI's include_router entry
        inner = getattr(route, "routes", None) or getattr(included, "routes", None)
        if isinstance(path, str) and not inner:
            yield prefix + path, getattr(route, "methods", None)
        elif inner:
            context = getattr(route, "include_context", None)
            yield from _declared(inner, prefix + (path or getattr(context, "prefix", "") or ""))
        else:
            raise AssertionError(f"a route the test cannot read: {route!r}")


def _markdown(table: tuple[RouteAccess, ...]) -> str:
    """The table as docs/SERVER.md and docs/ROUTER.md print it."""
    lines = ["| path | needs the key | why |", "| --- | --- | --- |"]
    for row in table:
        shown = f"`{row.path}*`" if row.path.endswith("/") else f"`{row.path}`"
        lines.append(f"| {shown} | {'yes' if row.needs_key else 'no'} | {row.why} |")
    return "\n".join(lines)


def _check_app(base: str, app: Starlette, table: tuple[RouteAccess, ...]) -> None:
    routes = _routes(app)
    assert len(routes) >= 6
    for row in table:  # and the table (so the docs) names no route the app lacks
        assert any(row.covers(path) for path, _ in routes), f"{row.path} is in the table but not served"
    for path, method in [*routes, ("/no-such-route", "GET")]:
        row = row_for(table, path)
        assert row is not None or path == "/no-such-route", (
            f"{method} {path} is not in the access table (tailserve/http/access.py): say whether it "
            "needs the key and why, and print the table in docs/SERVER.md and docs/ROUTER.md"
        )
        expected = needs_key(table, path)
        refused = httpx.request(method, f"{base}{path}", json={} if method == "POST" else None, timeout=30)
        assert (refused.status_code == 401) == expected, (
            method,
            path,
            refused.status_code,
            refused.text[:200],
        )
        allowed = httpx.request(
            method, f"{base}{path}", json={} if method == "POST" else None, headers=AUTH, timeout=30
        )
        assert allowed.status_code != 401, (method, path, allowed.text[:200])


def test_every_server_route_is_in_the_access_table_and_the_docs() -> None:
    app = create_server_app(FakeEngine(), ServerConfig(api_key=KEY))
    with threaded_server(FakeEngine(), ServerConfig(api_key=KEY)) as base:
        _check_app(base, app, SERVER_ACCESS)
    assert _markdown(SERVER_ACCESS) in (REPO / "docs/SERVER.md").read_text(), _markdown(SERVER_ACCESS)


def test_every_router_route_is_in_the_access_table_and_the_docs() -> None:
    config = RouterConfig(replicas=(f"http://127.0.0.1:{free_port()}",), api_key=KEY, health_interval_s=0.2)
    app = create_router_app(config)
    server = ThreadedServer(app).start()
    try:
        _check_app(server.url, app, ROUTER_ACCESS)
    finally:
        server.stop()
    assert _markdown(ROUTER_ACCESS) in (REPO / "docs/ROUTER.md").read_text(), _markdown(ROUTER_ACCESS)


def test_behind_a_path_prefixing_proxy_the_table_still_applies() -> None:
    """--root-path: the ASGI path starts with the prefix, the table's paths do not."""

    async def probe() -> dict[str, int]:
        app = create_server_app(FakeEngine(), ServerConfig(api_key=KEY))
        transport = httpx.ASGITransport(app=app, root_path="/llm")
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            return {
                "health": (await client.get("/llm/health")).status_code,
                "models": (await client.get("/llm/v1/models")).status_code,
                "models with key": (await client.get("/llm/v1/models", headers=AUTH)).status_code,
            }

    assert asyncio.run(probe()) == {"health": 200, "models": 401, "models with key": 200}
