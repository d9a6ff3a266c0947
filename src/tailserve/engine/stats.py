"""Engine counters for metrics, per-step metrics, and a step-time model used to predict queue waits.

The model keeps two moving averages, refreshed after every step: the time of a decode-only step
(the per-step cost that every step pays) and the price of a prompt token beyond it. Step
metrics only count what the step loop hands them (host clock reads): nothing here touches a device.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

_MANTISSAS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.5)
# About 10 buckets per decade from 0.1 ms to 120 s: a P99 read from them is off by at most ~25%.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    *(round(m * 10.0**e, 6) for e in range(-4, 2) for m in _MANTISSAS),
    100.0,
    120.0,
)
TOKEN_BUCKETS: tuple[float, ...] = tuple(
    float(b * 2**e) for e in range(17) for b in (1, 1.5) if float(b * 2**e).is_integer()
)
STEP_KINDS = ("decode_only", "mixed", "prefill_only")
BUSY_WINDOW_S = 60


def step_kind(num_decodes: int, num_entries: int) -> str:
    """decode_only (every entry feeds back a token), prefill_only (prompt chunks only) or mixed."""
    if num_decodes == num_entries:
        return "decode_only"
    return "prefill_only" if num_decodes == 0 else "mixed"


@dataclass(frozen=True)
class BucketCounts:
    """A histogram as per-bucket counts (not cumulative; the last bucket is +Inf) and the sum observed."""

    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[int]:
        """Counts at or below each bound, the Prometheus `_bucket` series."""
        total, out = 0, []
        for c in self.counts:
            total += c
            out.append(total)
        return out

    def minus(self, earlier: BucketCounts) -> BucketCounts:
        return BucketCounts(
            tuple(a - b for a, b in zip(self.counts, earlier.counts, strict=True)), self.sum - earlier.sum
        )


class _Buckets:
    """Engine-thread side of a BucketCounts: observe values against fixed upper bounds."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> BucketCounts:
        return BucketCounts(tuple(self.counts), self.sum)


@dataclass(frozen=True)
class BusySnapshot:
    """Seconds spent in steps per wall-clock second for the newest seconds; `ratio(now)` reads it."""

    bins: tuple[float, ...] = (0.0,) * (BUSY_WINDOW_S + 1)  # bins[s % len] = busy seconds within second s
    newest_second: int = 0
    started: float = 0.0

    def ratio(self, now: float) -> float:
        """Share of wall time in steps over the last BUSY_WINDOW_S..+1 s (or since start), in [0, 1]."""
        n = len(self.bins)
        first = max(math.floor(now) - (n - 1), self.newest_second - (n - 1))
        busy = sum(self.bins[s % n] for s in range(first, self.newest_second + 1))
        span = now - max(self.started, float(math.floor(now) - (n - 1)))
        # Busy moments are counted once (StepStats.record), so busy <= span up to float rounding.
        return min(busy / span, 1.0) if span > 0 else 0.0


class BusyWindow:
    """Ring of one-second bins of busy time; a step that spans seconds is split between them."""

    def __init__(self, now: float, window_s: int = BUSY_WINDOW_S) -> None:
        self._bins = [0.0] * (window_s + 1)
        self._newest = math.floor(now)
        self.started = now

    def add(self, start: float, end: float) -> None:
        self._advance(math.floor(end))
        n = len(self._bins)
        t = max(start, float(self._newest - (n - 1)))  # older parts left the window already
        while t < end:
            second = math.floor(t)
            upto = min(end, second + 1.0)
            self._bins[second % n] += upto - t
            t = upto

    def _advance(self, second: int) -> None:
        """Make `second` the newest bin, zeroing the seconds skipped since the last step."""
        n = len(self._bins)
        for s in range(max(self._newest + 1, second - (n - 1)), second + 1):
            self._bins[s % n] = 0.0
        self._newest = max(self._newest, second)

    def snapshot(self) -> BusySnapshot:
        return BusySnapshot(tuple(self._bins), self._newest, self.started)


_EMPTY_DURATIONS = BucketCounts((0,) * (len(LATENCY_BUCKETS_S) + 1), 0.0)
_EMPTY_TOKENS = BucketCounts((0,) * (len(TOKEN_BUCKETS) + 1), 0.0)


