"""Incremental Server-Sent Events parser: lines in, `data` payloads out.

Strict where it matters: a line that is neither blank, a comment, nor a `field: value` line with a
plain field name is malformed (servers that stream bare JSON lines are caught here, not silently read
as zero tokens). Multi-line `data` fields are joined with newlines, as the SSE spec says.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import AsyncIterable, AsyncIterator

_FIELD_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
_LINE_END = re.compile(r"\r\n|\r|\n")  # the only line ends SSE knows
_SNIPPET = 120


class MalformedSSEError(Exception):
    """The stream is not valid SSE (or its payloads are not the JSON an OpenAI server sends)."""


def snippet(text: str, limit: int = _SNIPPET) -> str:
    """A short, single-line excerpt for error messages: at most `limit` characters and "..."."""
    flat = text.replace("\n", "\\n")
    return flat if len(flat) <= limit else flat[:limit] + "..."


class SSEParser:
    """Feed decoded lines (without line terminators); get each event's data when the event ends."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self.event: str | None = None

    def feed_line(self, line: str) -> str | None:
        """Consume one line; return the event's data if this blank line ends an event with data."""
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if not sep or not _FIELD_NAME.match(name):
            raise MalformedSSEError(f"not an SSE line: {snippet(line)!r}")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self.event = value
        elif name == "error":
            # Unknown field names are ignored by the SSE spec, but an `error:` line is the server failing.
            raise MalformedSSEError(f"server sent an SSE error field: {snippet(value)!r}")
        return None

    def finish(self) -> str | None:
        """End of stream: data of an event that was not closed by a blank line, if any."""
        return self._dispatch()

    def _dispatch(self) -> str | None:
        if not self._data:
            self.event = None
            return None
        payload = "\n".join(self._data)
        self._data = []
        return payload


async def sse_lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """The stream's lines, split only where the SSE spec ends a line (CR LF, LF or CR). httpx's
    `aiter_lines` also splits on NEL, U+2028, U+2029 and other characters JSON strings may carry
    raw, which cut a `data:` line in two (seen: a random prompt's output token)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    async for chunk in chunks:
        pending += decoder.decode(chunk)
        lines, pending = _split_sse(pending)
        for line in lines:
            yield line
    pending += decoder.decode(b"", final=True)
    lines, pending = _split_sse(pending, final=True)
    for line in lines:
        yield line
    if pending:
        yield pending


def _split_sse(text: str, final: bool = False) -> tuple[list[str], str]:
    """Complete lines of `text` and the rest; a CR at the end waits for the next chunk (it may be
    half of a CR LF) unless `final`."""
    held = ""
    if not final and text.endswith("\r"):
        text, held = text[:-1], "\r"
    parts = _LINE_END.split(text)
    return parts[:-1], parts[-1] + held
