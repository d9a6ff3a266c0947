"""Byte-level BPE tokenizers from GGUF metadata (`tokenizer.ggml.model == "gpt2"`), without transformers.

The Rust `tokenizers` pipeline is built from the file's vocabulary and merges, and the file's Jinja chat
template is rendered in jinja2's sandbox. Ids, text and prompts equal those of transformers'
PreTrainedTokenizerFast over the same pipeline (tests/weights/test_gguf_tokenizer.py). Must never import
transformers: that import alone is ~4 s of the default model's cold start.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
# llama.cpp's pre-tokenizer names -> split regexes (byte-level BPE). Digits-first for SmolLM.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_DIGITS_FIRST_PRE = ("smollm", "starcoder", "refact", "codeshell")
# GGUF `tokenizer.ggml.<key>_token_id` -> the name a chat template reads it under.
_NAMED_TOKEN_KEYS = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token"}


def bpe_pipeline(meta: Mapping[str, Any]) -> RustTokenizer:
    """BPE model, pre-tokenizer and ByteLevel decoder from GGUF metadata; no added (special) tokens yet."""
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = str(meta.get("tokenizer.ggml.pre", "gpt2"))
    split = _QWEN2_SPLIT if pre.startswith("qwen") else _GPT2_SPLIT
    steps: list[Any] = []
    if pre in _DIGITS_FIRST_PRE:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps += [
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend


class GGUFTokenizer:
    """What `model.tokenizer.Tokenizer` needs from a tokenizer: encode/decode, len() and the chat template."""

    def __init__(self, meta: Mapping[str, Any]) -> None:
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        self.named_tokens: dict[str, str] = {}
        for key, name in _NAMED_TOKEN_KEYS.items():
            i = meta.get(f"tokenizer.ggml.{key}_token_id")
            if i is not None and 0 <= int(i) < len(tokens):
                self.named_tokens[name] = tokens[int(i)]
        control = [tokens[i] for i, kind in enumerate(types) if kind == TOKEN_TYPE_CONTROL]
        user = [tokens[i] for i, kind in enumerate(types) if kind == TOKEN_TYPE_USER_DEFINED]
        self.backend = bpe_pipeline(meta)
        # Matched whole before BPE and, being special, dropped by decode(skip_special_tokens=True).
        special = dict.fromkeys([*self.named_tokens.values(), *control])
        self.backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        if user:
            self.backend.add_tokens(user)
        template = meta.get("tokenizer.chat_template")
        self.chat_template: str | None = str(template) if template else None
        self._compiled: tuple[str, jinja2.Template] | None = None  # (its source, the template)

    def __len__(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The conversation rendered as prompt text (jinja errors propagate; the caller maps them)."""
        if tokenize:
            raise ValueError("GGUFTokenizer.apply_chat_template renders text only; encode it separately")
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        if self._compiled is None or self._compiled[0] != self.chat_template:  # set anew: --chat-template
            self._compiled = (self.chat_template, _template_environment().from_string(self.chat_template))
        return self._compiled[1].render(
            messages=[_template_message(m) for m in messages],
            tools=list(tools) if tools else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.named_tokens,
        )


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    # A key set to None (OpenAI's content=None) is dropped: templates test for a missing key, not for None.
    if not isinstance(message, Mapping):
        raise TypeError(f"a chat message must be a dict, got {message!r}")
    return {key: value for key, value in message.items() if value is not None}


def _template_environment() -> ImmutableSandboxedEnvironment:
    """The sandbox chat templates run in: the globals and filters Hub templates expect."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, > and & for HTML; a prompt wants the characters themselves.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it is its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())
