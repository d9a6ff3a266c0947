"""A scripted OpenAI-compatible SSE server for bench tests: real HTTP on 127.0.0.1, exact token delays.

Runs as its own process (`python fake_server.py --model NAME [--api-key KEY]`, prints `PORT n`), so
its timers do not share a GIL with the client under test. POST /_script sets the behaviour of the
next requests (the i-th completion request gets script[i % len]); GET /_log returns what it received.
Chunks are emitted on an absolute schedule from the request's arrival: arrival + ttft + sum(gaps).
A behaviour with `ttft_per_prompt_byte_s` adds that much TTFT per byte of prompt and reports the
prompt's bytes as usage.prompt_tokens (a server whose prefill is a known line). POST /_metrics sets
the Prometheus gauges GET /metrics serves: name -> list of values, one per scrape, the last repeated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

DEFAULT_BEHAVIOUR: dict[str, Any] = {"ttft_s": 0.01, "itl_s": 0.005, "tokens": 4}
_OBJECT = {True: "chat.completion.chunk", False: "text_completion"}


class FakeServer:
    """State of the scripted server (one instance per process)."""

    def __init__(self, model: str, api_key: str | None) -> None:
        self.model = model
        self.api_key = api_key
        self.script: list[dict[str, Any]] = [DEFAULT_BEHAVIOUR]
        self.count = 0
        self.log: list[dict[str, Any]] = []
        self.metrics: dict[str, list[float]] | None = None
        self.scrapes = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    break
                method, path, headers, body = request
                arrival = time.perf_counter()
                await self.route(method, path, headers, body, arrival, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def route(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
        arrival: float,
        writer: asyncio.StreamWriter,
    ) -> None:
        if path == "/_script" and method == "POST":
            self.script = json.loads(body)
            self.count = 0
            self.log = []
            return await _send_json(writer, 200, {"ok": True})
        if path == "/_log":
            return await _send_json(writer, 200, self.log)
        if path == "/_metrics" and method == "POST":
            self.metrics, self.scrapes = json.loads(body), 0
            return await _send_json(writer, 200, {"ok": True})
        if path == "/metrics":
            return await self.send_metrics(writer)
        if path in ("/ready", "/health"):  # /health: guidellm checks it before a run
            return await _send_json(writer, 200, {"ready": True})
        if self.api_key and headers.get("authorization") != f"Bearer {self.api_key}":
            return await _send_json(writer, 401, {"error": {"message": "invalid api key"}})
        if path == "/v1/models":
            return await _send_json(writer, 200, {"object": "list", "data": [{"id": self.model}]})
        if path not in ("/v1/completions", "/v1/chat/completions") or method != "POST":
            return await _send_json(writer, 404, {"error": {"message": f"no route {path}"}})
        request = json.loads(body)
        if request.get("model") != self.model:
            return await _send_json(
                writer, 404, {"error": {"message": f"model {request.get('model')} not found"}}
            )
        behaviour = self.script[self.count % len(self.script)]
        self.count += 1
        entry: dict[str, Any] = {"arrival": arrival, "body": request, "behaviour": behaviour, "emits": []}
        self.log.append(entry)
        await self.stream(
            writer, path.endswith("chat/completions"), behaviour, arrival, entry["emits"], request
        )

    async def send_metrics(self, writer: asyncio.StreamWriter) -> None:
        if self.metrics is None:
            return await _send_json(writer, 404, {"error": {"message": "no metrics"}})
        lines = []
        for name, values in self.metrics.items():
            lines += [f"# TYPE {name} gauge", f"{name} {values[min(self.scrapes, len(values) - 1)]}"]
        self.scrapes += 1
        payload = ("\n".join(lines) + "\n").encode()
        writer.write(
            f"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        await writer.drain()

    async def stream(
        self,
        writer: asyncio.StreamWriter,
        chat: bool,
        b: dict[str, Any],
        arrival: float,
        emits: list[float],
        request: dict[str, Any],
    ) -> None:
        status = int(b.get("status", 200))
        if status != 200:
            extra = {"retry-after": str(b["retry_after"])} if "retry_after" in b else {}
            message = b.get("message", f"scripted HTTP {status}")
            return await _send_json(writer, status, {"error": {"message": message}}, extra)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
            b"cache-control: no-cache\r\n\r\n"
        )
        tokens, per_chunk = int(b.get("tokens", 4)), int(b.get("chunk_tokens", 1))
        n_chunks = -(-tokens // per_chunk)
        gaps = b.get("itl_s", 0.005)
        gaps = list(gaps) if isinstance(gaps, list) else [float(gaps)] * max(0, n_chunks - 1)
        if chat and b.get("role_chunk", True):
            await _send_chunk(
                writer, _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            )
        prompt_tokens = 7
        if "ttft_per_prompt_byte_s" in b:
            prompt_tokens = _prompt_bytes(request)
        due = (
            arrival
            + float(b.get("ttft_s", 0.01))
            + float(b.get("ttft_per_prompt_byte_s", 0.0)) * prompt_tokens
        )
        sent = 0
        for i in range(n_chunks):
            if i > 0:
                due += gaps[i - 1]
            await _sleep_until(due)
            k = min(per_chunk, tokens - sent)
            sent += k
            text = "tok " * k
            if b.get("empty_final") and sent == tokens:
                text = ""  # like tailserve serve: the finish reason alone, the last text held back
            if b.get("malformed") and i == int(b.get("malformed_at", 0)):
                await _send_chunk(
                    writer,
                    b"data: {this is not json\n\n" if b["malformed"] == "not_json" else b"garbage line\n\n",
                )
                emits.append(time.perf_counter())
                return await _send_chunk(writer, b"")
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if sent == tokens else None}
            if chat:
                choice["delta"] = {"content": text}
            else:
                choice["text"] = text
            # `object` as OpenAI sends it: aiperf ignores a chunk without it
            await _send_chunk(writer, _sse({"object": _OBJECT[chat], "choices": [choice]}))
            emits.append(time.perf_counter())
        if b.get("usage", True):
            final: dict[str, Any] = {
                "object": _OBJECT[chat],
                "choices": [],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens},
            }
            if b.get("timings"):
                final["tailserve_timings"] = b["timings"]
            await _send_chunk(writer, _sse(final))
        if b.get("done", True):
            await _send_chunk(writer, b"data: [DONE]\n\n")
        await _send_chunk(writer, b"")


def _prompt_bytes(request: dict[str, Any]) -> int:
    if "messages" in request:
        return sum(len(str(m.get("content", "")).encode()) for m in request["messages"])
    return len(str(request.get("prompt", "")).encode())


async def _sleep_until(due: float) -> None:
    delay = due - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _send_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    await writer.drain()


async def _send_json(
    writer: asyncio.StreamWriter, status: int, obj: Any, headers: dict[str, str] | None = None
) -> None:
    payload = json.dumps(obj).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    writer.write(
        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n{extra}\r\n".encode()
        + payload
    )
    await writer.drain()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes] | None:
    line = await reader.readline()
    if not line:
        return None
    method, path, _ = line.decode().split(" ", 2)
    headers: dict[str, str] = {}
    while True:
        h = await reader.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return method, path.split("?")[0], headers, body


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--api-key")
    args = parser.parse_args()
    server = FakeServer(args.model, args.api_key)
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    print(f"PORT {port}", flush=True)
    async with srv:
        await srv.serve_forever()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
