"""SSE parsing: events, comments, multi-line data, and malformed streams."""

from __future__ import annotations

import pytest

from tailserve.bench.sse import MalformedSSEError, SSEParser


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
