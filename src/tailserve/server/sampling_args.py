"""OpenAI sampling and output fields -> the engine's SamplingParams and output grammar.

The second half of protocol.py's translation: a validated request body in, SamplingParams out, or a
typed error naming the field the client sent. Never touches engine state.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from tailserve.engine.request import GrammarSpec, SamplingParams, check_max_tokens
from tailserve.errors import ContextLengthExceededError, InvalidRequestError
from tailserve.server.generation_defaults import GenerationDefaults
from tailserve.server.protocol import (
    OPENAI_COMPLETION_MAX_TOKENS,
    SEED_RANGE,
    ChatCompletionRequest,
    CommonRequest,
    CompletionRequest,
    StructuredOutputs,
    reject_unsupported,
)
from tailserve.server.tools import tool_setup


def sampling_params(
    req: CommonRequest,
    prompt_len: int,
    max_model_len: int,
    max_tokens_default: int,
    defaults: GenerationDefaults | None = None,
    cache_salt: str | None = None,
) -> SamplingParams:
    """OpenAI sampling fields -> SamplingParams; the error's param names the field the client sent.

    A field left out takes the model's generation default, then OpenAI's; a missing max_tokens is
    capped at `max_tokens_default` (and at the context left), so no request runs unbounded.
    `cache_salt` (else the body's): the server's choice for the request (--cache-salt-from-api-key)."""
    reject_unsupported(req)
    model = defaults or GenerationDefaults()
    max_param, max_tokens = "max_tokens", req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_param, max_tokens = "max_completion_tokens", req.max_completion_tokens
    if max_tokens is None:
        openai_default = OPENAI_COMPLETION_MAX_TOKENS if isinstance(req, CompletionRequest) else max_model_len
        max_tokens = min(openai_default, max_tokens_default, max_model_len - prompt_len)
        if max_tokens < 1:
            message = f"The prompt has {prompt_len} tokens; the context holds {max_model_len}"
            raise ContextLengthExceededError(
                message, "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
            )
    prompt_logprobs = _prompt_logprobs(req, max_tokens)
    # In the client's name, with the context it must fit (the engine checks a prompt too long alone).
    check_max_tokens(max_tokens, prompt_logprobs is not None, max_param, fit=(prompt_len, max_model_len))
    if req.seed is not None and not SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]:
        raise InvalidRequestError(
            f"Invalid value for 'seed': must be in [-2**63, 2**64 - 1], got a {req.seed.bit_length()}-bit number",
            "seed",
        )
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    temperature = req.temperature if req.temperature is not None else model.temperature
    top_p = req.top_p if req.top_p is not None else model.top_p
    top_k = req.top_k if req.top_k is not None else model.top_k
    grammar = request_grammar(req)
    if grammar is not None and req.min_tokens:
        # A grammar that is complete must be able to end; banning the end token would leave no token.
        raise InvalidRequestError(
            "'min_tokens' cannot be combined with a constrained output (response_format, "
            "structured_outputs or a forced tool_choice)",
            "min_tokens",
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=top_k or 0,
        seed=req.seed,
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=_logit_bias(req.logit_bias),
        min_tokens=req.min_tokens or 0,
        logprobs=_logprobs(req),
        grammar=grammar,
        prompt_logprobs=prompt_logprobs,
        cache_salt=cache_salt if cache_salt is not None else req.cache_salt,
    )


def request_grammar(req: CommonRequest) -> GrammarSpec | None:
    """The one output constraint a request asks for: response_format, structured_outputs, or a call
    forced by tool_choice; asking for two is a 400 naming the second."""
    found: list[GrammarSpec] = []
    if isinstance(req, ChatCompletionRequest):
        if (spec := _response_format(req.response_format)) is not None:
            found.append(spec)
        if (spec := tool_setup(req.tools, req.tool_choice).grammar) is not None:
            found.append(dataclasses.replace(spec, param="tool_choice") if found else spec)
    if req.structured_outputs is not None:
        found.append(_structured_outputs(req.structured_outputs))
    if len(found) > 1:
        raise InvalidRequestError(
            "Only one of 'response_format', 'structured_outputs' and a forced 'tool_choice' may constrain the output",
            found[1].param.split(".")[0],
        )
    return found[0] if found else None


def _response_format(fmt: dict[str, Any] | None) -> GrammarSpec | None:
    """OpenAI's `response_format`: text (no constraint), json_object, or json_schema with a schema."""
    kind = (fmt or {}).get("type", "text")
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", param="response_format")
    if kind != "json_schema":
        raise InvalidRequestError(
            f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            "response_format.type",
        )
    body = fmt.get("json_schema")
    if not isinstance(body, dict) or not isinstance(body.get("name", ""), str):
        raise InvalidRequestError(
            "'response_format.json_schema' must be an object with a 'name' and a 'schema'",
            "response_format.json_schema",
        )
    schema = body.get("schema", {})
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            "'response_format.json_schema.schema' must be a JSON schema object",
            "response_format.json_schema.schema",
        )
    # `strict` false or true: the schema is enforced either way (a grammar cannot half-apply).
    return GrammarSpec("json_schema", json.dumps(schema), param="response_format.json_schema.schema")


def _structured_outputs(so: StructuredOutputs) -> GrammarSpec:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""
    given = {k: v for k, v in so.model_dump(by_alias=True).items() if v not in (None, False)}
    if len(given) != 1:
        raise InvalidRequestError(
            "'structured_outputs' takes exactly one of 'json', 'regex', 'choice', 'grammar', 'json_object'",
            "structured_outputs",
        )
    (key, value), param = next(iter(given.items())), f"structured_outputs.{next(iter(given))}"
    if key == "json":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"'{param}' is not valid JSON: {exc}", param) from None
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"'{param}' must be a JSON schema object", param)
        return GrammarSpec("json_schema", json.dumps(schema), param=param)
    if key == "choice":
        if not value or not all(value):
            raise InvalidRequestError(f"'{param}' must be a non-empty list of non-empty strings", param)
        return GrammarSpec("choice", json.dumps(value), param=param)
    if key == "json_object":
        return GrammarSpec("json_object", param=param)
    if not value:
        raise InvalidRequestError(f"'{param}' must not be empty", param)
    return GrammarSpec(key, value, param=param)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id as text": bias} -> (id, bias) pairs; a key that is not an id is a 400."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.isdigit():
            raise InvalidRequestError(f"Invalid key in 'logit_bias': {key!r} is not a token id", "logit_bias")
        pairs.append((int(key), value))
    return tuple(pairs)


def _prompt_logprobs(req: CommonRequest, max_tokens: int) -> int | None:
    """echo with logprobs scores the prompt too (as vLLM); echo with max_tokens=0 runs the prompt only."""
    if not isinstance(req, CompletionRequest) or not req.echo:
        return None
    return req.logprobs if req.logprobs is not None else (0 if max_tokens == 0 else None)


def _logprobs(req: CommonRequest) -> int | None:
    """How many top alternatives each output token reports; None: no logprobs at all."""
    if isinstance(req, CompletionRequest):
        return req.logprobs  # the legacy shape: an integer, 0 for the chosen token only
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequestError("'top_logprobs' requires 'logprobs': true", "top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise InvalidRequestError("'top_logprobs' must be in [0, 20]", "top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    return None
