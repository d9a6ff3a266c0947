"""vLLM's /tokenize and /detokenize: the served model's tokenizer and chat template over HTTP.

Pure translation between JSON bodies and the tokenizer; it never touches the engine's queue or KV.
"""

from __future__ import annotations

from typing import Any

from tailserve.errors import InvalidRequestError
from tailserve.http.errors import UnsupportedParameterError
from tailserve.server.engine_api import Tokenizer
from tailserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    _Body,
    chat_prompt_ids,
    validate_body,
)


class TokenizeRequest(_Body):
    """POST /tokenize: a `prompt`, or chat `messages` rendered through the chat template."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    """POST /detokenize."""

    model: str
    tokens: list[int]


def tokenize(data: dict[str, Any], tokenizer: Tokenizer, max_model_len: int) -> tuple[str, dict[str, Any]]:
    """(model asked for, vLLM's {count, max_model_len, tokens})."""
    req = validate_body(TokenizeRequest, data)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("Give exactly one of 'prompt' and 'messages'", "prompt")
    if req.messages is not None:
        if not req.add_generation_prompt:
            message = "Only add_generation_prompt=true: the template always ends with the assistant's turn"
            raise UnsupportedParameterError(message, "add_generation_prompt")
        chat = ChatCompletionRequest(model=req.model, messages=req.messages)
        ids = chat_prompt_ids(chat, tokenizer)
    else:
        ids = tokenizer.encode(req.prompt or "")
    return req.model, {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}


def detokenize(
    data: dict[str, Any], tokenizer: Tokenizer, vocab_size: int | None
) -> tuple[str, dict[str, Any]]:
    """(model asked for, vLLM's {prompt})."""
    req = validate_body(DetokenizeRequest, data)
    if any(t < 0 or (vocab_size is not None and t >= vocab_size) for t in req.tokens):
        raise InvalidRequestError("'tokens' must be ids in the model's vocabulary", "tokens")
    return req.model, {"prompt": tokenizer.decode(req.tokens)}
