"""Pure ASGI middleware: body size limit, content type, API key, the catch-all 500, error counting.

Pure ASGI (not BaseHTTPMiddleware) so client disconnects still reach the endpoints; none of them
reads or buffers a body, and every error they send is built by http/errors.py. The router runs
the same gate in front of its own forwarding.
"""

from __future__ import annotations

import hmac
import json
import logging

from prometheus_client import Counter
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tailserve.http.access import SERVER_ACCESS, RouteAccess, needs_key
from tailserve.http.errors import (
    AuthenticationError,
    BodyTooLargeError,
    HTTPError,
    UnsupportedMediaTypeError,
    to_http,
)

API_PREFIX = "/v1/"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"; never reaches a client

log = logging.getLogger("tailserve.http")


async def send_error(send: Send, error: HTTPError) -> None:
    """A complete JSON error response."""
    body = json.dumps(error.body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def route_path(scope: Scope) -> str:
    """The path the app routes on: behind a path-prefixing proxy (--root-path) the ASGI `path`
    starts with `root_path`, which the routes do not include."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value)
    return None


def bearer_token(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header (scheme in any case), else None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class ApiKeyMiddleware:
    """401 on every path the access table does not open (http/access.py) unless `Authorization:
    Bearer <key>` matches one of the keys (scheme in any case, as RFC 7235 says; constant-time
    compare of each key). `extra_keys` are the API keys that --slo-classes names; with no key at
    all every path is open."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        access: tuple[RouteAccess, ...] = SERVER_ACCESS,
        extra_keys: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self._expected = [key.encode() for key in (api_key, *extra_keys) if key]
        self._access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._expected and scope["type"] == "http" and needs_key(self._access, route_path(scope)):
            scheme, _, token = (_header(scope, b"authorization") or b"").strip().partition(b" ")
            # Every key is compared, so the time taken does not tell which one came close.
            matches = [hmac.compare_digest(token.strip(), key) for key in self._expected]
            if scheme.lower() != b"bearer" or not any(matches):
                await send_error(send, to_http(AuthenticationError()))
                return
        await self.app(scope, receive, send)


class JsonContentTypeMiddleware:
    """415 for a POST whose Content-Type is not application/json (no header at all still reads as JSON).

    Also keeps a web page from posting a `text/plain` "simple request" to a loopback server."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and route_path(scope).startswith(API_PREFIX):
            declared = _header(scope, b"content-type")
            if declared is not None and declared.split(b";")[0].strip().lower() != b"application/json":
                shown = declared.decode("latin-1")[:100]
                await send_error(send, to_http(UnsupportedMediaTypeError(shown)))
                return
        await self.app(scope, receive, send)


class CatchAllMiddleware:
    """An unexpected exception becomes a 500 in OpenAI JSON (logged once by to_http), and is not
    re-raised: the connection stays usable. After the response started, nothing more can be sent.

    A client that hangs up before its body has arrived is the client's event, not the server's
    error: one log line, and a 499 that no one receives but the error counter counts."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:
            log.info(
                "%s %s: the client closed the connection before its request body arrived",
                scope["method"],
                scope["path"],
            )
            if not started:
                await send({"type": "http.response.start", "status": CLIENT_CLOSED_REQUEST, "headers": []})
                await send({"type": "http.response.body", "body": b""})
        except Exception as exc:
            error = to_http(exc)
            if not started:
                await send_error(send, error)


class BodyLimitMiddleware:
    """413 when Content-Length or the bytes actually received exceed the limit."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self._limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._limit:
            await send_error(send, to_http(BodyTooLargeError(self._limit)))
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self._limit:
                    raise BodyTooLargeError(self._limit)  # mapped to 413 by the app's error handler
            return message

        await self.app(scope, limited_receive, send)


class ErrorCountMiddleware:
    """Counts every /v1/ response with status >= 400 in tailserve_request_errors_total{status}."""

    def __init__(self, app: ASGIApp, errors: Counter) -> None:
        self.app = app
        self._errors = errors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not route_path(scope).startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self._errors.labels(status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