@dataclass(frozen=True)
class StepSnapshot:
    """Step metrics at one moment: per-kind histograms (in STEP_KINDS order), busy time, graph vs eager."""

    duration_s: tuple[BucketCounts, ...] = (_EMPTY_DURATIONS,) * len(STEP_KINDS)
    tokens: tuple[BucketCounts, ...] = (_EMPTY_TOKENS,) * len(STEP_KINDS)
    busy_s_total: float = 0.0
    busy: BusySnapshot = field(default_factory=BusySnapshot)
    graph_steps: int = 0  # ModelRunner.num_graph_steps: decode-only steps replayed from a CUDA graph
    eager_steps: int = 0  # ModelRunner.num_eager_steps
    # Tensor parallelism only: rank 0's seconds per step in collectives vs the rest of the forward.
    allreduce_s: tuple[BucketCounts, ...] = (_EMPTY_DURATIONS,) * len(STEP_KINDS)
    compute_s: tuple[BucketCounts, ...] = (_EMPTY_DURATIONS,) * len(STEP_KINDS)

    def minus(self, earlier: StepSnapshot) -> StepSnapshot:
        """The counters since `earlier` (the busy window is a gauge and stays as it is)."""
        return StepSnapshot(
            tuple(a.minus(b) for a, b in zip(self.duration_s, earlier.duration_s, strict=True)),
            tuple(a.minus(b) for a, b in zip(self.tokens, earlier.tokens, strict=True)),
            self.busy_s_total - earlier.busy_s_total,
            self.busy,
            self.graph_steps - earlier.graph_steps,
            self.eager_steps - earlier.eager_steps,
            tuple(a.minus(b) for a, b in zip(self.allreduce_s, earlier.allreduce_s, strict=True)),
            tuple(a.minus(b) for a, b in zip(self.compute_s, earlier.compute_s, strict=True)),
        )


class StepStats:
    """Per-step metrics, recorded by the step loop from one host clock read at each end of a step."""

    def __init__(self, now: float) -> None:
        self._duration = {kind: _Buckets(LATENCY_BUCKETS_S) for kind in STEP_KINDS}
        self._tokens = {kind: _Buckets(TOKEN_BUCKETS) for kind in STEP_KINDS}
        self._busy = BusyWindow(now)
        self._busy_s_total = 0.0
        self._busy_until = now  # the latest end recorded: busy time counts each moment once
        self._allreduce = {kind: _Buckets(LATENCY_BUCKETS_S) for kind in STEP_KINDS}
        self._compute = {kind: _Buckets(LATENCY_BUCKETS_S) for kind in STEP_KINDS}

    def record(self, kind: str, num_tokens: int, start: float, end: float) -> None:
        """A step that ran from start to end. A prefill-lane chunk overlaps the decode steps beside it
        (recorded before it): busy time is the part after the latest end recorded, so a moment with
        both running counts once."""
        self._duration[kind].observe(end - start)
        self._tokens[kind].observe(num_tokens)
        start = max(start, self._busy_until)
        if end > start:
            self._busy_s_total += end - start
            self._busy.add(start, end)
            self._busy_until = end

    def record_tensor_parallel(self, kind: str, allreduce_s: float, compute_s: float) -> None:
        """A tensor-parallel step's forward split into time in collectives and the rest (rank 0)."""
        self._allreduce[kind].observe(allreduce_s)
        self._compute[kind].observe(compute_s)

    def snapshot(self, graph_steps: int, eager_steps: int) -> StepSnapshot:
        return StepSnapshot(
            tuple(self._duration[k].snapshot() for k in STEP_KINDS),
            tuple(self._tokens[k].snapshot() for k in STEP_KINDS),
            self._busy_s_total,
            self._busy.snapshot(),
            graph_steps,
            eager_steps,
            tuple(self._allreduce[k].snapshot() for k in STEP_KINDS),
            tuple(self._compute[k].snapshot() for k in STEP_KINDS),
        )


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
    steps: StepSnapshot = field(default_factory=StepSnapshot)  # filled in by LLMEngine.stats()
    # Lookups that found a block's key holding other tokens (a key collision): never reused.
    prefix_cache_collisions: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class Ewma:
    """An exponentially weighted mean of recent values (None until the first)."""

    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self.mean: float | None = None

    def record(self, value: float) -> None:
        self.mean = value if self.mean is None else self.mean + self.alpha * (value - self.mean)


