"""The router's HTTP front: the server's OpenAI-compatible endpoints, forwarded to replicas.

`create_app(config)` builds everything (pool, policy, metrics, HTTP client, checks) per app;
nothing lives at module level, so tests run several routers in one process.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tailserve.router.config import RouterConfig
from tailserve.router.metrics import RouterMetrics
from tailserve.router.monitor import ReplicaMonitor
from tailserve.router.policies import Policy, make_policy
from tailserve.router.pool import ReplicaPool
from tailserve.router.proxy import Forwarder, error_response
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


def _state(request: Request) -> RouterState:
    state: RouterState = request.app.state.router
    return state


def _forwarder(request: Request) -> Forwarder:
    forwarder = _state(request).forwarder
    if forwarder is None:
        raise RuntimeError("the router app is not running (lifespan not started)")
    return forwarder


async def completions(request: Request) -> Response:
    """POST /v1/completions and /v1/chat/completions: place, forward, relay."""
    body = await request.body()
    try:
        parsed = json.loads(body)
    except ValueError:
        return error_response(400, "the request body is not valid JSON", "invalid_json")
    if not isinstance(parsed, dict):
        return error_response(400, "the request body must be a JSON object", "invalid_json")
    route = route_request(parsed, request.headers)
    stream = parsed.get("stream") is True
    return await _forwarder(request).post(request.url.path, body, request.headers, route, stream)


async def models(request: Request) -> Response:
    """GET /v1/models, answered by a healthy replica."""
    return await _forwarder(request).get("/v1/models", request.headers)


async def health(request: Request) -> Response:
    """GET /health: the router process is alive (replicas are /ready's business)."""
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """GET /ready: 200 while at least one replica is healthy, else 503."""
    state = _state(request)
    healthy = len(state.pool.healthy())
    body = {"status": "ready" if healthy else "no healthy replica", "healthy_replicas": healthy}
    return JSONResponse(body, status_code=200 if healthy else 503)


async def metrics(request: Request) -> Response:
    """GET /metrics: the router's own metrics (replicas expose theirs)."""
    return Response(_state(request).metrics.exposition(), media_type=PROMETHEUS_CONTENT_TYPE)


async def replicas(request: Request) -> Response:
    """GET /router/replicas: each replica's health, in-flight count and last load read."""
    state = _state(request)
    loads = {c.url: c.load for c in state.pool.candidates(exclude=set())}
    rows = [
        {
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
            state.forwarder = Forwarder(config, state.pool, state.policy, client, metrics_)
            await monitor.start()
            try:
                yield
            finally:
                await monitor.stop()
                state.forwarder = None

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/router/replicas", replicas, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.router = state
    return app
