"""OpenAI request bodies (pydantic, strict), their prompts as token ids, and the n / best_of fan-out.

Turns a raw body into prompt token ids (sampling fields: sampling_args.py) or a typed error naming
the field; it never silently ignores a parameter it does not implement and never touches engine state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tailserve.engine.request import SamplingParams
from tailserve.errors import InvalidRequestError
from tailserve.http.errors import UnsupportedParameterError
from tailserve.server.engine_api import Tokenizer
from tailserve.server.tools import check_tool_calls, template_messages, tool_setup

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})
SEED_RANGE = (-(2**63), 2**64 - 1)  # what a 64-bit generator seed can hold
OPENAI_COMPLETION_MAX_TOKENS = 16  # /v1/completions' documented default


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


M = TypeVar("M", bound=_Body)


class StreamOptions(_Body):
    """`stream_options`: OpenAI's `include_usage` and vLLM's `continuous_usage_stats` (usage on every chunk)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SloRequest(_Body):
    """`slo` (extension): this request's own latency targets, in milliseconds; either may be left out."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None


class StructuredOutputs(_Body):
    """`structured_outputs` (extension, vLLM's spelling): exactly one constraint on the output."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # xgrammar's EBNF
    json_object: bool | None = None


class CommonRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # extension
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None  # extension, as vLLM
    min_p: float | None = None  # extension
    min_tokens: int | None = None  # extension
    stop_token_ids: list[int] | None = None  # extension
    structured_outputs: StructuredOutputs | None = None  # extension, as vLLM
    slo: SloRequest | None = None  # extension: own TTFT/TPOT targets (server/slo_classes.py)
    priority: int | str | None = None  # extension: an SLO class name, or vLLM's integer priority
    cache_salt: str | None = None  # extension, as vLLM: only requests with the same salt share cached blocks
    # Accepted and unused: they change no output here (no stored completions, one service tier).
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # SGLang's, which its model gateway sends on every request: accepted at the values that change
    # nothing here; reject_unsupported refuses the others (server/sglang_worker.py).
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    return_hidden_states: bool = False


class CompletionRequest(CommonRequest):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(_Body):
    """One chat message; content is a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers


class ChatCompletionRequest(CommonRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    continue_final_message: bool = False  # SGLang's, as above
    separate_reasoning: bool = True  # SGLang's: no reasoning parser here, so either value changes nothing
    stream_reasoning: bool = True  # SGLang's, likewise


@dataclass(frozen=True)
class EngineInput:
    """What the engine is asked to do for one HTTP request."""

    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    shares_prompt: bool = False  # one of n > 1 choices after the first: its prompt is counted once
    echo_text: str | None = None  # `echo`: the prompt's text, put before the completion's
    fork_of: str | None = (
        None  # n > 1: the engine request (the prompt's first choice) whose prompt KV it shares
    )


MAX_N = 16  # choices per prompt


def choices_per_prompt(req: CommonRequest) -> int:
    """`n`, checked: 1 to MAX_N."""
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"'n' must be in [1, {MAX_N}], got {n}", "n")
    return n


def candidates_per_prompt(req: CommonRequest, n: int) -> int:
    """`best_of` (completions): how many run per prompt, the n with the highest cumulative logprob
    returned; n to MAX_N, never streamed (as OpenAI)."""
    if not isinstance(req, CompletionRequest) or req.best_of is None:
        return n
    if not n <= req.best_of <= MAX_N:
        raise InvalidRequestError(
            f"'best_of' must be in [n, {MAX_N}] (n is {n}), got {req.best_of}", "best_of"
        )
    if req.stream and req.best_of > 1:
        raise InvalidRequestError("'best_of' cannot be used with stream=true", "best_of")
    return req.best_of


def fan_out(
    prompts: list[list[int]],
    params: list[SamplingParams],
    n: int,
    request_id: str,
    stream: bool,
    include_usage: bool,
    echo_texts: list[str] | None = None,
) -> list[EngineInput]:
    """n engine requests per prompt, choice index = prompt x n + j; the j > 0 fork the j = 0 one's
    prompt KV (engine request ids are `{request_id}-{index}`) and seed + j when a seed is given.
    `echo_texts`: each prompt's text, put before its choices' completions."""
    out = []
    for k, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        for j in range(n):
            seed = p.seed
            if seed is not None and j:
                seed = seed + j if seed + j <= SEED_RANGE[1] else seed - j
            fork_of = f"{request_id}-{k * n}" if j else None
            one = dataclasses.replace(p, seed=seed)
            echo = echo_texts[k] if echo_texts is not None else None
            out.append(EngineInput(ids, one, stream, include_usage, j > 0, echo, fork_of))
    return out


def validate_body(model: type[M], data: dict[str, Any]) -> M:
    """Strict pydantic validation; the first problem becomes an InvalidRequestError naming its field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param_name(first["loc"])
        if first["type"] == "missing":
            raise InvalidRequestError(f"Missing required parameter '{param}'", param) from None
        if first["type"] == "extra_forbidden":
            raise InvalidRequestError(f"Unrecognized request argument supplied: '{param}'", param) from None
        raise InvalidRequestError(f"Invalid value for '{param}': {first['msg']}", param) from None


def _param_name(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content' (union member tags dropped)."""
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            name += f".{part}" if name else part
        else:
            break
    return name or "body"


def reject_unsupported(req: CommonRequest) -> None:
    """Known OpenAI parameters with non-default values we do not implement get a 400."""
    checks: list[tuple[str, bool]] = [
        ("stream_options", req.stream_options is not None and not req.stream),
        ("no_stop_trim", req.no_stop_trim),
        ("skip_special_tokens", not req.skip_special_tokens),
        ("return_hidden_states", req.return_hidden_states),
    ]
    if isinstance(req, ChatCompletionRequest):
        checks += [
            ("functions", bool(req.functions)),
            ("function_call", req.function_call not in (None, "none", "auto")),
            ("continue_final_message", req.continue_final_message),
        ]
    for param, bad in checks:
        if bad:
            what = "only with stream=true" if param == "stream_options" else "not supported by this server"
            raise UnsupportedParameterError(f"Parameter '{param}' with this value is {what}", param)


MAX_PROMPTS = 64  # prompts in one /v1/completions request; each runs as its own engine request


def _listed_prompts(req: CompletionRequest) -> list[Any]:
    """The prompt as a list of prompts (a string or a list of token ids each)."""
    prompt: Any = req.prompt
    return prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else [prompt]


def completion_prompt_ids(req: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    """A string, a list of token ids, or a list of either (one choice each, in order); with `suffix`,
    each in the model's fill-in-the-middle order."""
    prompts = _listed_prompts(req)
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequestError(
            f"at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}", "prompt"
        )
    fim = fim_tokens(tokenizer, req) if req.suffix is not None else None
    out = []
    for i, one in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if fim is not None:
            one = f"{fim[0]}{one}{fim[1]}{req.suffix}{fim[2]}"  # prefix, suffix, then the middle is generated
        ids = tokenizer.encode(one) if isinstance(one, str) else list(one)
        if not ids:
            raise InvalidRequestError(f"'{param}' must not be empty", param)
        if any(t < 0 for t in ids):
            raise InvalidRequestError(f"'{param}' token ids must be non-negative", param)
        out.append(ids)
    return out


# Fill-in-the-middle markers: StarCoder / SantaCoder / DeepSeek-style, then Qwen2.5-Coder's.
FIM_TOKENS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
)


def fim_tokens(tokenizer: Tokenizer, req: CompletionRequest) -> tuple[str, str, str]:
    """The model's (prefix, suffix, middle) markers, each one token of its vocabulary; else a 400 naming suffix."""
    if req.echo:
        raise InvalidRequestError("'suffix' cannot be combined with echo", "suffix")
    if not all(isinstance(p, str) for p in _listed_prompts(req)):
        raise InvalidRequestError("'suffix' needs a text prompt, not token ids", "suffix")
    empty = tokenizer.encode("")  # a BOS the tokenizer adds to every text
    for names in FIM_TOKENS:
        if all(tokenizer.encode(t) == [*empty, tokenizer.encode(t)[-1]] for t in names):
            return names
    raise UnsupportedParameterError(
        "Parameter 'suffix' needs a model with fill-in-the-middle tokens "
        f"({', '.join(FIM_TOKENS[0])}); this model's vocabulary has none",
        "suffix",
    )


def echo_texts(req: CompletionRequest, prompts: list[list[int]], tokenizer: Tokenizer) -> list[str]:
    """`echo`: each prompt as the client sent it (token ids decoded)."""
    return [
        one if isinstance(one, str) else tokenizer.decode(ids)
        for one, ids in zip(_listed_prompts(req), prompts, strict=True)
    ]


def chat_prompt_ids(req: ChatCompletionRequest, tokenizer: Tokenizer) -> list[int]:
    """Messages -> the model's chat template with the generation prompt."""
    if not req.messages:
        raise InvalidRequestError("'messages' must contain at least one message", "messages")
    messages = [_template_message(m, i) for i, m in enumerate(req.messages)]
    setup = tool_setup(req.tools, req.tool_choice)
    tool_history = any(m.role == "tool" or m.tool_calls for m in req.messages)
    template_has_tools = bool(req.tools or tool_history) and tokenizer.supports_tools
    rendered, tools = template_messages(messages, setup, template_has_tools)
    return (
        tokenizer.apply_chat_template(rendered, tools) if tools else tokenizer.apply_chat_template(rendered)
    )


def parses_tool_calls(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """The output is read for <tool_call> blocks (tools given, tool_choice not "none")."""
    return isinstance(req, ChatCompletionRequest) and tool_setup(req.tools, req.tool_choice).parse


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """A checked message as the template sees it: role, text, and the tool fields its role has."""
    out: dict[str, Any] = {"role": message.role, "content": _message_text(message, index)}
    if message.tool_calls is not None:
        if message.role != "assistant":
            raise InvalidRequestError(
                "Only assistant messages carry 'tool_calls'", f"messages[{index}].tool_calls"
            )
        out["tool_calls"] = check_tool_calls(message.tool_calls, index)
    if message.role == "tool":
        if not message.tool_call_id:
            raise InvalidRequestError(
                "A tool message needs the 'tool_call_id' it answers", f"messages[{index}].tool_call_id"
            )
        out["tool_call_id"] = message.tool_call_id
    return out


def _message_text(message: ChatMessage, index: int) -> str:
    if message.role in ("user", "tool") and not message.content and not isinstance(message.content, str):
        raise InvalidRequestError(
            f"A {message.role} message needs content: a string or a non-empty list of text parts",
            f"messages[{index}].content",
        )
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts: list[str] = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            param = f"messages[{index}].content"
            raise UnsupportedParameterError(
                "Only text content parts ({'type': 'text', 'text': ...}) are supported", param
            )
        texts.append(part["text"])
    return "".join(texts)