class StepTimer:
    """Predicts step times from recent steps: decode-only step seconds and prefill seconds per token,
    the latter split into a price per prompt token and one per query-key pair (see `record`)."""

    PREFILL_HEAVY_TOKENS = 32  # a step with at least this many prompt tokens prices a prompt token
    PAIR_FORGET = 0.05  # the pair fit's weight of a step decays by this per later prompt step (~20 steps)
    SIZE_SPREAD = 0.1  # the least spread of prompt tokens a step (std / mean) that fits the fixed cost

    def __init__(self, alpha: float = 0.2, budget_tokens: int = 256) -> None:
        self.alpha = alpha
        self.budget_tokens = budget_tokens
        self.steps = 0
        self.last_step_s = 0.0
        self._decode_step_s: float | None = None
        self._per_token_s: float | None = None
        self._any_step_s: float | None = None  # every step, whatever its mix
        # Exponentially weighted sums of the least-squares fit own = c + a x tokens + b x pairs, on
        # x = (1, kilotokens, megapairs): the upper triangle of x x^T, then x own.
        self._xx = [0.0] * 6
        self._xy = [0.0] * 3
        self._context: float | None = None  # recent pairs per prompt token (the mean context attended)
        # (c, a, b) once the fit is determined: seconds a step carrying prompt tokens costs beyond a
        # decode step whatever its size, then per prompt token and per query-key pair.
        self._pair_price: tuple[float, float, float] | None = None
        # Idle seconds between one chunk's end and the next one's start while prompt work waited
        # (the prefill lane: its next chunk starts with the step after the one it ended in).
        self._gap_s: float | None = None

    def record(self, plan: Any, seconds: float) -> None:
        prompt = int(plan.num_prefill_tokens)
        if prompt == 0:
            self._decode_step_s = self._ewma(self._decode_step_s, seconds)
        if prompt >= self.PREFILL_HEAVY_TOKENS:
            # The price of a prompt token beyond the step's own cost (weights read once, the decode
            # rows): the model every estimate uses, a step = decode step + prompt tokens x price.
            # Dividing the whole step by every token charged the decodes twice. Floor: a quarter of
            # the step, for when the decode step time is stale (measured in a steal spike).
            own = max(seconds - (self._decode_step_s or 0.0), 0.25 * seconds)
            self._per_token_s = self._ewma(self._per_token_s, own / prompt)
            pairs = getattr(plan, "prompt_pairs", None)
            if pairs is not None:
                self._fit_pairs(prompt, int(pairs), own)
        self._any_step_s = self._ewma(self._any_step_s, seconds)
        self.steps += 1
        self.last_step_s = seconds

    def record_gap(self, seconds: float) -> None:
        """Idle time before a chunk that started as soon as the engine could hand it over (the lane
        waits for the decode step it ended beside): priced once per step by `estimate_s`."""
        self._gap_s = self._ewma(self._gap_s, seconds)

    def gap_s(self) -> float:
        return self._gap_s or 0.0

    def _fit_pairs(self, tokens: int, pairs: int, own: float) -> None:
        """A prompt token's price grows with the context it attends to (prompt attention reads
        every earlier position), and a step that carries prompt tokens costs more than a decode
        step before its first token (the prompt rows' weights read and packed once a step): fit
        what a step took beyond its decode step as c + a x tokens + b x pairs (`prompt_pairs`),
        least squares over recent prompt steps. A single price per token priced a 2,000-token
        prompt's late chunks like its first ones (issue 40); a fit without c priced a prompt in
        64-token chunks beside decodes like one 256-token step, where on the Zen 3 kind each chunk
        paid ~60 ms more (docs/notes/tail-under-slo.md, "A prompt step's own fixed cost"). Until
        steps of different sizes have been seen, or where c would be negative, it fits a and b
        alone; until different contexts have been seen, or where either would be negative, it
        keeps the single price."""
        keep = 1.0 - self.PAIR_FORGET
        x = (1.0, tokens / 1e3, pairs / 1e6)
        products = (x[0] * x[0], x[0] * x[1], x[0] * x[2], x[1] * x[1], x[1] * x[2], x[2] * x[2])
        self._xx = [keep * s + v for s, v in zip(self._xx, products, strict=True)]
        self._xy = [keep * s + xi * own for s, xi in zip(self._xy, x, strict=True)]
        self._context = self._ewma(self._context, pairs / tokens)
        n, st, _, tt, tp, pp = self._xx
        # c only where step sizes differ enough to tell it from the per-token price (a spread of
        # 255- and 256-token steps determines it on paper and extrapolates it anywhere).
        spread = n * tt - st * st >= (self.SIZE_SPREAD * st) ** 2
        full = _solve3(tuple(self._xx), (self._xy[0], self._xy[1], self._xy[2])) if spread else None
        if full is not None and min(full) >= 0 and full[1] > 0:
            self._pair_price = (full[0], full[1] / 1e3, full[2] / 1e6)
            return
        _, ty, py = self._xy
        det = tt * pp - tp * tp
        if det <= 1e-6 * tt * pp:  # every step had the same context per token: b is not determined
            return
        a, b = (ty * pp - py * tp) / det, (py * tt - ty * tp) / det
        if a > 0 and b >= 0:
            self._pair_price = (0.0, a / 1e3, b / 1e6)

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def coefficients(self) -> tuple[float, float]:
        """(seconds of a decode-only step, seconds per prompt token at the context prompts attend to
        now); zeros until measured."""
        if self._pair_price is not None and self._context is not None:
            _, a, b = self._pair_price
            return self._decode_step_s or 0.0, a + b * self._context
        return self._decode_step_s or 0.0, self._per_token_s or 0.0

    def prompt_step_s(self) -> float:
        """Seconds a step that carries prompt tokens costs beyond a decode step before its first
        prompt token (the fit's c; 0 until determined): with `coefficients`, a step of n prompt
        tokens costs decode step + this + n x the price per token."""
        return self._pair_price[0] if self._pair_price is not None else 0.0

    def recent_step_s(self) -> float:
        """Seconds of a step as steps run now, prompt chunks and all: what a running stream waits per
        token. Under load most steps carry prefill, and a decode-only step is the exception."""
        return max(self._any_step_s or 0.0, self._decode_step_s or 0.0)

    def estimate_s(
        self,
        tokens: int,
        running: int,
        per_step_tokens: int | None = None,
        pairs: int | None = None,
        full_last_step: bool = False,
    ) -> float:
        """Seconds to push `tokens` prompt tokens through steps that also carry `running` decodes:
        each step costs a decode step (its fixed part) plus its prompt tokens at their price.
        `per_step_tokens`: prompt tokens a step (default the budget), at most the budget less the
        decode rows while any run; with none running it may exceed the budget (a step with no decode
        may be longer: Scheduler.idle_budget). The price per token and per pair does not depend on
        the step's size, so fewer, longer steps save only their fixed parts. `pairs`: the tokens'
        query-key pairs (`prompt_pairs`), the same however the prompt is chunked, priced by the pair
        fit once it is determined; None prices them at the context prompts attend to now. Each step
        also waits the idle gap recorded before chunks (`record_gap`; 0 for the engine's steps) and
        pays the fixed cost of a step with prompt tokens (`prompt_step_s`), so thin chunks cost more
        than one long step. `full_last_step`: the last step is priced full as well, since the
        planner fills the room it leaves with the prompts behind (those admitted meanwhile too)."""
        step_s, per_token = self.coefficients()
        step_s += self.gap_s() + self.prompt_step_s()
        per_step = per_step_tokens or self.budget_tokens
        if running:
            per_step = min(per_step, self.budget_tokens - running)
        per_step = max(per_step, 1)
        steps = math.ceil(tokens / per_step) if tokens > 0 else 0
        fill = steps * per_step - tokens if full_last_step else 0  # tokens of others in its last step
        if pairs is not None and self._pair_price is not None:
            _, a, b = self._pair_price
            return steps * step_s + (tokens + fill) * a + pairs * b
        return steps * step_s + (tokens + fill) * per_token


