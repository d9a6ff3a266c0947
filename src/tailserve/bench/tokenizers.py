"""Local token counting for prompt cutting and as a fallback when the server reports no usage.

`--tokenizer PATH` loads the target's Hugging Face tokenizer (lazily: `tokenizers`, else
`transformers`); `byte` counts UTF-8 bytes (exact for tailserve's `dummy:*` models); without one,
lengths are approximate (4 characters a token, the usual figure for English prose).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

from tailserve.bench.errors import BenchConfigError

CHARS_PER_TOKEN = 4


class PromptTokenizer(Protocol):
    """What the benchmark needs from a tokenizer."""

    name: str
    exact: bool

    def count(self, text: str) -> int:
        """Number of tokens `text` encodes to."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids (character codes for an approximate tokenizer)."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` produced by this tokenizer's `encode`."""
        ...


class ApproxTokenizer:
    """No tokenizer: a token is CHARS_PER_TOKEN characters; encode/decode map characters (not tokens)."""

    name = "approx-4-chars"
    exact = False

    def count(self, text: str) -> int:
        return math.ceil(len(text) / CHARS_PER_TOKEN)

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


class ByteTokenizer:
    """UTF-8 bytes as tokens: exact for byte-level models such as tailserve's `dummy:*`."""

    name = "byte"
    exact = True

    def count(self, text: str) -> int:
        return len(text.encode("utf-8"))

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer from a directory or a tokenizer.json file (no special tokens added)."""

    exact = True

    def __init__(self, path: str) -> None:
        self.name = path
        self._tok: Any = _load_hf(path)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def encode(self, text: str) -> list[int]:
        encoded = self._tok.encode(text, add_special_tokens=False)
        return list(encoded.ids) if hasattr(encoded, "ids") else list(encoded)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))


def _load_hf(path: str) -> Any:
    """Load with `tokenizers` when a tokenizer.json is there (fast, light), else `transformers`."""
    target = Path(path)
    json_file = target if target.is_file() else target / "tokenizer.json"
    if json_file.is_file() and json_file.suffix == ".json":
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(json_file))
    if not target.exists():
        raise BenchConfigError(f"--tokenizer {path}: no such file or directory")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds; the user needs the message only
        raise BenchConfigError(f"--tokenizer {path}: cannot load a tokenizer ({exc})") from exc


def load_tokenizer(spec: str | None) -> PromptTokenizer:
    """`None` -> approximate, `byte` -> ByteTokenizer, anything else -> a Hugging Face tokenizer path."""
    if spec is None or spec in ("", "approx"):
        return ApproxTokenizer()
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)
