"""Server-sent events as the router relays them: split into whole events, checked, re-emitted.

An event is relayed as soon as its closing blank line arrives; nothing more is held back. The
router's own errors are sent the OpenAI way: `data: {"error": {...}}` then `data: [DONE]` (the
openai client raises on that error event in a Responses stream too).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

DONE_EVENT = b"data: [DONE]\n\n"
_FIELDS = (b"data:", b"event:", b"id:", b"retry:")
_RESPONSES_LAST_EVENTS = {b"response.completed", b"response.incomplete", b"response.failed", b"error"}


class MalformedStream(Exception):
    """The replica's byte stream is not well-formed SSE (or ended inside an event)."""


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole events (each ending in a blank line, newlines normalised to LF) from raw chunks."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk.replace(b"\r\n", b"\n")
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            event, buffer = buffer[: end + 2], buffer[end + 2 :]
            if event.strip():
                yield event
    if buffer.strip():
        raise MalformedStream("stream ended inside an event")


def check_event(event: bytes) -> bool:
    """Whether the event is one a client can read: known fields, and each `data` JSON or [DONE]."""
    for line in event.strip().split(b"\n"):
        if line.startswith(b":"):
            continue  # a comment (keep-alive)
        if not line.startswith(_FIELDS):
            return False
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            try:
                json.loads(payload)
            except ValueError:
                return False
    return True


def is_done(event: bytes) -> bool:
    """Whether this event ends its stream: `data: [DONE]` (completions, chat), or the Responses
    API's last event (`event: response.completed` and the like), after which nothing follows."""
    if event.strip() == DONE_EVENT.strip():
        return True
    for line in event.split(b"\n"):
        if line.startswith(b"event:") and line[6:].strip() in _RESPONSES_LAST_EVENTS:
            return True
    return False


def error_payload(message: str, err_type: str, code: str) -> dict[str, dict[str, str | None]]:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": err_type, "param": None, "code": code}}


def error_events(message: str, code: str = "replica_stream_failed") -> bytes:
    """A clean end for a stream that broke after output began: an error event, then [DONE]."""
    body = json.dumps(error_payload(message, "server_error", code))
    return f"data: {body}\n\n".encode() + DONE_EVENT
