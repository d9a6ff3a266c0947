"""The router's HTTP front: the server's OpenAI-compatible endpoints, forwarded to replicas.

`create_app(config)` builds everything (pool, policy, metrics, HTTP client, checks) per app;
nothing lives at module level, so tests run several routers in one process. Clients meet the
server's own gate (body limit, content type, API key, OpenAI JSON errors) before any body is read,
and never see a replica's internal URL; /router/replicas is the operator's view.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from tailserve.http.access import ROUTER_ACCESS
from tailserve.http.drain import Drain
from tailserve.http.errors import HTTPError, ServiceUnavailableError, route_error, to_http
from tailserve.http.json_body import parse_json
from tailserve.http.middleware import (
    API_PREFIX,
    CLIENT_CLOSED_REQUEST,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    CatchAllMiddleware,
    JsonContentTypeMiddleware,
    route_path,
    send_error,
)
from tailserve.http.sse import until_disconnect
from tailserve.router.config import RouterConfig
from tailserve.router.metrics import RouterMetrics
from tailserve.router.monitor import ReplicaMonitor
from tailserve.router.policies import Policy, make_policy
from tailserve.router.pool import ReplicaPool
from tailserve.router.proxy import Forwarder
from tailserve.router.request_info import route_request

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class RouterState:
    """Everything one router app owns."""

    config: RouterConfig
    metrics: RouterMetrics
    pool: ReplicaPool
    policy: Policy
    forwarder: Forwarder | None = None  # set while the app runs (it needs the HTTP client)
    drain: Drain = field(default_factory=Drain)


def _state(request: Request) -> RouterState:
    state: RouterState = request.app.state.router
    return state


def _forwarder(request: Request) -> Forwarder:
    forwarder = _state(request).forwarder
    if forwarder is None:
        raise RuntimeError("the router app is not running (lifespan not started)")
    return forwarder


async def completions(request: Request) -> Response:
    """POST /v1/completions, /v1/chat/completions and /v1/responses: place, forward, relay.

    A client that leaves before the answer starts cancels the forward, which closes the replica
    connection, and the replica aborts the generation (streamed or not)."""
    body = await request.body()
    parsed = parse_json(body)  # InvalidJSONError -> 400, as the server would answer
    route = route_request(parsed, request.headers)
    stream = parsed.get("stream") is True
    forward = _forwarder(request).post(request.url.path, body, request.headers, route, stream)
    response = await until_disconnect(forward, request.receive, _state(request).drain.closing)
    return Response(status_code=CLIENT_CLOSED_REQUEST) if response is None else response


async def any_replica_get(request: Request) -> Response:
    """GET /v1/models, /v1/models/{id}, /version and /openapi.json, answered by a healthy replica
    (the schema is the server's: it also lists the routes only a server has)."""
    return await _forwarder(request).to_any("GET", request.url.path, b"", request.headers)


async def tokenizer(request: Request) -> Response:
    """POST /tokenize and /detokenize (vLLM's), answered by a healthy replica: every replica serves
    the same model, so placement does not matter."""
    body = await request.body()
    return await _forwarder(request).to_any("POST", request.url.path, body, request.headers)


async def health(request: Request) -> Response:
    """GET /health: the router process is alive (replicas are /ready's business)."""
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """GET /ready: 200 while at least one replica is healthy and the router is not draining, else 503
    (a load balancer must stop sending what the drain would refuse)."""
    state = _state(request)
    healthy = len(state.pool.healthy())
    status = "draining" if state.drain.draining else "ready" if healthy else "no healthy replica"
    body = {"status": status, "healthy_replicas": healthy}
    return JSONResponse(body, status_code=200 if status == "ready" else 503)


async def metrics(request: Request) -> Response:
    """GET /metrics: the router's own metrics (replicas expose theirs)."""
    return Response(_state(request).metrics.exposition(), media_type=PROMETHEUS_CONTENT_TYPE)


async def replicas(request: Request) -> Response:
    """GET /router/replicas: each replica's health, in-flight count and last load read."""
    state = _state(request)
    loads = {c.url: c.load for c in state.pool.candidates(exclude=set())}
    rows = [
        {
            "index": r.index,
            "url": r.url,
            "healthy": r.healthy,
            "in_flight": r.in_flight,
            "load": loads.get(r.url),
            "last_change_reason": r.last_change_reason,
        }
        for r in state.pool.replicas
    ]
    return JSONResponse({"policy": state.policy.name, "replicas": rows})


def _http_client(config: RouterConfig) -> httpx.AsyncClient:
    timeout = httpx.Timeout(config.upstream_timeout_s, connect=config.connect_timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


class DrainMiddleware:
    """Counts /v1/ requests in flight for the drain, and answers 503 once draining has begun."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self._drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not route_path(scope).startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return
        if self._drain.draining:
            await send_error(send, to_http(ServiceUnavailableError("draining")))
            return
        self._drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self._drain.leave()


def _json_error(error: HTTPError) -> Response:
    return JSONResponse(error.body, status_code=error.status, headers=error.headers)


async def _on_http_exception(_: Request, exc: Exception) -> Response:
    """The router's own 404 and 405 (with Allow), as OpenAI JSON."""
    assert isinstance(exc, HTTPException)
    return _json_error(route_error(exc.status_code, str(exc.detail), exc.headers))


def create_app(config: RouterConfig) -> Starlette:
    """A router app for `config`; replica checks start and stop with the app's lifespan."""
    metrics_ = RouterMetrics.create()
    state = RouterState(
        config=config,
        metrics=metrics_,
        pool=ReplicaPool(config, metrics_),
        policy=make_policy(
            config.policy, config.prefix_block_chars, config.prefix_load_bound, config.prefix_map_blocks
        ),
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with _http_client(config) as client:
            monitor = ReplicaMonitor(config, state.pool, client)
            state.forwarder = Forwarder(
                config, state.pool, state.policy, client, metrics_, state.drain.closing
            )
            await monitor.start()
            try:
                yield
            finally:
                await monitor.stop()
                state.forwarder = None

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/responses", completions, methods=["POST"]),
        Route("/v1/models", any_replica_get, methods=["GET"]),
        Route("/v1/models/{model_id:path}", any_replica_get, methods=["GET"]),
        Route("/version", any_replica_get, methods=["GET"]),
        Route("/openapi.json", any_replica_get, methods=["GET"]),
        Route("/tokenize", tokenizer, methods=["POST"]),
        Route("/detokenize", tokenizer, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/router/replicas", replicas, methods=["GET"]),
    ]
    # Outermost first: size, content type and key are checked before any body byte is read.
    middleware = [
        Middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes),
        Middleware(JsonContentTypeMiddleware),
        Middleware(ApiKeyMiddleware, api_key=config.api_key, access=ROUTER_ACCESS),
        Middleware(DrainMiddleware, drain=state.drain),
        Middleware(CatchAllMiddleware),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=middleware,
        exception_handlers={HTTPException: _on_http_exception},
    )
    app.state.router = state
    return app
