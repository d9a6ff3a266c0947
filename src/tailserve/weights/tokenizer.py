"""Tokenizers (GGUF byte-level BPE, Hugging Face, or byte-level for dummy weights) and incremental
detokenization.

Detokenization never emits half a UTF-8 character: text is released only once it decodes cleanly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tailserve.errors import InvalidRequestError, ModelLoadError

Message = dict[str, Any]


class Tokenizer:
    """Text <-> token ids, chat templates and the ids that end a generation."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int], name: str = "") -> None:
        self.hf = hf_tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.name = name

    @classmethod
    def from_transformers(
        cls, eos_token_ids: Iterable[int], name: str, failure: str, *source: str, **options: Any
    ) -> Tokenizer:
        """transformers' AutoTokenizer.from_pretrained(*source, **options), its own end token joining
        `eos_token_ids` (the architecture's); ModelLoadError("`failure`: why") if it cannot be built."""
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(*source, **options)
        except Exception as exc:
            raise ModelLoadError(f"{failure}: {exc}") from exc
        eos = set(eos_token_ids)
        if hf.eos_token_id is not None:
            eos.add(int(hf.eos_token_id))
        return cls(hf, sorted(eos), name)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def set_chat_template(self, template: str) -> None:
        """Replace the model's chat template (vLLM's --chat-template) before serving starts."""
        self.hf.chat_template = template

    @property
    def supports_tools(self) -> bool:
        """The chat template reads `tools` (Hugging Face's convention), so tools are rendered its way."""
        return "tools" in str(getattr(self.hf, "chat_template", None) or "")

    def apply_chat_template(self, messages: list[Message], tools: list[Message] | None = None) -> list[int]:
        """Token ids of the conversation followed by the assistant's generation prompt; `tools`
        (OpenAI's function list) go to templates that read them."""
        if not messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        if not getattr(self.hf, "chat_template", None):
            text = (
                "".join(f"{m.get('role', 'user')}: {m.get('content', '')}\n" for m in messages)
                + "assistant: "
            )
            return self.encode(text)
        try:
            extra = {"tools": tools} if tools else {}
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        except Exception as exc:  # jinja errors: a malformed conversation, not a server fault
            raise InvalidRequestError(
                f"messages do not fit the chat template: {exc}", param="messages"
            ) from exc
        return self.encode(str(text), add_special_tokens=False)


class ByteTokenizer:
    """A byte-level stand-in for dummy weights: id = byte + 3; 0/1/2 are pad/bos/eos."""

    chat_template = None
    _offset = 3

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size

    def __len__(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + self._offset for b in text.encode("utf-8")]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        # Ids beyond the byte range (dummy vocabularies are larger) fold back into it.
        data = bytes((t - self._offset) % 256 for t in token_ids if t >= self._offset)
        return data.decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas, holding back incomplete characters."""

    _CONTEXT_TOKENS = 4

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        # A few prompt tokens give context (some tokenizers decode a leading space differently alone).
        self._ids: list[int] = list(prompt_ids[-self._CONTEXT_TOKENS :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text that is now certain (possibly empty)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = decode(self._ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""
