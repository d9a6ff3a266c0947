"""One random workload for the engine's stress tests (single rank and tensor parallel): requests over
shared prefixes arriving at random steps, some aborted mid-run, stepped until all have ended."""

from __future__ import annotations

import random

from tailserve.engine import LLMEngine, SamplingParams


def drive_random_workload(
    engine: LLMEngine,
    rng: random.Random,
    requests: int,
    last_arrival_step: int,
    max_tokens: int,
    abort_share: float,
    abort_every: tuple[int, int],
    prefix: str = "r",
    max_steps: int = 5000,
) -> dict[str, str]:
    """Run it; returns each request's finish reason ("abort" for an abort that found it running).

    `abort_every` (period, phase): one chosen request is aborted on steps where step % period == phase."""
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randrange(10, 60))] for _ in range(3)]
    pending = []
    for i in range(requests):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(
            max_tokens=rng.randrange(1, max_tokens), temperature=rng.choice([0.0, 1.0]), seed=i
        )
        pending.append((rng.randrange(0, last_arrival_step), f"{prefix}{i}", prompt, params))
    pending.sort(key=lambda p: p[0])
    aborted = [rid for _, rid, _, _ in pending if rng.random() < abort_share]
    finished: dict[str, str] = {}
    period, phase = abort_every
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        if step % period == phase and aborted:
            rid = aborted.pop()
            if engine.abort(rid) is not None:
                finished[rid] = "abort"
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason or ""
        step += 1
        assert step < max_steps, f"stalled: {engine.stats()}"
    return finished
