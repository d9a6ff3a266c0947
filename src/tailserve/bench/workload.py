"""Workloads: scenario presets and the list of conversations a run will send.

A conversation is one request (single-turn) or several turns sent one after another; its first turn
is due at `offset_s` on an open-loop schedule. Lengths are drawn here, seeded, before the run starts,
so two runs with one seed send the same prompts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from tailserve.bench.arrivals import ArrivalSpec
from tailserve.bench.corpus import PromptSource
from tailserve.bench.errors import BenchConfigError
from tailserve.bench.lengths import LengthDist, parse_length_dist
from tailserve.bench.trace import TraceEntry


@dataclass(frozen=True)
class Preset:
    """A named scenario: length distributions, arrivals and run length from field practice."""

    name: str
    description: str
    input_len: str
    output_len: str
    arrival: ArrivalSpec
    duration_s: float
    warmup_s: float


PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        p.name: p
        for p in (
            Preset(
                "chat",
                "chat: input 512-2048, output 256-1024, 100 concurrent users (field range 50-200)",
                "uniform:512,2048",
                "uniform:256,1024",
                ArrivalSpec(kind="closed", concurrency=100),
                duration_s=300.0,
                warmup_s=30.0,
            ),
            Preset(
                "code",
                "code completion: input 1024-4096, output 128-512, 32 concurrent users (field range 10-50)",
                "uniform:1024,4096",
                "uniform:128,512",
                ArrivalSpec(kind="closed", concurrency=32),
                duration_s=300.0,
                warmup_s=30.0,
            ),
            Preset(
                "summarize",
                "summarization: input 4096-8192, output 256-512, 50 concurrent users (field range 20-100)",
                "uniform:4096,8192",
                "uniform:256,512",
                ArrivalSpec(kind="closed", concurrency=50),
                duration_s=300.0,
                warmup_s=30.0,
            ),
            Preset(
                "chat-scaled",
                "chat's prompts with answers scaled to 64-256 tokens, Poisson 0.4 req/s: for capacity "
                "searches under the chat SLA (docs/BENCH.md)",
                "uniform:512,2048",
                "uniform:64,256",
                ArrivalSpec(kind="poisson", rate_per_s=0.4),
                duration_s=300.0,
                warmup_s=30.0,
            ),
            Preset(
                "cpu-chat",
                "chat scaled for a 2-core CPU serving a ~135M model: input lognormal median 200 with 5% "
                "at ~1500, output 32-128, Poisson 0.25 req/s (~20 output tok/s offered; docs/BENCH.md)",
                "longtail:200,1500,0.05,0.5",
                "uniform:32,128",
                ArrivalSpec(kind="poisson", rate_per_s=0.25),
                duration_s=300.0,
                warmup_s=30.0,
            ),
        )
    }
)


@dataclass(frozen=True)
class WorkloadSpec:
    """What to send: lengths, shared prefix and turns; independent of when it is sent."""

    input_len: LengthDist = field(default_factory=lambda: parse_length_dist("fixed:128"))
    output_len: LengthDist = field(default_factory=lambda: parse_length_dist("fixed:64"))
    shared_prefix_tokens: int = 0
    shared_prefix_fraction: float = 0.0
    turns: int = 1
    think_time_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.shared_prefix_fraction <= 1.0:
            raise BenchConfigError("--shared-prefix-fraction must be in [0, 1]")
        if self.shared_prefix_tokens < 0 or self.turns < 1 or self.think_time_s < 0:
            raise BenchConfigError("shared prefix tokens, turns and think time must be non-negative")


@dataclass(frozen=True)
class TurnPlan:
    """One request: the new user text, its planned lengths, and whether it carries the shared prefix."""

    index: int
    conversation: int
    turn: int
    prompt: str
    input_tokens: int
    output_tokens: int
    system_prefix: str | None = None


@dataclass(frozen=True)
class ConversationPlan:
    """Turns sent in order; the first is due at `offset_s` (None in a closed loop)."""

    offset_s: float | None
    turns: tuple[TurnPlan, ...]


class WorkloadGenerator:
    """Draws conversations one at a time (seeded), so closed-loop duration runs need no upper bound."""

    def __init__(self, spec: WorkloadSpec, source: PromptSource, rng: np.random.Generator) -> None:
        self.spec = spec
        self._source = source
        self._rng = rng
        self._prefix = source.fixed(spec.shared_prefix_tokens) if spec.shared_prefix_tokens else None
        self._next_index = 0
        self._next_conversation = 0

    def conversation(self, offset_s: float | None) -> ConversationPlan:
        """The next conversation, due at `offset_s`."""
        spec, rng = self.spec, self._rng
        c = self._next_conversation
        self._next_conversation += 1
        use_prefix = self._prefix is not None and bool(rng.random() < spec.shared_prefix_fraction)
        inputs = spec.input_len.sample(rng, spec.turns)
        outputs = spec.output_len.sample(rng, spec.turns)
        turns = []
        for t in range(spec.turns):
            system = self._prefix if use_prefix else None
            # The prefix is part of the asked input length: the body gets what is left of it.
            body_tokens = max(1, inputs[t] - (spec.shared_prefix_tokens if system else 0))
            prompt = self._source.cut(body_tokens, rng)
            planned = body_tokens + (spec.shared_prefix_tokens if system else 0)
            turns.append(TurnPlan(self._next_index, c, t, prompt, planned, outputs[t], system))
            self._next_index += 1
        return ConversationPlan(offset_s, tuple(turns))


def build_conversations(
    generator: WorkloadGenerator, num_requests: int, offsets: list[float] | None
) -> list[ConversationPlan]:
    """Enough conversations for `num_requests` requests (capped by the schedule's length)."""
    turns = generator.spec.turns
    count = -(-num_requests // turns)
    if offsets is not None:
        count = min(count, len(offsets))
    return [generator.conversation(offsets[c] if offsets is not None else None) for c in range(count)]


def conversations_from_trace(
    entries: list[TraceEntry], source: PromptSource, rng: np.random.Generator
) -> list[ConversationPlan]:
    """One single-turn conversation per trace line, due at the line's (sped-up) offset."""
    plans: list[ConversationPlan] = []
    for i, entry in enumerate(entries):
        if entry.prompt is not None:
            prompt, input_tokens = entry.prompt, source.tokenizer.count(entry.prompt)
        else:
            input_tokens = int(entry.input_tokens or 1)
            prompt = source.cut(input_tokens, rng)
        turn = TurnPlan(i, i, 0, prompt, input_tokens, entry.output_tokens)
        plans.append(ConversationPlan(entry.offset_s, (turn,)))
    return plans
