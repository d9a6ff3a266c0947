"""benchmarks/tail_bound.py: the real scheduler in virtual time on a step-cost model. Single requests
cost exactly what the model says, the policies differ the way the engine's do, the fit recovers the
model, and the virtual clock stays inside the simulation."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import tail_bound  # noqa: E402
from tail_bound import StepCost, simulate  # noqa: E402

from tailserve.config import SchedulerConfig  # noqa: E402
from tailserve.engine.policy import PrefillItem, PrefillRank, SloPolicy  # noqa: E402

COST = StepCost(fixed=0.006, per_row=0.001, prompt_fixed=0.010, per_token=0.001)


def config(**kw: object) -> SchedulerConfig:
    base = {"policy": "slo", "max_num_batched_tokens": 256, "max_num_seqs": 16, "slo_ttft_s": 1.0,
            "slo_tpot_s": 0.1}  # fmt: skip
    return SchedulerConfig(**(base | kw))  # type: ignore[arg-type]


def test_a_lone_request_costs_exactly_its_steps() -> None:
    """100 prompt tokens in one step, then one decode row a step; 300 tokens take two chunks of the
    256-token budget without the longer idle step, one step with it (the server's default)."""
    one = simulate([(5.0, 100, 5)], config(), COST)[0]
    assert one.ttft == pytest.approx(0.006 + 0.010 + 0.100)
    assert one.tpot == pytest.approx(0.006 + 0.001)
    two = simulate([(0.0, 300, 2)], config(prefill_step_tokens=0), COST)[0]
    assert two.ttft == pytest.approx(2 * (0.006 + 0.010) + 0.300)
    idle = simulate([(0.0, 300, 2)], config(), COST)[0]
    assert idle.ttft == pytest.approx(0.006 + 0.010 + 0.300)


def test_only_the_first_prompt_in_line_takes_the_idle_step() -> None:
    """Two 600-token prompts at once on an idle engine: the first goes in one step of 600 tokens (up
    to --prefill-step-tokens), the second then in 256-token steps beside the first one's decodes,
    as the scheduler plans them in the server."""
    loose = {"slo_ttft_s": 5.0, "slo_tpot_s": 1.0}  # no target caps a chunk here
    arrivals = [(0.0, 600, 8), (0.0, 600, 8)]
    first, second = simulate(arrivals, config(prefill_step_tokens=1024, **loose), COST)
    assert first.ttft == pytest.approx(0.006 + 0.010 + 0.600)
    # Three chunks (256, 256, 88), each beside the first request's decode row.
    chunks = 3 * (0.006 + 0.001 + 0.010) + 0.600
    assert second.ttft == pytest.approx(first.ttft + chunks)
    # Without it: 256, 256, then the last 88 beside the second prompt's first 168.
    off = simulate(arrivals, config(prefill_step_tokens=0, **loose), COST)
    assert off[0].ttft == pytest.approx(3 * (0.006 + 0.010) + 0.768)


def test_a_tight_tpot_plan_spreads_a_long_prompt_over_a_stream_and_fcfs_does_not() -> None:
    """A 32-token stream is decoding when a 1000-token prompt arrives. fcfs prefills it in 256-token
    steps (0.26 s each), so the stream's mean gap is several times a decode step. `slo` planning to
    a 20 ms TPOT caps each step's prompt tokens near its floor, so the stream keeps short gaps and
    the long prompt's first token comes later. (No prompt-step fixed cost here: with one, the
    floor's small steps cost more, the trade-off the sweeps measure.)"""
    cost = dataclasses.replace(COST, prompt_fixed=0.0)
    arrivals = [(0.0, 20, 32), (0.05, 1000, 2)]
    fcfs = simulate(arrivals, config(policy="fcfs"), cost)
    slo = simulate(arrivals, config(slo_tpot_s=0.02, prefill_floor=0.05), cost)
    assert fcfs[0].tpot > 4 * (0.006 + 0.001)
    assert slo[0].tpot < 0.8 * fcfs[0].tpot
    assert slo[1].ttft > fcfs[1].ttft


def test_the_fit_recovers_the_step_cost_it_was_drawn_from() -> None:
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(400):
        rows = int(rng.integers(0, 16))
        tokens = int(rng.integers(0, 256)) if rng.random() < 0.3 else 0
        steps.append((rows, tokens, COST(rows, tokens) + rng.normal(0, 1e-5)))
    fitted = StepCost.fit(steps)
    for field in dataclasses.fields(StepCost):
        assert getattr(fitted, field.name) == pytest.approx(getattr(COST, field.name), rel=0.05, abs=2e-4)


def test_the_policy_plans_on_the_virtual_clock() -> None:
    """A request arriving 10^7 s into the simulation: every `now` its prompt is ranked at lies within
    its simulated life, so deadlines are computed on the virtual clock the simulation hands
    `step_plan`, not on the machine's."""
    seen: list[float] = []
    rank = SloPolicy.rank

    def spy(self: SloPolicy, item: PrefillItem, now: float) -> PrefillRank:
        seen.append(now)
        return rank(self, item, now)

    with mock.patch.object(SloPolicy, "rank", spy):
        served = simulate([(1e7, 10, 3)], config(), COST)
    assert served[0].ttft == pytest.approx(0.006 + 0.010 + 0.010)
    assert seen and all(1e7 <= t <= 1e7 + 0.1 for t in seen)


def test_the_sweep_table_is_written(tmp_path: Path) -> None:
    out = tmp_path / "bound-3.22"  # a dot in the name: the files go beside it, not over its suffix
    assert tail_bound.main(["--sweep", "policy", "--requests", "200", "--draws", "1", "--out", str(out)]) == 0
    assert (tmp_path / "bound-3.22.json").exists()
    text = (tmp_path / "bound-3.22.md").read_text()
    assert "| slo |" in text and "| fcfs |" in text
    assert "TPOT P99/mean" in text


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        tail_bound.main(["--rate", "0"])
    with pytest.raises(SystemExit):
        tail_bound.main(["--validate", str(tmp_path / "missing.jsonl")])
    bad = tmp_path / "costs.json"
    bad.write_text('{"no_steps": []}')
    with pytest.raises(SystemExit):
        tail_bound.main(["--costs", str(bad)])
    assert list(tmp_path.iterdir()) == [bad]  # nothing written


def test_capacity_rises_with_a_faster_prefill_and_a_probe_fails_past_it() -> None:
    """The bisection finds a rate the SLO holds at and a faster prefill raises it; a probe (the
    compare harness's rule) passes well below that rate and fails well above it."""
    variant = ("ts", config(slo_ttft_s=1.06), StepCost())
    faster = ("ts fast", config(slo_ttft_s=1.06), StepCost().faster_prefill(2))
    cap = tail_bound.capacity(variant, draws=1, requests=400, hi=40.0)
    assert 1.0 < cap < tail_bound.capacity(faster, draws=1, requests=400, hi=40.0)
    assert tail_bound.probe_passes(variant, cap / 3, seed=1)
    assert not tail_bound.probe_passes(variant, cap * 3, seed=1)


def test_the_probes_sweep_runs_probes_of_the_size_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[int] = []

    def probe(variant: object, rate: float, seed: int, requests: int = tail_bound.PROBE_REQUESTS) -> bool:
        sizes.append(requests)
        return rate < 4

    monkeypatch.setattr(tail_bound, "probe_passes", probe)
    argv = ["--sweep", "probes", "--probe-requests", "150", "--probe-draws", "2", "--probe-from", "3",
            "--probe-to", "5", "--out", str(tmp_path / "p")]  # fmt: skip
    assert tail_bound.main(argv) == 0
    assert sizes and set(sizes) == {150}
    rows = [
        line for line in (tmp_path / "p.md").read_text().splitlines() if line.startswith("| tailserve (slo)")
    ]
    assert rows == ["| tailserve (slo) | 100% | 100% | 0% | 0% | 0% |"]


def test_a_served_run_gives_its_warmup_and_measured_requests_in_time_order(tmp_path: Path) -> None:
    """--validate replays what the bench sent: warm-up and measured requests (not cool-down, not one
    never sent), by send time; a request that produced nothing counts as one output token, and a
    last line cut short by a killed bench is skipped."""
    rows = [
        {"phase": "measured", "scheduled_s": 2.0, "input_tokens": 40, "output_tokens": 16},
        {"phase": "warmup", "scheduled_s": 0.5, "input_tokens": 300, "output_tokens": 0},
        {"phase": "cooldown", "scheduled_s": 9.0, "input_tokens": 64, "output_tokens": 32},
        {"phase": "measured", "scheduled_s": 3.0, "input_tokens": None, "output_tokens": 5},
    ]
    run = tmp_path / "probe-01.jsonl"
    run.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"phase": "meas')
    assert tail_bound.served_arrivals(run) == [(0.5, 300, 1), (2.0, 40, 16)]


def test_the_step_log_holds_every_prompt_token_and_decode_row_once() -> None:
    """--measure-costs on a tiny model: the warm-up request is not logged; every prompt token of the
    arrivals is in some step's prompt tokens, and a request of N output tokens adds N - 1 decode rows
    (its first token comes with its last prompt chunk). A step carries at most the step budget, but
    for one with no decode row, where the first prompt in line may go whole (--prefill-step-tokens)."""
    arrivals = [(0.0, 100, 5), (0.0, 20, 3), (0.01, 70, 1)]
    steps = tail_bound.measure_steps(
        arrivals, config(max_num_batched_tokens=64), threads=1, model="dummy:tiny"
    )
    assert sum(tokens for _, tokens, _ in steps) == 100 + 20 + 70
    assert sum(rows for rows, _, _ in steps) == (5 - 1) + (3 - 1) + (1 - 1)
    assert all((tokens <= 64 or rows == 0) and seconds > 0 for rows, tokens, seconds in steps)
