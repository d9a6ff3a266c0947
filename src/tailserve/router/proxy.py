"""Forwarding one request: choose a replica, send, retry elsewhere on an early failure, relay.

A failure before any byte reached the client (refused connection, 5xx/429, garbage, a stream that
broke before its first event) is retried on another replica. Once the first event is relayed the
request is never replayed: a later failure, or the drain deadline, ends the stream with an SSE
error event and [DONE]. What a client sees never names a replica's URL (only its index).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass

import httpx
from starlette.responses import JSONResponse, Response

from tailserve.http.sse import SSEResponse
from tailserve.router.config import RouterConfig
from tailserve.router.metrics import RouterMetrics
from tailserve.router.policies import Policy, RouteRequest
from tailserve.router.pool import Replica, ReplicaPool
from tailserve.router.sse import (
    MalformedStream,
    check_event,
    error_events,
    error_payload,
    is_done,
    sse_events,
)

log = logging.getLogger("tailserve.router")

REPLICA_HEADER = "x-tailserve-replica"
CLIENT_CLOSED_STATUS = "499"  # an attempt abandoned because the client left (nginx's code)
# Hop-by-hop and framing headers are the router's own business on each side.
_DROP_HEADERS = {
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
    "proxy-authorization", "proxy-authenticate", "accept-encoding", "content-encoding", "date", "server",
}  # fmt: skip


@dataclass(frozen=True)
class Failure:
    """An attempt that failed before any byte reached the client, so another replica may serve it."""

    status: str  # label for tailserve_router_requests_total
    message: str
    response: Response | None = None  # the replica's own 429/5xx answer, passed on if nobody else can


def forwardable(headers: Mapping[str, str]) -> dict[str, str]:
    """Headers minus the hop-by-hop ones."""
    return {k: v for k, v in headers.items() if k.lower() not in _DROP_HEADERS}


def error_response(status: int, message: str, code: str, retry_after_s: int | None = None) -> JSONResponse:
    """An OpenAI-style error answered by the router itself."""
    err_type = "server_error" if status >= 500 else "invalid_request_error"
    headers = {"retry-after": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse(error_payload(message, err_type, code), status_code=status, headers=headers)


def _is_json(content: bytes) -> bool:
    try:
        json.loads(content)
    except ValueError:
        return False
    return True


class Forwarder:
    """Sends requests to replicas chosen by the policy, with bounded retries and passive health."""

    def __init__(
        self,
        config: RouterConfig,
        pool: ReplicaPool,
        policy: Policy,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        closing: asyncio.Event | None = None,
    ) -> None:
        self._closing = closing  # set at the drain deadline: relayed streams end with an error event
        self._config = config
        self._pool = pool
        self._policy = policy
        self._client = client
        self._metrics = metrics

    async def post(
        self, path: str, body: bytes, headers: Mapping[str, str], route: RouteRequest, stream: bool
    ) -> Response:
        """Place and forward a POST; the client gets a response, an error, or a relayed stream."""
        tried: set[str] = set()
        failure: Failure | None = None
        for attempt in range(self._config.max_attempts):
            if attempt and self._pool.candidates(exclude=tried):
                self._metrics.retries.inc()
                await asyncio.sleep(min(1.0, self._config.retry_backoff_s * 2 ** (attempt - 1)))
            candidates = self._pool.candidates(exclude=tried)
            if not candidates:
                break
            decision = self._policy.choose(route, candidates)
            self._metrics.decisions.labels(self._policy.name, decision.reason).inc()
            tried.add(decision.url)
            result = await self._attempt(self._pool.get(decision.url), "POST", path, body, headers, stream)
            if isinstance(result, Failure):
                failure = result
                continue
            self._policy.record(route, decision.url)
            return result
        return self._give_up(failure)

    async def to_any(self, method: str, path: str, body: bytes, headers: Mapping[str, str]) -> Response:
        """Forward a request every replica answers alike (/v1/models, /tokenize) to the healthy
        replica with the fewest requests in flight, the next on an early failure."""
        failure: Failure | None = None
        replicas = sorted(self._pool.healthy(), key=lambda r: r.in_flight)
        for replica in replicas[: self._config.max_attempts]:
            result = await self._attempt(replica, method, path, body, headers, stream=False)
            if not isinstance(result, Failure):
                return result
            failure = result
        return self._give_up(failure)

    def _give_up(self, failure: Failure | None) -> Response:
        if failure is not None and failure.response is not None:
            return failure.response
        if failure is None:
            message = "no healthy replica: every replica failed its /ready checks"
            return error_response(503, message, "no_healthy_replica", retry_after_s=1)
        log.warning("giving up on a request: %s", failure.message)  # the URLs stay in the log
        message = f"every replica tried failed (last failure: {failure.status})"
        return error_response(503, message, "all_replicas_failed", retry_after_s=1)

    def _finish(self, replica: Replica, started_s: float, status: str) -> None:
        """Account for one attempt (exactly once, whatever its outcome)."""
        self._pool.release(replica)
        self._metrics.requests.labels(replica.label, status).inc()
        self._metrics.duration_s.labels(replica.label).observe(time.perf_counter() - started_s)

    async def _attempt(
        self, replica: Replica, method: str, path: str, body: bytes, headers: Mapping[str, str], stream: bool
    ) -> Response | Failure:
        request = self._client.build_request(
            method, replica.url + path, content=body, headers=forwardable(headers)
        )
        self._pool.acquire(replica)
        started_s = time.perf_counter()
        # Cancelled anywhere before the hand-over (the client left: a non-streamed answer's headers
        # only come with its end), the attempt is still accounted once, as the client's 499.
        status = CLIENT_CLOSED_STATUS
        upstream: httpx.Response | None = None
        handed_over = False
        try:
            try:
                upstream = await self._client.send(request, stream=True)
            except httpx.TransportError as exc:
                # A refused connection means the replica is gone. Other early errors (a keep-alive
                # connection the replica closed as we sent, a slow answer) are retried but not held against it.
                if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
                    self._pool.take_out(replica, f"connection failed: {exc!r}")
                status = "connect_error"
                return Failure(status, f"{replica.url}: {exc!r}")
            result = await self._read_start(replica, upstream, stream, started_s)
            status = result.status if isinstance(result, Failure) else str(upstream.status_code)
            handed_over = isinstance(result, SSEResponse)
            return result
        except (httpx.TransportError, MalformedStream) as exc:
            if isinstance(exc, MalformedStream):
                self._pool.take_out(replica, f"broke before output: {exc!r}")
            status = "stream_error"
            return Failure(status, f"{replica.url}: response broke before any output ({exc!r})")
        finally:
            if not handed_over:
                try:
                    if upstream is not None:
                        await upstream.aclose()
                finally:
                    self._finish(replica, started_s, status)

    async def _read_start(
        self, replica: Replica, upstream: httpx.Response, stream: bool, started_s: float
    ) -> Response | Failure:
        """Read as much as must be checked before the client may see anything."""
        code = upstream.status_code
        headers = forwardable(upstream.headers) | {REPLICA_HEADER: str(replica.index)}
        if code == 429 or code >= 500:
            content = await upstream.aread()
            if code == 503:
                self._pool.take_out(replica, "answered 503")
            return Failure(str(code), f"{replica.url} answered {code}", Response(content, code, headers))
        if not stream or code != 200:
            content = await upstream.aread()
            if code == 200 and not _is_json(content):
                self._pool.take_out(replica, "sent a non-JSON body")
                return Failure("garbage", f"{replica.url} sent a non-JSON body")
            return Response(content, code, headers)
        events = sse_events(upstream.aiter_bytes())
        first = await anext(events, None)
        if first is None:
            self._pool.take_out(replica, "ended a stream before its first event")
            return Failure("stream_error", f"{replica.url} ended the stream before any event")
        if not check_event(first):
            self._pool.take_out(replica, "sent malformed SSE")
            return Failure("garbage", f"{replica.url} sent malformed SSE")
        headers.pop("content-type", None)
        relay = self._relay(replica, upstream, events, first, started_s)
        return SSEResponse(relay, closing=self._closing, headers=headers)

    async def _relay(
        self,
        replica: Replica,
        upstream: httpx.Response,
        events: AsyncIterator[bytes],
        first: bytes,
        started_s: float,
    ) -> AsyncGenerator[bytes, None]:
        """Pass events through as they arrive; end cleanly if the replica breaks mid-stream."""
        status = "200"
        try:
            yield first
            done = is_done(first)
            while not done:
                event = await anext(events, None)
                if event is None:
                    status = "stream_truncated"
                    self._pool.take_out(replica, "closed a stream before [DONE]")
                    yield error_events(
                        "the replica serving this request closed the stream before it finished"
                    )
                    return
                if not check_event(event):
                    status = "garbage"
                    self._pool.take_out(replica, "sent malformed SSE mid-stream")
                    yield error_events("the replica serving this request sent a malformed stream")
                    return
                yield event
                done = is_done(event)
        except (httpx.TransportError, MalformedStream) as exc:
            status = "stream_error"
            if isinstance(exc, MalformedStream):
                self._pool.take_out(replica, f"stream broke: {exc!r}")
            yield error_events("the replica serving this request failed mid-stream")
        finally:
            await upstream.aclose()
            self._finish(replica, started_s, status)
