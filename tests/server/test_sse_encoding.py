"""Server-sent events stay one line per event for every client: the characters JSON carries raw but
Python's str.splitlines (httpx's iter_lines, and clients built on it) ends lines at are escaped."""

from __future__ import annotations

import json

from tailserve.http.sse import sse_event
from tailserve.server.responses_api import _sse


def test_an_event_with_unicode_line_separators_is_one_line_to_a_universal_line_splitter() -> None:
    text = "a\u2028b\u2029c\x85d\u00e9"
    for event in (sse_event({"text": text}), _sse({"type": "response.output_text.delta", "delta": text})):
        lines = event.decode().splitlines()
        data = [line for line in lines if line.startswith("data: ")]
        assert len(data) == 1  # nothing split off the data line:
        assert all(line == "" or line.startswith(("data: ", "event: ")) for line in lines)
        payload = json.loads(data[0].removeprefix("data: "))
        assert text in payload.values()  # the same text once parsed
        assert "\u00e9" in data[0]  # other characters stay as they are (UTF-8, not escaped)
