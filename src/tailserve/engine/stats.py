"""Engine counters for metrics, and a step-time model used to predict queue waits.

The model keeps two moving averages, refreshed after every step: the time of a decode-only step
(the per-step cost that every step pays) and the seconds per token of prompt-heavy steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine for gauges and admission control."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions_total: int
    steps_total: int

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(frozen=True)
class QueueSnapshot:
    """Prompt work not yet done, for wait predictions: (tokens left, TTFT deadline) per request."""

    pending: list[tuple[int, float]]
    num_running: int
    prefill_cap: int


class StepTimer:
    """Predicts step times from recent steps: decode-only step seconds and prefill seconds per token."""

    PREFILL_HEAVY_TOKENS = 32  # a step with at least this many tokens measures prefill throughput

    def __init__(self, alpha: float = 0.2, budget_tokens: int = 256) -> None:
        self.alpha = alpha
        self.budget_tokens = budget_tokens
        self.steps = 0
        self.last_step_s = 0.0
        self._decode_step_s: float | None = None
        self._per_token_s: float | None = None

    def record(self, plan: Any, seconds: float) -> None:
        tokens = int(plan.num_tokens)
        if plan.num_prefill_tokens == 0:
            self._decode_step_s = self._ewma(self._decode_step_s, seconds)
        if tokens >= self.PREFILL_HEAVY_TOKENS:
            self._per_token_s = self._ewma(self._per_token_s, seconds / tokens)
        self.steps += 1
        self.last_step_s = seconds

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def coefficients(self) -> tuple[float, float]:
        """(seconds of a decode-only step, seconds per prompt token); zeros until measured."""
        return self._decode_step_s or 0.0, self._per_token_s or 0.0

    def estimate_s(self, tokens: int, running: int, per_step_tokens: int | None = None) -> float:
        """Seconds to push `tokens` prompt tokens through steps that also carry `running` decodes."""
        step_s, per_token = self.coefficients()
        per_step = max(min(per_step_tokens or self.budget_tokens, self.budget_tokens - running), 1)
        steps = math.ceil(tokens / per_step) if tokens > 0 else 0
        return steps * (step_s if running else 0.0) + tokens * per_token
