"""SSE parsing: events, comments, multi-line data, and malformed streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tailserve.bench.sse import MalformedSSEError, SSEParser, sse_lines


def feed(lines: list[str]) -> list[str]:
    parser = SSEParser()
    out = [p for line in lines if (p := parser.feed_line(line)) is not None]
    last = parser.finish()
    return out + ([last] if last is not None else [])


def test_events_and_comments() -> None:
    lines = [": keep-alive", "", 'data: {"a": 1}', "", "event: x", "id: 3", "data:[DONE]", ""]
    assert feed(lines) == ['{"a": 1}', "[DONE]"]


def test_multiline_data_and_unterminated_last_event() -> None:
    assert feed(["data: one", "data: two", "", "data: tail"]) == ["one\ntwo", "tail"]


@pytest.mark.parametrize("line", ['{"choices": []}', "garbage line", "da ta: x"])
def test_non_sse_lines_are_malformed(line: str) -> None:
    with pytest.raises(MalformedSSEError):
        SSEParser().feed_line(line)


def test_error_field_is_reported() -> None:
    with pytest.raises(MalformedSSEError, match="error"):
        SSEParser().feed_line("error: overloaded")


def _lines(*parts: bytes) -> list[str]:
    """`sse_lines` over these chunks."""

    async def chunks() -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    async def collect() -> list[str]:
        return [line async for line in sse_lines(chunks())]

    return asyncio.run(collect())


def test_lines_split_only_where_sse_ends_a_line() -> None:
    """NEL, U+2028 and U+2029 are text inside a data line (httpx's aiter_lines split there and the
    bench counted a malformed stream); CR LF, LF and CR end lines, also across chunk boundaries."""
    text = '{"text":"a\u2028b\u2029c\x85d"}'
    body = f"data: {text}\r\n\r\ndata: [DONE]\r\rx\n".encode()
    assert _lines(body) == [f"data: {text}", "", "data: [DONE]", "", "x"]
    # Cut everywhere, inside a CR LF and inside a multi-byte character too.
    assert _lines(*(body[i : i + 1] for i in range(len(body)))) == _lines(body)
    assert _lines(b"data: tail") == ["data: tail"]  # an unterminated last line
    assert _lines(b"a\r") == ["a"]  # a CR at the very end ends its line
