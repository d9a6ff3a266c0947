"""Incremental Server-Sent Events parser: lines in, `data` payloads out.

Strict where it matters: a line that is neither blank, a comment, nor a `field: value` line with a
plain field name is malformed (servers that stream bare JSON lines are caught here, not silently read
as zero tokens). Multi-line `data` fields are joined with newlines, as the SSE spec says.
"""

from __future__ import annotations

import re

_FIELD_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
_SNIPPET = 120


class MalformedSSEError(Exception):
    """The stream is not valid SSE (or its payloads are not the JSON an OpenAI server sends)."""


def snippet(text: str) -> str:
    """A short, single-line excerpt for error messages."""
    flat = text.replace("\n", "\\n")
    return flat if len(flat) <= _SNIPPET else flat[:_SNIPPET] + "..."


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