def prompt_pairs(tokens: int, start: int) -> int:
    """Query-key pairs of `tokens` prompt tokens after `start` tokens of context, causal: the sum of
    (position + 1) over them, what prompt attention's work grows with."""
    return tokens * start + tokens * (tokens + 1) // 2


class DecodeFit:
    """Least squares of decode-only step seconds on (1, rows, context tokens), recent steps weighted
    most: a decode step reads the weights once (the fixed part), then each row's own work and the
    KV of every context token its row attends (the part that grows as streams lengthen). In process
    on the chat-scaled arrivals (2-vCPU Sapphire Rapids, int4, 1-9 rows, 0.6-11k context tokens;
    benchmarks/step_cost_error.py --rate 0.8 --requests 60), each step predicted before it is
    learned: median error 3.1% beside the lane, 4.4% on both threads (P90 8% and 14%), where the
    decode-step average of StepTimer is off by 4.9% (P90 22%). Until steps of varied rows and
    contexts determine it, the fit drops the rows term, then the context term."""

    FORGET = 0.01  # a step's weight decays by this per later step (~100 steps)

    def __init__(self) -> None:
        # Exponentially weighted sums of x x^T (upper triangle) and x y, x = (1, rows, kilotokens).
        self._xx = [0.0] * 6
        self._xy = [0.0] * 3
        self._coef: tuple[float, float, float] | None = None

    def record(self, rows: int, context: int, seconds: float) -> None:
        keep = 1.0 - self.FORGET
        x = (1.0, float(rows), context / 1000.0)
        products = (x[0] * x[0], x[0] * x[1], x[0] * x[2], x[1] * x[1], x[1] * x[2], x[2] * x[2])
        self._xx = [keep * s + p for s, p in zip(self._xx, products, strict=True)]
        self._xy = [keep * s + xi * seconds for s, xi in zip(self._xy, x, strict=True)]
        self._coef = self._solve()

    def _solve(self) -> tuple[float, float, float] | None:
        n, sr, sc, rr, rc, cc = self._xx
        y0, yr, yc = self._xy
        if n <= 0:
            return None
        full = _solve3((n, sr, sc, rr, rc, cc), (y0, yr, yc))
        if full is not None and full[1] >= 0 and full[2] >= 0:
            return full
        det = n * cc - sc * sc  # without rows: (1, context)
        if det > 1e-9 * n * cc:
            a, c = (y0 * cc - yc * sc) / det, (n * yc - sc * y0) / det
            if a >= 0 and c >= 0:
                return a, 0.0, c
        return y0 / n, 0.0, 0.0

    def estimate_s(self, rows: int, context: int) -> float | None:
        """Predicted seconds of a decode step of `rows` streams attending `context` tokens in all;
        None until a step was recorded."""
        if self._coef is None:
            return None
        a, b, c = self._coef
        return a + b * rows + c * context / 1000.0


