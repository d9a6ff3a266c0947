"""Engine counters for metrics, and a step-time model used to predict queue waits.

The model is a decayed least-squares fit of step time = overhead + per_token x tokens, refitted
after every step, so admission control follows the machine as it is now.
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


class StepTimer:
    """Fits step seconds against tokens per step; predicts how long a backlog of tokens takes."""

    def __init__(self, decay: float = 0.97, budget_tokens: int = 256) -> None:
        self.decay = decay
        self.budget_tokens = budget_tokens
        self.steps = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.last_step_s = 0.0

    def record(self, plan: Any, seconds: float) -> None:
        x = float(plan.num_tokens)
        d = self.decay
        self._w = d * self._w + 1.0
        self._x = d * self._x + x
        self._y = d * self._y + seconds
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * seconds
        self.steps += 1
        self.last_step_s = seconds

    def coefficients(self) -> tuple[float, float]:
        """(overhead seconds per step, seconds per token), both non-negative."""
        if self._w == 0:
            return 0.0, 0.0
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var <= 1e-9:
            per_token = my / mx if mx > 0 else 0.0
            return 0.0, max(per_token, 0.0)
        per_token = max((self._xy / self._w - mx * my) / var, 0.0)
        return max(my - per_token * mx, 0.0), per_token

    def estimate_s(self, tokens: int, running: int, per_step_tokens: int | None = None) -> float:
        """Seconds to push `tokens` prompt tokens through steps that also carry `running` decodes."""
        overhead, per_token = self.coefficients()
        per_step = max(min(per_step_tokens or self.budget_tokens, self.budget_tokens - running), 1)
        steps = math.ceil(tokens / per_step) if tokens > 0 else 0
        return steps * (overhead + per_token * running) + tokens * per_token
