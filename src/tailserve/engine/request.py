"""Per-request state: sampling parameters, lifecycle timestamps, outputs handed to callers.

A Request is owned by the engine's step loop; callers only ever see RequestOutput snapshots.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

from tailserve.errors import ContextLengthExceededError, InvalidRequestError
from tailserve.weights.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:  # annotations only: the server imports this module and must not load torch
    import torch

MAX_CACHE_SALT_CHARS = 256  # a tenant id or a random token fits; the salt is hashed with each first block


@dataclass(frozen=True)
class SloTarget:
    """A request's own latency targets and the class they came from (a metrics label).

    None: the engine's default (--slo-ttft / --slo-tpot). Only the `slo` policy reads them."""

    slo_class: str = "default"
    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            _check(value is None or (_finite(value) and value > 0), f"SLO {name} must be positive", "slo")


def ttft_target_s(slo: SloTarget | None, default_s: float) -> float:
    """The request's TTFT target, else the engine's."""
    return slo.ttft_s if slo is not None and slo.ttft_s is not None else default_s


def tpot_target_s(slo: SloTarget | None, default_s: float) -> float:
    """The request's TPOT target, else the engine's."""
    return slo.tpot_s if slo is not None and slo.tpot_s is not None else default_s


@dataclass(frozen=True)
class GrammarSpec:
    """A structured-output constraint (compiled in engine/structured.py); equal specs share one grammar.

    kind: "json_schema" (source: the schema as JSON text), "json_object" (any JSON object),
    "regex", "grammar" (xgrammar EBNF), "choice" (source: a JSON list of strings), or "tool_call"
    (source: the JSON schema of one Hermes-style `<tool_call>` body). `param` is the request field a
    bad spec's 400 names.
    """

    kind: str
    source: str = ""
    param: str = field(default="structured_outputs", compare=False)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop; validated on construction."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added logit) pairs, each token once
    min_tokens: int = 0  # end token, stop tokens and stop strings are held off until this many tokens
    logprobs: int | None = None  # None: none; k in 0..20: each output token's logprob and the k most likely
    # k in 0..20: every prompt token after the first gets its logprob and the k most likely (echo in
    # /v1/completions). Such a request skips the prefix cache until its prompt is scored.
    prompt_logprobs: int | None = None
    grammar: GrammarSpec | None = None  # structured outputs: only tokens the grammar allows are sampled
    # vLLM's cache_salt (not sampling either): requests share prefix-cache blocks only with the same salt.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in bias))
        check_max_tokens(self.max_tokens, scores_prompt=self.prompt_logprobs is not None)
        _check(_finite(self.temperature), "temperature must be a number", "temperature")
        _check(
            0.0 <= self.temperature <= 2.0,
            f"temperature must be in [0, 2], got {self.temperature}",
            "temperature",
        )
        _check(_finite(self.top_p), "top_p must be a number", "top_p")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _check(_is_int(self.top_k), "top_k must be an integer", "top_k")
        _check(self.top_k >= -1, f"top_k must be -1, 0 (off) or positive, got {self.top_k}", "top_k")
        _check(self.seed is None or _is_int(self.seed), "seed must be an integer", "seed")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings", "stop")
        _check(len(self.stop) <= 16, "at most 16 stop sequences", "stop")
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers",
            "stop_token_ids",
        )
        _check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}", name)
        _check(
            _finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
            f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}",
            "repetition_penalty",
        )
        _check(
            all(_is_int(t) and t >= 0 and _finite(b) and -100 <= b <= 100 for t, b in self.logit_bias),
            "logit_bias maps token ids to biases in [-100, 100]",
            "logit_bias",
        )
        # Each token once (a repeated id keeps its last bias): the sampler adds every pair it is given.
        object.__setattr__(self, "logit_bias", tuple(dict(self.logit_bias).items()))
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens must be a non-negative integer",
            "min_tokens",
        )
        for name in ("logprobs", "prompt_logprobs"):
            top = getattr(self, name)
            _check(
                top is None or (_is_int(top) and 0 <= top <= 20),
                f"{name} must be an integer in [0, 20], got {top}",
                name,
            )
        _check(
            self.cache_salt is None
            or (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS),
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            "cache_salt",
        )
        _check(
            self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            "min_tokens",
        )

    @property
    def greedy(self) -> bool:
        """Temperature 0 means argmax."""
        return self.temperature == 0.0


def check_max_tokens(
    max_tokens: object, scores_prompt: bool, name: str = "max_tokens", fit: tuple[int, int] | None = None
) -> None:
    """The rule for max_tokens, stated once: an integer, at least 1, or 0 when the request only scores
    its prompt (prompt logprobs); with `fit` (prompt tokens, context), the prompt and max_tokens fit
    the context (a prompt that fills it alone is the prompt's error, not this one). `name`: the field
    the caller sent it as, which the error names."""
    if not _is_int(max_tokens):
        raise InvalidRequestError(f"'{name}' must be an integer", param=name)
    _check(
        max_tokens >= 1 or (max_tokens == 0 and scores_prompt),
        f"'{name}' must be at least 1 (0 only to score the prompt, with echo), got {max_tokens}",
        name,
    )
    if fit is None:
        return
    n, context = fit
    if n < context < n + max_tokens:
        raise ContextLengthExceededError(
            f"prompt ({n} tokens) + {name} ({max_tokens}) exceeds the context of "
            f"{context} tokens: lower {name} to at most {context - n}",
            param=name,
        )