def _solve3(xx: tuple[float, ...], xy: tuple[float, float, float]) -> tuple[float, float, float] | None:
    """The normal equations of a 3-term least squares (xx: the symmetric matrix's upper triangle,
    row by row), by Cramer's rule; None where the steps do not determine all three terms."""
    a, b, c, d, e, f = xx  # [[a b c] [b d e] [c e f]]
    det = a * (d * f - e * e) - b * (b * f - c * e) + c * (b * e - c * d)
    if det <= 1e-9 * a * d * f:
        return None
    y0, y1, y2 = xy
    x0 = (y0 * (d * f - e * e) - b * (y1 * f - e * y2) + c * (y1 * e - d * y2)) / det
    x1 = (a * (y1 * f - e * y2) - y0 * (b * f - c * e) + c * (b * y2 - y1 * c)) / det
    x2 = (a * (d * y2 - y1 * e) - b * (b * y2 - y1 * c) + y0 * (b * e - c * d)) / det
    return x0, x1, x2


class DecodeTimer:
    """Decode-only steps' price by rows and context, fitted apart for the two ways they run: on all
    the engine's threads, and beside the prefill lane's chunk (on the threads it leaves: 14.5 ms +
    1.0 ms a row + 2.7 ms per thousand context tokens on one of two threads, 10.5 + 0.1 + 1.5 on
    both, measured as in DecodeFit). What the TPOT a stream will see is priced by (engine/
    tpot_model.py)."""

    def __init__(self) -> None:
        self.all_threads = DecodeFit()
        self.beside_lane = DecodeFit()

    def record(self, rows: int, context: int, seconds: float, beside_lane: bool) -> None:
        (self.beside_lane if beside_lane else self.all_threads).record(rows, context, seconds)

    def estimate_s(self, rows: int, context: int, beside_lane: bool) -> float | None:
        """A decode step's seconds; beside the lane, all threads' price until the lane's is known
        (then an underestimate), None until either is."""
        fit = self.beside_lane if beside_lane else self.all_threads
        own = fit.estimate_s(rows, context)
        return own if own is not None else self.all_threads.estimate_s(rows, context)
