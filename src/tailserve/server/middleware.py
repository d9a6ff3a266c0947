"""Pure ASGI middleware: API-key check, request-body size limit, error-status counting.

Pure ASGI (not BaseHTTPMiddleware) so client disconnects still reach the endpoints; none of them
reads or buffers a body, and every error they send is built by server/errors.py.
"""

from __future__ import annotations

import hmac
import json

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tailserve.server.errors import AuthenticationError, BodyTooLargeError, HTTPError, to_http

API_PREFIX = "/v1/"


async def send_error(send: Send, error: HTTPError) -> None:
    """A complete JSON error response."""
    body = json.dumps(error.body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value)
    return None


class ApiKeyMiddleware:
    """401 on /v1/ paths unless `Authorization: Bearer <key>` matches (constant-time compare)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._expected is not None and scope["type"] == "http" and scope["path"].startswith(API_PREFIX):
            given = _header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, self._expected):
                await send_error(send, to_http(AuthenticationError()))
                return
        await self.app(scope, receive, send)


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
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self._errors.labels(status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
