"""X-Request-Id, as vLLM: a client's id names its request (the body's `id` is `chatcmpl-<id>`) and
comes back as the response's X-Request-Id header; without one (or with one that is not a short
visible token) a fresh id is used and sent back the same way. Unlike vLLM the engine's own request
ids stay unique, so a reused id (a retry) is never refused. Never logs or stores the header."""

from __future__ import annotations

import re
import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
_TOKEN = re.compile(r"[\x21-\x7e]{1,128}")  # visible ASCII, no spaces: safe in ids, logs and headers


class RequestIdMiddleware:
    """Puts the request's id in `scope["state"]["request_id"]` and on every response's headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", [])).get(HEADER, b"").decode("latin-1")
        request_id = given if _TOKEN.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id_of(request: Request) -> str | None:
    """The id RequestIdMiddleware gave this request (None in an app without it)."""
    return getattr(request.state, "request_id", None)
