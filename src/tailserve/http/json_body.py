"""A raw request body -> a JSON object, refusing what would crash a later layer (the router's too).

Checks UTF-8, JSON syntax, the object shape, nesting depth, Python's integer digit limit and lone
surrogates, without recursion; imports nothing from the engine, so the router can use it.
"""

from __future__ import annotations

import json
from typing import Any

from tailserve.http.errors import InvalidJSONError

MAX_JSON_DEPTH = 32  # deeper bodies are refused before validation (no request needs more than ~5)


def parse_json(body: bytes) -> dict[str, Any]:
    """Raw body -> JSON object; invalid UTF-8, invalid JSON, a non-object, nesting deeper than
    MAX_JSON_DEPTH, an integer past Python's digit limit or a lone surrogate -> InvalidJSONError."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidJSONError(f"Request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidJSONError(f"Request body is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except RecursionError:
        raise InvalidJSONError(f"Request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # e.g. an integer literal longer than the int conversion limit
        raise InvalidJSONError(f"Request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidJSONError("Request body must be a JSON object")
    _check_tree(data)
    return data


def _check_tree(data: Any) -> None:
    """Depth and strings, iteratively (no recursion for an attacker to exhaust)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidJSONError(f"Request body is nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(node, str):
            _check_text(node)
        elif isinstance(node, dict):
            for key, value in node.items():
                _check_text(key)
                stack.append((value, depth + 1))
        elif isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON allows "\ud800"; no tokenizer does
        raise InvalidJSONError(
            f"Request body holds a lone UTF-16 surrogate (\\u{ord(text[exc.start]):04x}), which is not text"
        ) from None