def check_limits(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, context: int) -> None:
    """The model's limits on a request: a non-empty prompt of known ids that leaves room to generate."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if any(not isinstance(t, int) or t < 0 or t >= vocab_size for t in prompt_token_ids):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size})", param="prompt")
    if any(t >= vocab_size for t, _ in params.logit_bias):
        raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab_size})", param="logit_bias")
    if any(t >= vocab_size for t in params.stop_token_ids):
        raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")
    if n >= context:
        raise ContextLengthExceededError(
            f"the prompt has {n} tokens; this model's context is {context} "
            f"(prompt plus at least one generated token must fit): shorten the prompt",
            param="prompt",
        )
    check_max_tokens(params.max_tokens, params.prompt_logprobs is not None, fit=(n, context))


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> TypeGuard[int]:
    """An int that is not a bool (JSON's true is no token count)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)


class TokenGrammar(Protocol):
    """A request's place in its structured-output grammar (engine.structured.GrammarMatcher)."""

    def fill(self, bitmask: torch.Tensor, row: int) -> None: ...
    def accept(self, token_id: int) -> bool: ...
    @property
    def terminated(self) -> bool: ...


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestTimings:
    """Server-side clock (time.monotonic) marks of one request, for metrics and attribution."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finish: float | None = None
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def queue_s(self) -> float:
        return (self.first_scheduled or self.arrival) - self.arrival

    @property
    def prefill_s(self) -> float:
        if self.first_token is None or self.first_scheduled is None:
            return 0.0
        return self.first_token - self.first_scheduled

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def decode_s(self) -> float:
        if not self.token_times:
            return 0.0
        return self.token_times[-1] - self.token_times[0]

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds per output token after the first: None until finished with two or more."""
        times = self.token_times
        if len(times) < 2 or self.first_token is None or self.finish is None:
            return None
        return (self.finish - self.first_token) / (len(times) - 1)

    def as_dict(self) -> dict[str, float | int]:
        """The `tailserve_timings` HTTP extension field (docs/INTERFACES.md)."""
        return {
            "queue_s": self.queue_s,
            "prefill_s": self.prefill_s,
            "ttft_s": self.ttft_s or 0.0,
            "decode_s": self.decode_s,
            "e2e_s": self.e2e_s or 0.0,
            "preemptions": self.preemptions,
            "cached_tokens": self.cached_tokens,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": len(self.token_times),
        }


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability under the model's raw distribution, and the most likely
    alternatives as (token id, log-probability), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """What a caller sees after a step: the new tokens/text and, at the end, the timings."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    timings: RequestTimings | None = None
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # for new_token_ids, when asked
    logprobs: list[TokenLogprob] = field(
        default_factory=list
    )  # for token_ids, when asked (final output only)
    # prompt tokens 1.. (the first has no context), when asked: on the first and the final output
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Request:
    """Mutable state of one request inside the engine (owned by the step loop)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    timings: RequestTimings
    seq_no: int  # arrival order, for FCFS and tie-breaks
    token_ids: list[int] = field(default_factory=list)  # prompt + output so far
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None  # its own, for seeded sampling (the engine gives each one)
    detokenizer: IncrementalDetokenizer | None = None  # the engine gives each request one
    text: str = ""  # decoded output so far (stop strings already cut)
    emitted_chars: int = 0  # how much of `text` callers have been given
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when asked
    grammar: TokenGrammar | None = None  # when params.grammar is set
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # entry i: prompt token i + 1
    # Prompt tokens the prefix cache held when it was queued: wait estimates leave them out while it
    # waits (a waiting request has matched nothing yet; once running, num_computed_tokens counts them).
    expected_cached_tokens: int = 0
    slo: SloTarget | None = None  # its own latency targets (None: the engine's), read by `slo` and admission
    # Admission's hold (the engine's clock): a waiting prompt starts no sooner, so that the streams
    # running when it came keep their TPOT (engine/tpot_model.py); 0: none.
    not_before: float = 0.0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.timings.prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def prompt_work_tokens(self) -> int:
        """Tokens still to compute before its first output, for wait estimates: a waiting request's
        expected prefix-cache hit is left out."""
        expected = self.expected_cached_tokens if self.status is RequestStatus.WAITING else 0
        return max(self.num_uncomputed_tokens - expected, 1)

    @property
    def scores_prompt(self) -> bool:
        """It asked for prompt logprobs and some prompt tokens are not scored yet."""
        wanted = self.params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    @property
    def is_decoding(self) -> bool:
        """Its prompt is in the cache and one generated token waits to be fed back: the next step is a decode.

        Decided by the request alone, never by how the scheduler cut its chunks, so the rows a request
        runs as decodes (and the weight format they use) do not depend on who shares the batch.
        """
        return self.num_uncomputed_tokens == 1 and self.num_computed_tokens >= len(self.prompt_token_ids)
