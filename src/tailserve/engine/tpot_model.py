"""The TPOT price of a newcomer: how the time per output token of every stream would go with it and
without it, for admission control (issue 40: admission that keeps its TPOT promise too).

A stream's TPOT is its output's length in time over its gaps. What stretches the gaps still to come
is the decode step: it grows with the rows and the context they attend, and while prompt work runs
(on the prefill lane, which takes half the threads; or in the steps themselves, without a lane) it
is slower. So the price plays the future forward, event by event: the known prompts run in the
planner's order, each turning into a stream when its prefill ends; every step costs what the
caller's `StepPrice` says for the rows and context of that moment (`WaitModel.tpot_price`: the
`DecodeTimer`'s, with the prompts still to arrive as a rate outside the known prompts' runs);
streams end after their expected gaps. It only reads a `QueueSnapshot`.

Where letting the newcomer's prompt start at once would push a stream over its target, the price
looks for a hold: the newcomer waits in the queue until a stream ends, if its first token can still
come within its TTFT target (`price`'s `ttft_budget_s`). A prompt held so runs no sooner than its
`start_at`; prompts behind it in the order go first meanwhile, as the planner lets them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Stream:
    """A request as the TPOT price sees it: one decoding now, or one whose prompt is still to run."""

    tpot_s: float  # its TPOT target
    gaps_left: int  # output gaps (decode steps) it is expected to take still
    context: int  # tokens its row attends now (for one still in prefill: once its prompt is done)
    gaps_done: int = 0  # gaps it has streamed
    first_token: float | None = None  # when its first token came; None: still in prefill
    start_at: float = 0.0  # a prompt held by admission starts no sooner (the engine's clock)


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
    hold_s: float = 0.0  # how long the newcomer's prompt is to wait in the queue before it may start
    own_first_s: float = 0.0  # when its first token is predicted, from now (queue, hold and prefill)

    def harmed(self) -> list[StreamTpot]:
        """The streams predicted within their target without the newcomer that would miss it with it
        (one predicted to miss anyway is not saved by refusing)."""
        return [o for o in self.others if o.with_s > o.target_s >= o.without_s]

    def own_misses(self) -> bool:
        """Whether the newcomer's own TPOT would miss its target while alone it would not (one that
        misses even alone gains nothing from a refusal)."""
        return self.own_s > self.own_target_s >= self.own_alone_s

    def keeps_promises(self) -> bool:
        """Whether admitting the newcomer (held for `hold_s`) pushes no stream over its target."""
        return not self.harmed() and not self.own_misses()


def prompt_runs(prompts: Sequence[tuple[float, Stream]], now: float) -> list[tuple[float, float]]:
    """When each prompt's prefill starts and ends (its first token), one prompt at a time: the first
    in order whose `start_at` has come, else the one held the shortest, waited for."""
    runs = [(now, now)] * len(prompts)
    left = list(range(len(prompts)))
    t = now
    while left:
        j = next((j for j in left if prompts[j][1].start_at <= t), None)
        if j is None:
            j = min(left, key=lambda i: prompts[i][1].start_at)
        start = max(t, prompts[j][1].start_at)
        t = start + prompts[j][0]
        runs[j] = (start, t)
        left.remove(j)
    return runs


def finish_times(
    streams: Sequence[Stream], prompts: Sequence[tuple[float, Stream]], now: float, step_s: StepPrice
) -> tuple[list[float], list[float]]:
    """When each stream and each prompt's stream is predicted to take its last gap, and when each
    prompt's first token comes. `prompts`: (seconds of its prefill, its stream) in the order the
    prompts run (`prompt_runs`); while one runs, steps are priced as beside prompt work. A stream
    with no gap left ends now (or when its first token comes)."""
    runs = prompt_runs(prompts, now)
    firsts = [end for _, end in runs]
    ends = [now] * len(streams) + firsts
    joining = sorted(range(len(prompts)), key=firsts.__getitem__)  # streams to come, by first token
    bounds = sorted({b for run in runs for b in run})  # where the steps' price may change
    # active: [index in ends, gaps left, context]
    active = [[i, s.gaps_left, s.context] for i, s in enumerate(streams) if s.gaps_left > 0]
    t, joined = now, 0

    def join(upto: float) -> int:
        n = joined
        while n < len(joining) and firsts[joining[n]] <= upto:
            stream = prompts[joining[n]][1]
            if stream.gaps_left > 0:
                active.append([len(streams) + joining[n], stream.gaps_left, stream.context])
            n += 1
        return n

    while active or joined < len(joining):
        if not active:
            t = max(t, firsts[joining[joined]])
            joined = join(t)
            continue
        busy = any(start <= t < end for start, end in runs)
        bound = next((b for b in bounds if b > t), math.inf)
        rows, context = len(active), sum(a[2] for a in active)
        k = min(a[1] for a in active)
        step = step_s(rows, context + rows * k // 2, busy)  # at the mean context over the k steps
        if t + k * step > bound:  # up to the step in which prompt work starts or ends
            k = max(1, math.ceil((bound - t) / step))
        t += k * step
        for a in active:
            a[1] -= k
            a[2] += k
            if a[1] <= 0:
                ends[a[0]] = t
        active = [a for a in active if a[1] > 0]
        joined = join(t)
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
    ttft_budget_s: float | None = None,
) -> TpotPrice:
    """The newcomer's TPOT price. `prompts`: the queued prompts in the order they run, with their
    prefill seconds; `newcomer`: (its place in that order, its prefill seconds, its stream).
    `ttft_budget_s`: where admitting it at once pushes a stream over its target, the price of the
    shortest hold until a stream ends (at most MAX_HOLDS tried) that pushes none over and still
    gives its first token within this many seconds; None, or no such hold: the price at once."""
    without_ends, without_firsts = finish_times(streams, prompts, now, step_s)
    place, own_prefill_s, own = newcomer
    alone_ends, alone_firsts = finish_times([], [(own_prefill_s, own)], now, step_s)
    own_alone_s = tpot_of(own, alone_firsts[0], alone_ends[0])
    first_end = min((without_ends[i] for i, s in enumerate(streams) if s.gaps_left > 0), default=now)

    def held(hold_s: float) -> TpotPrice:
        """The newcomer's price with its prompt held `hold_s` seconds."""
        mine = replace(own, start_at=now + hold_s) if hold_s > 0 else own
        with_prompts = [*prompts[:place], (own_prefill_s, mine), *prompts[place:]]
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
        own_s = tpot_of(mine, with_firsts[place], with_ends[n + place])
        first_end_s = first_end - now
        return TpotPrice(
            own_s, own_alone_s, mine.tpot_s, tuple(others), first_end_s, hold_s, with_firsts[place] - now
        )

    at_once = held(0.0)
    if ttft_budget_s is None or at_once.keeps_promises():
        return at_once
    for end in sorted({e for e in without_ends if e > now})[:MAX_HOLDS]:
        p = held(end - now)
        if p.own_first_s > ttft_budget_s:
            break  # later holds give later first tokens
        if p.keeps_promises():
            return p
    return at_once


MAX_HOLDS = 8  # stream ends a newcomer's hold may run to: the price plays the future once per try
