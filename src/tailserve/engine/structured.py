"""Structured outputs: grammars compiled once per spec (an LRU), one matcher per request, bitmask rows.

The engine's only door to the grammar library (xgrammar, imported on first use: the import alone
takes seconds). The sampler never sees a grammar, only the int32 token bitmask rows filled here.
Compiling takes milliseconds to tenths of a second, so the server compiles on a worker thread
before the engine sees the request; the step loop then finds the grammar in the cache.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from tailserve.engine.request import GrammarSpec, TokenGrammar
from tailserve.errors import InvalidRequestError
from tailserve.weights.tokenizer import ByteTokenizer, Tokenizer

CACHE_ENTRIES = 64  # compiled grammars kept; a JSON schema's is tens of kB to a few MB
PREPARED_HOLD_S = 60.0  # a grammar compiled for a request on its way is kept this long at least
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"  # Hermes-style (server/tools.py)


class GrammarMatcher:
    """One request's place in its grammar: which tokens may come next, advanced by each sampled token."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (bit t of word t // 32 set: token t allowed)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar forbids it (the mask makes that impossible)."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its end token was taken: the request is done."""
        return bool(self._matcher.is_terminated())


class GrammarCache:
    """Compiled grammars of one tokenizer, least recently used evicted; safe to call from any thread.

    Preemption by recompute keeps a request's matcher: its output tokens stay, so does its state.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, capacity: int = CACHE_ENTRIES) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self._capacity = capacity
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._prepared_at: dict[GrammarSpec, float] = {}  # specs compiled ahead for a request on its way
        self._lock = threading.Lock()
        self._compiler: Any = None

    def compile(self, spec: GrammarSpec, prepare: bool = False) -> Any:
        """The compiled grammar of `spec`, from the cache or built now; a bad spec raises a 400 naming
        `spec.param`, and nothing is cached. `prepare`: compiled ahead for a request on its way to
        the engine, so it is not evicted for PREPARED_HOLD_S (the step loop must never compile)."""
        with self._lock:
            if prepare:
                self._prepared_at[spec] = time.monotonic()
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
            compiler = self._compiler_locked()
        try:
            compiled = _compile(compiler, spec)  # outside the lock: other compiles and hits go on
        except BaseException:
            with self._lock:
                self._prepared_at.pop(spec, None)
            raise
        with self._lock:
            self._compiled[spec] = compiled
            self._compiled.move_to_end(spec)
            self._evict_locked()
        return compiled

    def _evict_locked(self) -> None:
        """Least recently used first, skipping grammars prepared for requests still on their way (the
        cache may then run over its capacity for a while, by at most the requests in flight)."""
        now = time.monotonic()
        self._prepared_at = {s: t for s, t in self._prepared_at.items() if now - t < PREPARED_HOLD_S}
        for spec in list(self._compiled):
            if len(self._compiled) <= self._capacity:
                break
            if spec not in self._prepared_at:
                del self._compiled[spec]

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher at the start of `spec`'s grammar (each of n choices gets its own)."""
        import xgrammar

        return GrammarMatcher(xgrammar.GrammarMatcher(self.compile(spec)))

    def __len__(self) -> int:
        return len(self._compiled)

    def bitmask(self, matchers: Sequence[TokenGrammar]) -> torch.Tensor:
        """[len(matchers), ceil(vocab / 32)] int32: row j holds matcher j's allowed next tokens."""
        words = (self._vocab_size + 31) // 32
        mask = torch.full((len(matchers), words), -1, dtype=torch.int32)
        for row, m in enumerate(matchers):
            m.fill(mask, row)
        return mask

    def _compiler_locked(self) -> Any:
        if self._compiler is None:
            import xgrammar

            info = _tokenizer_info(xgrammar, self._tokenizer, self._vocab_size)
            # Our LRU bounds memory; xgrammar's own cache would keep every grammar ever compiled.
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._compiler


