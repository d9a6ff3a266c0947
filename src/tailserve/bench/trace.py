"""Trace files: one JSON object a line with a timestamp, a prompt or an input length, an output length.

Accepted keys: `timestamp` | `time` | `t` (seconds, any origin); `prompt` (text) or `input_tokens` |
`input_len` | `prompt_tokens`; `output_tokens` | `output_len` | `max_tokens`. Blank lines and lines
starting with `#` are skipped; every other bad line is reported with its number before anything is sent.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailserve.bench.errors import TraceFileError

_TIME_KEYS = ("timestamp", "time", "t")
_INPUT_KEYS = ("input_tokens", "input_len", "prompt_tokens")
_OUTPUT_KEYS = ("output_tokens", "output_len", "max_tokens")


@dataclass(frozen=True)
class TraceEntry:
    """One request of a trace; `offset_s` is relative to the trace's first timestamp, before speed-up."""

    offset_s: float
    output_tokens: int
    input_tokens: int | None = None
    prompt: str | None = None


def load_trace(path: str, speed: float = 1.0) -> list[TraceEntry]:
    """Read and validate a trace; offsets are divided by `speed` and sorted."""
    file = Path(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFileError(path, [f"cannot read file: {exc}"]) from exc
    raw: list[tuple[float, TraceEntry]] = []
    problems: list[str] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            raw.append(_parse_line(line))
        except ValueError as exc:
            problems.append(f"line {number}: {exc}")
    if problems:
        raise TraceFileError(path, problems)
    if not raw:
        raise TraceFileError(path, ["no requests in file"])
    raw.sort(key=lambda pair: pair[0])
    origin = raw[0][0]
    return [TraceEntry((ts - origin) / speed, e.output_tokens, e.input_tokens, e.prompt) for ts, e in raw]


def _parse_line(line: str) -> tuple[float, TraceEntry]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    ts = _number(obj, _TIME_KEYS, "timestamp")
    output_tokens = int(_number(obj, _OUTPUT_KEYS, "output length"))
    if output_tokens < 1:
        raise ValueError("output length must be >= 1")
    prompt = obj.get("prompt")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt must be a non-empty string")
        return ts, TraceEntry(0.0, output_tokens, None, prompt)
    input_tokens = int(_number(obj, _INPUT_KEYS, "prompt or input length"))
    if input_tokens < 1:
        raise ValueError("input length must be >= 1")
    return ts, TraceEntry(0.0, output_tokens, input_tokens, None)


def _number(obj: dict[str, Any], keys: tuple[str, ...], what: str) -> float:
    for key in keys:
        if key in obj:
            value = obj[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{key} must be a finite number, got {value!r}")
            return float(value)
    raise ValueError(f"missing {what} (one of {', '.join(keys)})")
