"""The TPOT price of a newcomer: how the time per output token of every stream would go with it and
without it, for admission control (issue 40: admission that keeps its TPOT promise too).

A stream's TPOT is its output's length in time over its gaps. What stretches the gaps still to come
is the decode step: it grows with the rows and the context they attend, and while prompt work runs
(on the prefill lane, which takes half the threads; or in the steps themselves, without a lane) it
is slower. So the price plays the future forward, event by event, with no arrival after the
newcomer: the prompts run in the planner's order, each turning into a stream when its prefill ends;
every step costs what `DecodeTimer` says for the rows and context of that moment; streams end after
their expected gaps. It only reads a `QueueSnapshot`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Stream:
    """A request as the TPOT price sees it: one decoding now, or one whose prompt is still to run."""

    tpot_s: float  # its TPOT target
    gaps_left: int  # output gaps (decode steps) it is expected to take still
    context: int  # tokens its row attends now (for one still in prefill: once its prompt is done)
    gaps_done: int = 0  # gaps it has streamed
    first_token: float | None = None  # when its first token came; None: still in prefill


# Seconds of one decode step of (rows, context tokens) with prompt work running (True) or not.
StepPrice = Callable[[int, int, bool], float]


@dataclass(frozen=True)
class StreamTpot:
    """One stream's predicted TPOT with and without the newcomer, and its target."""

    with_s: float
    without_s: float
    target_s: float


@dataclass(frozen=True)
class TpotPrice:
    """A newcomer's TPOT price: its own predicted TPOT (with everything admitted, and alone), each
    other stream's with and without it, and when the first stream running now is expected to end
    (what a refused client might wait for)."""

    own_s: float
    own_alone_s: float
    own_target_s: float
    others: tuple[StreamTpot, ...]
    first_end_s: float


def finish_times(
    streams: Sequence[Stream], prompts: Sequence[tuple[float, Stream]], now: float, step_s: StepPrice
) -> tuple[list[float], list[float]]:
    """When each stream and each prompt's stream is predicted to take its last gap, and when each
    prompt's first token comes. `prompts`: (seconds of its prefill, its stream) in the order the
    prompts run, one after the other; while any runs, steps are priced as beside prompt work.
    A stream with no gap left ends now (or when its first token comes)."""
    ends = [now] * (len(streams) + len(prompts))
    firsts: list[float] = []
    t = now
    for seconds, _ in prompts:
        t += seconds
        firsts.append(t)
    # active: [index in ends, gaps left, context]
    active = [[i, s.gaps_left, s.context] for i, s in enumerate(streams) if s.gaps_left > 0]
    t, started = now, 0

    def start_ready(upto: float) -> int:
        n = started
        while n < len(prompts) and firsts[n] <= upto:
            stream = prompts[n][1]
            ends[len(streams) + n] = firsts[n]
            if stream.gaps_left > 0:
                active.append([len(streams) + n, stream.gaps_left, stream.context])
            n += 1
        return n

    while active or started < len(prompts):
        if not active:
            t = max(t, firsts[started])
            started = start_ready(t)
            continue
        busy = started < len(prompts)
        rows, context = len(active), sum(a[2] for a in active)
        k = min(a[1] for a in active)
        step = step_s(rows, context + rows * k // 2, busy)  # at the mean context over the k steps
        if busy and t + k * step > firsts[started]:  # up to the step in which the next prompt ends
            k = max(1, math.ceil((firsts[started] - t) / step))
        t += k * step
        for a in active:
            a[1] -= k
            a[2] += k
            if a[1] <= 0:
                ends[a[0]] = t
        active = [a for a in active if a[1] > 0]
        started = start_ready(t)
    return ends, firsts


def tpot_of(stream: Stream, first_token: float, end: float) -> float:
    """Predicted TPOT of a stream whose first token came (or comes) at `first_token`, ending at `end`."""
    gaps = stream.gaps_done + stream.gaps_left
    return (end - first_token) / gaps if gaps > 0 else 0.0


def price(
    streams: Sequence[Stream],
    prompts: Sequence[tuple[float, Stream]],
    newcomer: tuple[int, float, Stream],
    now: float,
    step_s: StepPrice,
) -> TpotPrice:
    """The newcomer's TPOT price. `prompts`: the queued prompts in the order they run, with their
    prefill seconds; `newcomer`: (its place in that order, its prefill seconds, its stream)."""
    place, own_prefill_s, own = newcomer
    without_ends, without_firsts = finish_times(streams, prompts, now, step_s)
    with_prompts = [*prompts[:place], (own_prefill_s, own), *prompts[place:]]
    with_ends, with_firsts = finish_times(streams, with_prompts, now, step_s)
    others: list[StreamTpot] = []
    for i, s in enumerate(streams):
        first = s.first_token if s.first_token is not None else now
        others.append(
            StreamTpot(tpot_of(s, first, with_ends[i]), tpot_of(s, first, without_ends[i]), s.tpot_s)
        )
    n = len(streams)
    for j, (_, s) in enumerate(prompts):
        k = j if j < place else j + 1  # its index among the prompts with the newcomer
        w = tpot_of(s, with_firsts[k], with_ends[n + k])
        wo = tpot_of(s, without_firsts[j], without_ends[n + j])
        others.append(StreamTpot(w, wo, s.tpot_s))
    own_s = tpot_of(own, with_firsts[place], with_ends[n + place])
    alone_ends, alone_firsts = finish_times([], [(own_prefill_s, own)], now, step_s)
    own_alone_s = tpot_of(own, alone_firsts[0], alone_ends[0])
    first_end = min((without_ends[i] for i, s in enumerate(streams) if s.gaps_left > 0), default=now)
    return TpotPrice(own_s, own_alone_s, own.tpot_s, tuple(others), first_end - now)
