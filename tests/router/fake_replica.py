"""A fake OpenAI-compatible replica for router tests: real HTTP on 127.0.0.1, behaviour set per test.

It answers like `tailserve serve` (completions, chat SSE, /ready, /metrics with the load gauges) and
can be told to be slow, fail, send garbage or die mid-stream. Run in a thread, or as a process
(`python -m tests.router.fake_replica --port P`) so a test can SIGKILL it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

MODES = ("ok", "error_500", "error_503", "error_429", "garbage", "garbage_mid_stream", "die_mid_stream")


@dataclass
class FakeBehavior:
    """What the fake does; tests change it while it runs."""

    mode: str = "ok"
    ready: bool = True
    delay_s: float = 0.0  # before the first byte
    token_delay_s: float = 0.0  # between streamed tokens
    num_tokens: int = 4
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    hold_after_first: threading.Event | None = None  # the stream stops after one token until set
    requests: list[dict[str, object]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        """Back to a healthy, instant replica with no history (fixtures reuse one fake per module)."""
        fresh = FakeBehavior()
        with self.lock:
            for name in ("mode", "ready", "delay_s", "token_delay_s", "num_tokens", "waiting", "running"):
                setattr(self, name, getattr(fresh, name))
            self.kv_usage = fresh.kv_usage
            self.hold_after_first = None
            self.requests.clear()

    def served(self) -> int:
        """How many generation requests reached this fake."""
        with self.lock:
            return len(self.requests)


def _chunk(request_id: str, text: str, chat: bool, finish: str | None = None) -> bytes:
    if chat:
        choice: dict[str, object] = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    payload = {"id": request_id, "object": obj, "created": 0, "model": "fake", "choices": [choice]}
    return f"data: {json.dumps(payload)}\n\n".encode()


def _full(request_id: str, text: str, chat: bool, n: int) -> dict[str, object]:
    if chat:
        choice: dict[str, object] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "length",
        }
    else:
        choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
    usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
    kind = "chat.completion" if chat else "text_completion"
    return {
        "id": request_id,
        "object": kind,
        "created": 0,
        "model": "fake",
        "choices": [choice],
        "usage": usage,
    }


def create_fake_app(behavior: FakeBehavior, name: str) -> Starlette:
    """The fake replica app; `name` appears in every generated text so tests see who served."""

    async def generate(request: Request) -> Response:
        body = await request.json()
        chat = request.url.path.endswith("/chat/completions")
        with behavior.lock:
            behavior.requests.append(body)
            request_id = f"{name}-{len(behavior.requests)}"
        await asyncio.sleep(behavior.delay_s)
        mode = behavior.mode
        if mode.startswith("error_"):
            code = int(mode.removeprefix("error_"))
            headers = {"retry-after": "1"} if code == 429 else None
            err = {"error": {"message": f"{name} fails", "type": "server_error", "param": None, "code": mode}}
            return JSONResponse(err, status_code=code, headers=headers)
        n = int(body.get("max_tokens") or behavior.num_tokens)
        if not body.get("stream"):
            if mode == "garbage":
                return PlainTextResponse("<html>not json</html>")
            return JSONResponse(_full(request_id, f"[{name}]" + "x" * n, chat, n))
        return StreamingResponse(_stream(request_id, chat, n, mode), media_type="text/event-stream")

    async def _stream(request_id: str, chat: bool, n: int, mode: str) -> AsyncIterator[bytes]:
        if mode == "garbage":
            yield b"this is not server-sent events\n\n"
            return
        yield _chunk(request_id, f"[{name}]", chat)
        if behavior.hold_after_first is not None:
            while not behavior.hold_after_first.is_set():
                await asyncio.sleep(0.01)
        for i in range(n):
            await asyncio.sleep(behavior.token_delay_s)
            if i == 1 and mode == "garbage_mid_stream":
                yield b"data: {not json\n\n"
            if i == 1 and mode == "die_mid_stream":
                raise RuntimeError("replica died mid-stream")
            yield _chunk(request_id, "x", chat, "length" if i == n - 1 else None)
        yield b"data: [DONE]\n\n"

    async def responses(request: Request) -> Response:
        """/v1/responses as OpenAI streams it: named events, the last `response.completed`, no [DONE]."""
        body = await request.json()
        with behavior.lock:
            behavior.requests.append(body)
            request_id = f"resp_{name}_{len(behavior.requests)}"
        text = f"[{name}]" + "x" * int(body.get("max_output_tokens") or behavior.num_tokens)
        done = {"id": request_id, "object": "response", "status": "completed", "output_text": text}
        if not body.get("stream"):
            return JSONResponse(done)

        async def events() -> AsyncIterator[bytes]:
            for seq, (kind, data) in enumerate(
                [("response.created", {"response": {**done, "status": "in_progress"}})]
                + [("response.output_text.delta", {"delta": ch}) for ch in text]
                + [("response.completed", {"response": done})]
            ):
                await asyncio.sleep(behavior.token_delay_s)
                payload = json.dumps({"type": kind, "sequence_number": seq, **data})
                yield f"event: {kind}\ndata: {payload}\n\n".encode()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def ready(request: Request) -> Response:
        return JSONResponse({"ready": behavior.ready}, status_code=200 if behavior.ready else 503)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": name}]})

    async def metrics(request: Request) -> Response:
        lines = [
            "# TYPE tailserve_requests_waiting gauge",
            f"tailserve_requests_waiting {behavior.waiting}",
            "# TYPE tailserve_requests_running gauge",
            f"tailserve_requests_running {behavior.running}",
            "# TYPE tailserve_kv_cache_usage_ratio gauge",
            f"tailserve_kv_cache_usage_ratio {behavior.kv_usage}",
            "tailserve_prefix_cache_hit_rate 0.0",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def set_behavior(request: Request) -> Response:
        for key, value in (await request.json()).items():
            setattr(behavior, key, value)
        return JSONResponse({"ok": True})

    return Starlette(
        routes=[
            Route("/v1/completions", generate, methods=["POST"]),
            Route("/v1/chat/completions", generate, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/models", models),
            Route("/ready", ready),
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/_fake/behavior", set_behavior, methods=["POST"]),
        ]
    )


def free_port() -> int:
    """A port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ThreadedServer:
    """Any ASGI app served by uvicorn on 127.0.0.1 in a daemon thread; stop() and start() again."""

    def __init__(self, app: Starlette, port: int | None = None) -> None:
        self.app = app
        self.port = port or free_port()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ThreadedServer:
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._server.force_exit = True
            self._thread.join(timeout=10)
        self._server = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--token-delay", type=float, default=0.0)
    args = parser.parse_args()
    behavior = FakeBehavior(token_delay_s=args.token_delay)
    uvicorn.run(create_fake_app(behavior, args.name), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
