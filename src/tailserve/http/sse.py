"""Server-sent events as OpenAI clients expect them: `data: {json}\\n\\n` events ending in `data: [DONE]`.

SSEResponse watches for the client going away and then closes the event iterator at once (which
aborts the engine request), even while no token is flowing; at the drain deadline it ends the
stream itself with an error event and [DONE]. It never buffers events.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tailserve.http.errors import ServiceUnavailableError

T = TypeVar("T")
SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# Characters JSON may carry raw that Python's str.splitlines (httpx's `iter_lines`, and the clients
# built on it) takes for line ends: escaped, so such a client never splits an event inside its JSON.
_LINE_ENDS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(payload: dict[str, Any]) -> str:
    """Compact JSON on one line for an SSE `data:` field, whatever line splitting the client uses
    (NEL, U+2028 and U+2029 escaped: the same JSON value)."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).translate(_LINE_ENDS_JSON_KEEPS)


def sse_event(payload: dict[str, Any]) -> bytes:
    """One `data:` event; compact JSON on a single line."""
    return b"data: " + sse_json(payload).encode() + b"\n\n"


async def wait_for_disconnect(receive: Callable[[], Awaitable[MutableMapping[str, Any]]]) -> None:
    """Returns once the client has closed the connection (the request body must already be read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(
    work: Awaitable[T], receive: Callable[[], Awaitable[MutableMapping[str, Any]]], closing: asyncio.Event
) -> T | None:
    """The result of `work`, or None (work cancelled) if the client disconnects first; a 503 if the
    drain deadline comes first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(wait_for_disconnect(receive))
    deadline = asyncio.create_task(closing.wait())
    cut = False
    try:
        await asyncio.wait({task, watch, deadline}, return_when=asyncio.FIRST_COMPLETED)
        cut = deadline.done() and not watch.done() and not task.done()
    finally:
        watch.cancel()
        deadline.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, deadline, return_exceptions=True)
    if cut:
        raise ServiceUnavailableError("draining")
    return None if task.cancelled() else task.result()


def shutdown_error_event() -> bytes:
    """The event that ends a stream cut at the drain deadline (the client may retry elsewhere)."""
    message = "The server is shutting down; this response was cut at the drain deadline"
    body = {"message": message, "type": "service_unavailable_error", "param": None, "code": "draining"}
    return sse_event({"error": body})


class SSEResponse(StreamingResponse):
    """text/event-stream over an async generator of encoded events, closed as soon as the client
    leaves, or ended with an error event and [DONE] once `closing` is set (the drain deadline)."""

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        on_close: Callable[[], Awaitable[None]] | None = None,
        closing: asyncio.Event | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        merged = {k.lower(): v for k, v in (SSE_HEADERS | (headers or {})).items()}
        super().__init__(events, media_type="text/event-stream", headers=merged)
        self._events = events
        self._on_close = on_close
        self._closing = closing
        self._started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.create_task(self._stream(send))
        watch = asyncio.create_task(wait_for_disconnect(receive))
        waiters: set[asyncio.Task[object]] = {stream, watch}
        deadline = None
        if self._closing is not None:
            deadline = asyncio.create_task(self._closing.wait())
            waiters.add(deadline)
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            cut = deadline is not None and deadline.done() and not stream.done() and not watch.done()
            for task in waiters:
                task.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
            if cut:
                await self._end_at_deadline(send)
        finally:
            for task in waiters:
                task.cancel()
            await self._events.aclose()  # runs the generator's cleanup: abort + release admission
            if self._on_close is not None:  # for a generator closed before it ever started
                await self._on_close()
        error = None if stream.cancelled() else stream.exception()
        if error is not None and not isinstance(error, OSError):  # OSError: the client went away
            raise error

    async def _stream(self, send: Send) -> None:
        await self._start(send)
        async for chunk in self._events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _start(self, send: Send) -> None:
        if not self._started:
            self._started = True
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )

    async def _end_at_deadline(self, send: Send) -> None:
        try:
            await self._start(send)
            await send(
                {"type": "http.response.body", "body": shutdown_error_event() + SSE_DONE, "more_body": True}
            )
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away meanwhile