def _compile(compiler: Any, spec: GrammarSpec) -> Any:
    """Build the grammar for `spec`; the library's complaints become InvalidRequestError(spec.param)."""
    import xgrammar

    try:
        if spec.kind == "json_schema":
            schema = _escape_free_strings(json.loads(spec.source))
            return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.source)
        if spec.kind == "grammar":
            return compiler.compile_grammar(spec.source)
        if spec.kind == "choice":
            options = json.loads(spec.source)
            return compiler.compile_grammar("root ::= " + " | ".join(_ebnf_literal(o) for o in options))
        if spec.kind == "tool_call":
            schema = json.dumps(_escape_free_strings(json.loads(spec.source)))
            call = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
            around = [xgrammar.Grammar.from_ebnf(f"root ::= {_ebnf_literal(s)}") for s in _TOOL_CALL_AROUND]
            return compiler.compile_grammar(xgrammar.Grammar.concat(around[0], call, around[1]))
    except InvalidRequestError:
        raise
    except Exception as exc:  # the library raises RuntimeError/ValueError subclasses with a useful message
        raise InvalidRequestError(f"Invalid '{spec.param}': {_client_detail(exc)}", spec.param) from None
    raise InvalidRequestError(f"Unknown structured output kind {spec.kind!r}", spec.param)


_TOOL_CALL_AROUND = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
# xgrammar's C++ log prefix ("[02:52:28] /project/cpp/json_schema_converter.cc:5082: "), and any
# other source path with a line number: the client needs the complaint, not where it was raised.
_LOG_PREFIX = re.compile(r"^\[\d{2}:\d{2}:\d{2}\]\s*")
_SOURCE_AT = re.compile(r"(?:[\w./-]*/)?[\w.-]+\.(?:cc|cpp|cxx|h|hpp|py)(?::\d+)+:?\s*")


def _client_detail(exc: Exception) -> str:
    """The library's complaint as a client may see it: its first line, without the log timestamp,
    source paths and line numbers."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    line = _SOURCE_AT.sub("", _LOG_PREFIX.sub("", line)).strip()
    return line or type(exc).__name__


_LENGTH_KEYS = ("minLength", "maxLength")


def _escape_free_strings(schema: Any) -> Any:
    """Length-bounded strings as a pattern of plain characters (no escapes, no control characters).

    xgrammar 0.2.9 lets raw control characters into strings with minLength/maxLength, which is not
    JSON; the pattern keeps the same length bounds and always parses.
    """
    if isinstance(schema, list):
        return [_escape_free_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _escape_free_strings(v) for k, v in schema.items()}
    plain = not any(k in out for k in ("pattern", "format", "enum", "const"))
    if out.get("type") == "string" and plain and any(k in out for k in _LENGTH_KEYS):
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        bound = "" if high is None else str(int(high))
        out["pattern"] = rf'^[^"\\\x00-\x1f]{{{low},{bound}}}$'
    return out


def _ebnf_literal(text: str) -> str:
    """A quoted EBNF string literal (JSON's escapes are xgrammar's)."""
    return json.dumps(text, ensure_ascii=False)


def _tokenizer_info(xgrammar: Any, tokenizer: Tokenizer, vocab_size: int) -> Any:
    """Each token id's bytes (empty for special tokens: the grammar never allows them), and the end tokens."""
    stop = sorted(tokenizer.eos_token_ids)
    hf = tokenizer.hf
    backend = getattr(hf, "backend", None)  # GGUFTokenizer: a Rust byte-level BPE pipeline
    if isinstance(hf, ByteTokenizer):
        vocab = [bytes([i - 3]) if 3 <= i < 259 else b"" for i in range(vocab_size)]
    elif backend is not None:
        vocab = _byte_level_vocab(backend, vocab_size)
    else:
        return xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop)
    return xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)


def _byte_level_vocab(backend: Any, vocab_size: int) -> list[bytes]:
    """GPT-2 byte-level token strings -> the bytes they stand for; added tokens are literal text."""
    to_byte = {ch: b for b, ch in _byte_alphabet().items()}
    vocab = [b""] * vocab_size
    for text, i in backend.get_vocab(with_added_tokens=False).items():
        if i < vocab_size:
            vocab[i] = bytes(to_byte[c] for c in text) if all(c in to_byte for c in text) else b""
    for i, added in backend.get_added_tokens_decoder().items():
        if i < vocab_size:
            vocab[i] = b"" if added.special else added.content.encode("utf-8")
    return vocab


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes map to themselves, the rest
    to 256 + n in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out
