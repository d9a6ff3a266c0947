"""One HTTP request run through an ASGI app in-process, its response yielded as it is sent.

What crosses a process boundary (a Ray handle call) is plain data: `HttpCall` in, `ResponseStart`
then body chunks out. Closing the generator early is the client leaving: the app sees
`http.disconnect` and its task is cancelled, so an engine request is aborted, never left running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from tailserve.router.policies import RouteRequest

Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Coroutine[Any, Any, None],
]


@dataclass(frozen=True)
class HttpCall:
    """An HTTP request as the ingress received it (headers lower-cased bytes, body whole), and what
    a placement policy may read of it (None when the body is not an OpenAI request)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    root_path: str = ""
    client: tuple[str, int] | None = None
    route: RouteRequest | None = field(default=None, compare=False)

    @property
    def prompt(self) -> str:
        """The prompt text placement reads ("" without one): the attribute Ray Serve LLM's routers
        look for on a call's arguments."""
        return self.route.prompt_text if self.route is not None else ""


@dataclass(frozen=True)
class ResponseStart:
    """The status line and headers, the first thing a call yields."""

    status: int
    headers: tuple[tuple[str, str], ...]

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name.lower()), None)


def _scope(call: HttpCall) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "root_path": call.root_path,
        "query_string": call.query_string,
        "headers": [list(h) for h in call.headers],
        "client": call.client,
        "server": None,
    }


async def call_app(app: ASGIApp, call: HttpCall) -> AsyncIterator[ResponseStart | bytes]:
    """Runs `call` through `app`: yields its ResponseStart, then each non-empty body chunk as sent;
    an exception in the app before its response ended is raised here."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    left = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    task = asyncio.create_task(app(_scope(call), receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    finished = False
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"])
                yield ResponseStart(int(message["status"]), headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    finished = True
                    break
        if not finished:
            task.result()  # the app raised before its response ended (or never sent one)
            raise RuntimeError("the app returned without finishing its response")
    finally:
        left.set()
        if not finished:
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
