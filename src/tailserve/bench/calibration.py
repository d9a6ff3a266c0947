"""The calibration phase: isolated TTFT against prompt length on the idle server, fitted by a line.

Sequential requests (one at a time, max_tokens 1, fresh text each so no prefix cache helps) across a
spread of the workload's own prompt lengths; slowdown = TTFT / isolated TTFT(len) and queue delay =
TTFT - isolated TTFT(len) then say what the load added, fairly to long prompts. Never runs under load.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import numpy as np

from tailserve.bench.client import TargetConfig, preflight, request_body, send_request
from tailserve.bench.corpus import PromptSource
from tailserve.bench.errors import TargetError
from tailserve.bench.lengths import LengthDist
from tailserve.bench.records import RequestRecord
from tailserve.bench.tokenizers import PromptTokenizer
from tailserve.bench.workload import TurnPlan

# Quantiles of the workload's prompt lengths that are calibrated: the body and the long tail.
CALIBRATION_QUANTILES = (0.0, 0.25, 0.5, 0.75, 0.9, 0.97, 1.0)
DEFAULT_REPEATS = 3
_LENGTH_DRAWS = 2000


@dataclass(frozen=True)
class TtftFit:
    """Isolated TTFT(len) = intercept_s + slope_s_per_token * len, least squares over per-length medians."""

    intercept_s: float
    slope_s_per_token: float
    min_tokens: int
    max_tokens: int
    kind: str = "least_squares_line"

    def isolated_ttft_s(self, tokens: int) -> float:
        return self.intercept_s + self.slope_s_per_token * tokens


@dataclass(frozen=True)
class Calibration:
    """What the calibration phase sent and measured, and the fitted line."""

    lengths: list[int]
    repeats: int
    max_tokens: int
    points: list[tuple[int, float]]
    fit: TtftFit | None
    failed: int

    def to_json(self) -> dict[str, Any]:
        return {
            "lengths": self.lengths,
            "repeats": self.repeats,
            "max_tokens": self.max_tokens,
            "points": [{"input_tokens": n, "ttft_s": t} for n, t in self.points],
            "medians": [{"input_tokens": n, "ttft_s": t} for n, t in _medians(self.points)],
            "fit": asdict(self.fit) if self.fit else None,
            "failed": self.failed,
        }


def calibration_lengths(dist: LengthDist, seed: int) -> list[int]:
    """Distinct prompt lengths at CALIBRATION_QUANTILES of the workload's input distribution."""
    draws = np.sort(np.array(dist.sample(np.random.default_rng([seed, 7]), _LENGTH_DRAWS)))
    picks = {int(draws[min(len(draws) - 1, int(q * (len(draws) - 1)))]) for q in CALIBRATION_QUANTILES}
    return sorted(picks)


def fit_line(points: list[tuple[int, float]]) -> TtftFit | None:
    """Least-squares line through the per-length medians, kept physical: a negative intercept is
    refitted through the origin, a negative slope (noise) becomes a flat line at the mean."""
    medians = _medians(points)
    if not medians:
        return None
    xs = [float(n) for n, _ in medians]
    ys = [t for _, t in medians]
    lo, hi = int(min(xs)), int(max(xs))
    if len(medians) == 1:
        return TtftFit(ys[0], 0.0, lo, hi)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    slope = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    if slope < 0:
        return TtftFit(my, 0.0, lo, hi)
    if intercept < 0:
        slope = math.fsum(x * y for x, y in zip(xs, ys, strict=True)) / math.fsum(x * x for x in xs)
        intercept = 0.0
    return TtftFit(intercept, slope, lo, hi)


def _medians(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    by_length: dict[int, list[float]] = {}
    for n, t in points:
        by_length.setdefault(n, []).append(t)
    return [(n, statistics.median(ts)) for n, ts in sorted(by_length.items())]


async def calibrate(
    target: TargetConfig,
    tokenizer: PromptTokenizer,
    source: PromptSource,
    lengths: list[int],
    repeats: int = DEFAULT_REPEATS,
    seed: int = 0,
) -> Calibration | None:
    """Send `repeats` sequential 1-token requests per length; None when the target is unreachable
    (the run itself then reports why)."""
    try:
        model = await preflight(target)
    except TargetError:
        return None
    rng = np.random.default_rng([seed, 8])
    points: list[tuple[int, float]] = []
    failed = 0
    timeout = httpx.Timeout(target.timeout_s, connect=min(10.0, target.timeout_s))
    async with httpx.AsyncClient(timeout=timeout) as http:
        for i, length in enumerate(n for n in lengths for _ in range(repeats)):
            turn = TurnPlan(i, i, 0, source.cut(length, rng), length, 1)
            record = RequestRecord(i, i, 0, 1, length)
            await send_request(http, target, request_body(target, model, turn, []), record, tokenizer, 0.0)
            if record.ttft_s is None:
                failed += 1
                continue
            points.append((record.input_tokens or length, record.ttft_s))
    return Calibration(lengths, repeats, 1, points, fit_line(points), failed)
