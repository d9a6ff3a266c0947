"""tailserve on Ray Serve: `serve run tailserve.integrations.ray_serve:build_app model=default
num_replicas=2` runs N engine replicas (each the whole OpenAI server around its own engine) behind a
light ingress deployment that relays each HTTP request to one of them through a Ray handle.

The ingress exists because only a caller holding the request can fail it well: a request no replica
has started is retried elsewhere, a stream whose replica dies ends with an error event and [DONE],
and the Ray request router sees the prompt (placement reads `HttpCall.route`). Ray's app-builder
convention: `build_app(args)` takes `tailserve serve`'s flags as `key=value` plus DEPLOYMENT_KEYS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

from fastapi import FastAPI
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, RayError
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import Response

from tailserve.config import EngineConfig
from tailserve.engine import AsyncEngine
from tailserve.http.sse import SSEResponse
from tailserve.integrations.asgi_call import HttpCall, ResponseStart, call_app
from tailserve.integrations.ray_autoscaling import RUNNING, SLOTS, WAITING
from tailserve.integrations.ray_metrics import ReplicaMetrics
from tailserve.integrations.ray_router import PrefixCacheRouter, PrefixLoadRouter
from tailserve.router.proxy import REPLICA_HEADER, error_response, forwardable
from tailserve.router.request_info import route_request
from tailserve.router.sse import error_events
from tailserve.server import cli as server_cli
from tailserve.server.app import create_app
from tailserve.server.config import ServerConfig

log = logging.getLogger("tailserve.ray_serve")
# Ray's, not `tailserve serve` flags: engine replicas and their resources, the ingress replicas.
DEPLOYMENT_KEYS = (
    "num_replicas",
    "num_cpus",
    "num_gpus",
    "max_ongoing_requests",
    "ingress_replicas",
    "metrics_interval_s",
    "router",
    "autoscaling_config",
)
# tailserve's PrefixLoadRouter (default), Ray's power of two choices, Ray Serve LLM's prefix router.
ROUTERS = {"prefix": PrefixLoadRouter, "ray": None, "prefix_cache_affinity": PrefixCacheRouter}
ATTEMPTS = 3  # replicas tried for a request that none has started (one gone is the usual case)
REPLICA_GONE = (RayActorError, ActorUnavailableError)
Replies = DeploymentResponseGenerator[ResponseStart | bytes]  # what `EngineReplica.forward` yields


def serve_configs(args: Mapping[str, object]) -> tuple[EngineConfig, ServerConfig]:
    """Both configs from `tailserve serve` flags given as a mapping (`true` turns a switch on);
    ConfigError or argparse's exit names a bad one, as on the command line."""
    argv = ["serve"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        text = str(value)
        if text.lower() == "true":
            argv.append(flag)
        elif text.lower() != "false":
            argv += [flag, text]
    parser = argparse.ArgumentParser(prog="tailserve")
    server_cli.register(parser.add_subparsers(dest="command"))
    return server_cli.configs_from_args(parser.parse_args(argv))


@serve.ingress()
class EngineReplica:
    """One engine and its OpenAI server. Ray runs the app's lifespan (engine start, warm-up, drain
    when the replica stops); requests arrive as `forward` calls from the ingress. Every
    `metrics_interval_s` its /metrics page goes out through Ray's metrics (ReplicaMetrics)."""

    def __init__(
        self, engine_config: EngineConfig, server_config: ServerConfig, metrics_interval_s: float = 5.0
    ) -> None:
        self._engine = AsyncEngine(engine_config)
        self._slots = engine_config.scheduler.max_num_seqs
        self._app = create_app(self._engine, server_config)
        self._replica = serve.get_replica_context().replica_id.unique_id
        self._metrics = ReplicaMetrics()
        self._exporting = asyncio.get_running_loop().create_task(self._export_every(metrics_interval_s))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._app

    async def forward(self, call: HttpCall) -> AsyncIterator[ResponseStart | bytes]:
        """The app's response to `call`, streamed; its start names this replica (REPLICA_HEADER)."""
        async for item in call_app(self._app, call):
            if isinstance(item, ResponseStart):
                item = ResponseStart(item.status, item.headers + ((REPLICA_HEADER, self._replica),))
            yield item

    async def export_metrics(self) -> dict[str, object]:
        """Brings this replica's Ray metrics up to its /metrics page now; what they show, by name
        (a counter's `name{label}`, a histogram's observation count), and the replica's tag."""
        chunks = [c async for c in call_app(self._app, HttpCall("GET", "/metrics"))]
        page = self._metrics.export(b"".join(c for c in chunks if isinstance(c, bytes)).decode())
        shown: dict[str, object] = {"replica": self._replica, **page.gauges}
        shown.update({f"{name}{{{label}}}": total for (name, label), total in page.counters.items()})
        shown.update({f"{name}_count": rows[-1][1] for name, rows in page.buckets.items()})
        return shown

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray's custom autoscaling metrics hook: the engine's queue as of its last step, for
        ray_autoscaling.QueueDepthPolicy."""
        stats = self._engine.stats()
        return {
            WAITING: float(stats.num_waiting),
            RUNNING: float(stats.num_running),
            SLOTS: float(self._slots),
        }

    async def _export_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.export_metrics()
            except Exception:  # a page that failed to render: the next interval tries again
                log.exception("exporting the engine metrics to Ray failed")


async def http_call(request: Request) -> HttpCall:
    """The request as plain data, with what placement reads of an OpenAI JSON body."""
    body = await request.body()
    route = None
    if request.method == "POST" and body[:1] == b"{":
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None  # the replica answers the 400
        if isinstance(parsed, dict):
            route = route_request(parsed, request.headers)
    scope = request.scope
    client = scope.get("client")
    return HttpCall(
        method=request.method,
        path=scope["path"],
        query_string=scope.get("query_string", b""),
        headers=tuple((bytes(k), bytes(v)) for k, v in scope["headers"]),
        body=body,
        root_path=scope.get("root_path", ""),
        client=(str(client[0]), int(client[1])) if client else None,
        route=route,
    )


@dataclass(frozen=True)
class Head:
    """What a replica sent before the ingress answers the client: the start and either the whole
    body (`complete`) or, for a stream, its first chunk."""

    start: ResponseStart
    chunks: list[bytes]
    complete: bool

    @property
    def streaming(self) -> bool:
        return (self.start.header("content-type") or "").startswith("text/event-stream")


async def read_head(stream: Replies) -> Head:
    """Reads until the client can be answered without a retry ever being needed: a whole plain
    response, or a stream's first chunk (before it the replica has produced nothing)."""
    start = await stream.__anext__()
    assert isinstance(start, ResponseStart), start
    head = Head(start, [], False)
    async for chunk in stream:
        assert isinstance(chunk, bytes)
        head.chunks.append(chunk)
        if head.streaming:
            return head
    return Head(start, head.chunks, True)


class Ingress:
    """The HTTP entry: relays each request to an engine replica the Ray request router picks."""

    def __init__(self, engine: DeploymentHandle[Any]) -> None:
        self._engine = engine.options(stream=True, method_name="forward")

    async def __call__(self, request: Request) -> Response:
        call = await http_call(request)
        failure: RayError | None = None
        for _ in range(ATTEMPTS):
            stream = cast(Replies, self._engine.remote(call))
            try:
                head = await read_head(stream)
            except REPLICA_GONE as gone:  # nothing started there: another replica may take it
                failure = gone
                continue
            except RayError as error:
                return error_response(
                    500, f"the engine replica failed: {type(error).__name__}", "replica_error"
                )
            # Ray's proxy sets the request's X-Request-Id on the response itself (the replica echoed it).
            headers = {k: v for k, v in forwardable(dict(head.start.headers)).items() if k != "x-request-id"}
            if head.complete:
                return Response(b"".join(head.chunks), status_code=head.start.status, headers=headers)
            return SSEResponse(relay(stream, head), headers=headers)
        message = f"no engine replica could take the request: {type(failure).__name__}"
        return error_response(503, message, "no_replica", retry_after_s=1)


async def relay(stream: Replies, head: Head) -> AsyncGenerator[bytes, None]:
    """A stream's events; if its replica fails once output began, an error event and [DONE]."""
    finished = False
    try:
        for first in head.chunks:
            yield first
        async for chunk in stream:
            assert isinstance(chunk, bytes)
            yield chunk
        finished = True
    except RayError as error:
        finished = True
        yield error_events(f"the engine replica serving this stream failed: {type(error).__name__}")
    finally:
        if not finished:
            # The client left: the replica's app sees a disconnect and aborts the engine request.
            stream.cancel()  # type: ignore[no-untyped-call]


def deployment_options(args: Mapping[str, object], engine_config: EngineConfig) -> dict[str, Any]:
    """Ray options of the engine deployment. `max_ongoing_requests` defaults to twice what admission
    holds (running + waiting), so overload reaches admission and is refused there (429 with
    Retry-After) instead of queueing unseen in Ray's router. `router`: one of ROUTERS.
    `autoscaling_config` (a mapping or its JSON): Ray's AutoscalingConfig, in place of `num_replicas`;
    its `policy` may name ray_autoscaling.POLICY_PATH to scale on the engines' queues."""
    limits = engine_config.scheduler
    held = limits.max_num_seqs + limits.max_waiting
    router = str(args.get("router", "prefix"))
    if router not in ROUTERS:
        raise ValueError(f"router={router!r}: one of {', '.join(ROUTERS)}")
    router_class = ROUTERS[router]
    routing: dict[str, Any] = {"request_router_class": router_class} if router_class else {}
    autoscaling = args.get("autoscaling_config")
    scaling: dict[str, Any] = {"num_replicas": int(str(args.get("num_replicas", 1)))}
    if autoscaling is not None:
        scaling = {
            "autoscaling_config": json.loads(autoscaling) if isinstance(autoscaling, str) else autoscaling
        }
    return {
        "request_router_config": RequestRouterConfig(**routing),
        **scaling,
        "max_ongoing_requests": int(str(args.get("max_ongoing_requests", 2 * held))),
        "ray_actor_options": {
            "num_cpus": float(str(args.get("num_cpus", 1))),
            "num_gpus": float(str(args.get("num_gpus", 0))),
        },
    }


def build_app(args: Mapping[str, object]) -> Application:
    """The Ray Serve application: `ingress_replicas` (default 1, no CPU reserved) relaying to
    `num_replicas` engine replicas, each building its engine inside its own replica (the model
    loads there, not in the driver). Host and port are Ray's proxy's (`serve start --http-host
    /--http-port`); --host/--port here are ignored."""
    given = {k.replace("-", "_"): v for k, v in args.items()}
    flags = {k: v for k, v in given.items() if k not in DEPLOYMENT_KEYS}
    engine_config, server_config = serve_configs(flags)
    engine = serve.deployment(name="engine", **deployment_options(given, engine_config))(EngineReplica)
    ingress = serve.deployment(
        name="tailserve",
        num_replicas=int(str(given.get("ingress_replicas", 1))),
        max_ongoing_requests=10_000,  # it only relays; the engines' admission decides
        ray_actor_options={"num_cpus": 0},
    )(Ingress)
    interval_s = float(str(given.get("metrics_interval_s", 5.0)))
    return ingress.bind(engine.bind(engine_config, server_config, interval_s))  # type: ignore[no-any-return]
