"""Server-sent events as OpenAI clients expect them: `data: {json}\\n\\n` events ending in `data: [DONE]`.

SSEResponse watches for the client going away and then closes the event iterator at once (which
aborts the engine request), even while no token is flowing; it never buffers events.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: dict[str, Any]) -> bytes:
    """One `data:` event; compact JSON on a single line."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def wait_for_disconnect(receive: Callable[[], Awaitable[MutableMapping[str, Any]]]) -> None:
    """Returns once the client has closed the connection (the request body must already be read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """text/event-stream over an async generator of encoded events, closed as soon as the client leaves."""

    def __init__(
        self, events: AsyncGenerator[bytes, None], on_close: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.create_task(self._stream(send))
        watch = asyncio.create_task(wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watch):
                task.cancel()
            await asyncio.gather(stream, watch, return_exceptions=True)
            await self._events.aclose()  # runs the generator's cleanup: abort + release admission
            if self._on_close is not None:  # for a generator closed before it ever started
                await self._on_close()
        error = None if stream.cancelled() else stream.exception()
        if error is not None and not isinstance(error, OSError):  # OSError: the client went away
            raise error

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self._events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
