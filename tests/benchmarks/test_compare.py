"""benchmarks/compare's pure logic: percentile intervals, sizing, the capacity search, the rate points
a time budget allows, a run's analysis (fates, goodput, slowdown), verdicts from intervals, and the
checkpoints a rerun resumes from. No server is started.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from compare import plan, report, stats  # noqa: E402
from compare.analyze import Calibration, Slo, analyze, calibration_from, fate, passes, windows  # noqa: E402
from compare.run import Context, measure, run_point  # noqa: E402
from compare.store import Store  # noqa: E402

SLO = Slo(ttft_s=2.0, tpot_s=0.1)


def row(
    i: int, ttft: float | None = 0.5, tpot: float | None = 0.05, status: int = 200, **extra: Any
) -> dict[str, Any]:
    ok = status == 200 and extra.get("error_kind") is None
    return {
        "index": i, "phase": "measured", "ok": ok, "http_status": status, "error_kind": extra.get("error_kind"),
        "sent_s": extra.get("sent_s", float(i)), "done_s": extra.get("done_s", float(i) + 3.0),
        "ttft_s": ttft if ok else None, "tpot_s": tpot if ok else None, "e2e_s": 3.0 if ok else None,
        "input_tokens": extra.get("input_tokens", 100), "cached_tokens": 0,
    }  # fmt: skip


# ----- intervals ----------------------------------------------------------------------------------
def test_p99_needs_368_values_for_an_equal_tailed_upper_end() -> None:
    assert stats.min_count_bounded(0.99) == 368
    # Below that the bench's interval closes at the maximum (the weakest upper end there is).
    for n in (300, 367, 368):
        interval = stats.quantile_interval([float(v) for v in range(n)], 0.99)
        assert interval.high == n - 1.0 and interval.count == n


def test_p99_of_known_values() -> None:
    interval = stats.quantile_interval([float(v) for v in range(1, 1001)], 0.99)
    assert (interval.value, interval.low, interval.high) == (990.0, 983.0, 997.0)


def test_wilson_interval() -> None:
    interval = stats.wilson(8, 10)
    assert interval.value == 0.8
    assert interval.low == pytest.approx(0.490, abs=1e-3) and interval.high == pytest.approx(0.943, abs=1e-3)


def test_verdicts_from_intervals() -> None:
    inside, straddles, outside = (
        stats.Interval(1.0, 0.9, 1.2, 400),
        stats.Interval(1.4, 1.3, 1.7, 400),
        stats.Interval(2, 1.8, 2.2, 400),
    )
    assert [stats.at_most(i, 1.5) for i in (inside, straddles, outside)] == [
        stats.MET,
        stats.NOT_ENOUGH,
        stats.MISSED,
    ]
    open_above = stats.Interval(1.0, 0.9, None, 300)
    assert stats.at_most(open_above, 1.5) == stats.NOT_ENOUGH  # an open end never passes
    assert stats.at_least(outside, 1.5) == stats.MET and stats.at_least(inside, 1.5) == stats.MISSED
    overlapping = stats.Interval(1.1, 1.0, 1.35, 400)
    assert stats.compare(inside, outside) == "lower" and stats.compare(outside, inside) == "higher"
    assert stats.compare(overlapping, inside) == stats.NOT_ENOUGH


# ----- sizing and the search ----------------------------------------------------------------------
def test_full_sizes_meet_the_minimums_and_bound_the_p99() -> None:
    sizes = plan.full_sizes()
    assert sizes.point_requests >= 300 and sizes.probe_requests >= 200
    for n in (sizes.point_requests, sizes.probe_requests):
        assert n >= stats.min_count_bounded(0.99)
    assert plan.full_sizes(min_point=1000).point_requests == 1000
    # Duration follows from the rate: 388 requests at 0.5 req/s take 776 s of sending.
    assert plan.expected_s(388, 0.5) == 776.0


def test_capacity_search_ramps_then_bisects_then_stops() -> None:
    probes: list[tuple[float, bool]] = []
    truth = 1.3  # rates up to this pass

    def step() -> float | None:
        return plan.next_probe(probes, start=0.25, growth=2.0, tolerance=0.1, max_probes=10, rate_max=20)

    while (rate := step()) is not None:
        probes.append((rate, rate <= truth))
    assert [r for r, _ in probes][:4] == [0.25, 0.5, 1.0, 2.0]  # the ramp
    best, above = plan.capacity_bracket(probes)
    assert best <= truth < above and (above - best) / best <= 0.1


def test_capacity_search_steps_down_when_the_start_fails_and_gives_up() -> None:
    probes = [(1.0, False), (0.5, False), (0.25, False), (0.125, False)]
    assert plan.next_probe(probes[:1], 1.0, 2.0, 0.1, 10, 20) == 0.5
    assert plan.next_probe(probes, 1.0, 2.0, 0.1, 10, 20) is None
    assert plan.capacity_bracket(probes) == (0.0, 0.125)


def test_rate_start_starts_each_servers_search_where_it_is_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--rate-start 0.9,vllm=2` makes vLLM's first probe 2 req/s and every other server's 0.9;
    without it the search starts from the calibration (twice one stream's rate)."""
    from compare import run
    from compare.cli import parse_args, sizes_of

    rates: dict[str, list[float]] = {}

    def fake_bench(ctx: Any, spec: Any, url: str, workload: Any, name: str, args: list[str], slo: Any,
                   deadline_s: float | None = None, seed_name: str | None = None) -> Any:  # fmt: skip
        rate = float(args[args.index("--rate") + 1])
        rates.setdefault(spec.key, []).append(rate)
        rows = [row(i, ttft=0.5 if rate <= 1.3 else 3.0) for i in range(40)]
        return {"metrics": {}}, rows, {"wall_s": 1.0}

    class Spec:
        def __init__(self, key: str) -> None:
            self.key = key

    monkeypatch.setattr(run, "bench", fake_bench)
    cal_doc = {"intercept_s": 0.1, "per_token_s": 0.001, "idle_tpot_s": 0.05, "points": [],
               "idle_ttft_longest_s": 1.0}  # fmt: skip
    args = parse_args(["--quick", "--rate-start", "0.9,vllm=2", "--growth", "1.25", "--tolerance", "0.05"])
    sizes = dataclasses.replace(sizes_of(args), max_probes=10)
    assert (sizes.growth, sizes.tolerance) == (1.25, 0.05)
    for folder, chosen in (("given", sizes), ("default", plan.QUICK)):
        rates.clear()
        ctx = Context(Store(tmp_path / folder), chosen, 7, None, tmp_path, False)  # type: ignore[arg-type]
        for key in ("ts-slo", "vllm"):
            probes, _, _ = run.search(ctx, Spec(key), "", plan.LONGTAIL, SLO, cal_doc, 20.0, 0.0)  # type: ignore[arg-type]
            best, above = plan.capacity_bracket(probes)
            assert best <= 1.3 < (above or 0)
        if folder == "given":
            assert rates["ts-slo"][:2] == [0.9, 0.9 * 1.25] and rates["vllm"][:2] == [2.0, 2.0 / 1.25]
        else:
            prompt, output = plan.LONGTAIL.typical
            start = plan.search_start(0.1 + 0.001 * prompt + output * 0.05)
            assert rates["ts-slo"][0] == rates["vllm"][0] == start != 0.9


@pytest.mark.parametrize(
    "argv",
    [
        ["--rate-start", "0"],
        ["--rate-start", "vllm=fast"],
        ["--rate-start", "2,3"],
        ["--rate-start", "nan"],
        ["--rate-start", "3,vlm=2"],
        ["--growth", "1"],
        ["--tolerance", "0"],
        ["--soak-window", "200"],
        ["--soak-window", "4000"],
    ],  # fmt: skip
)
def test_bad_search_flags_are_refused_before_anything_runs(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from compare.cli import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("common", [True, False])
def test_common_probe_prompts_every_probe_sends_one_sequence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, common: bool
) -> None:
    """In a folder with common probe prompts every capacity probe of every server sends the same
    prompts (one bench seed); in an older folder each probe draws its own. A multi-turn workload
    (prefix cache on) always draws its own, or its next probe would find its prompts cached."""
    from compare import run

    seeds: dict[tuple[str, str], int] = {}

    def fake_bench(ctx: Any, spec: Any, url: str, workload: Any, name: str, args: list[str], slo: Any,
                   deadline_s: float | None = None, seed_name: str | None = None) -> Any:  # fmt: skip
        seeds[(spec.key, name)] = run.point_seed(ctx.seed, seed_name or name)
        rate = float(args[args.index("--rate") + 1])
        ttft = 0.5 if rate <= 1.3 else 3.0  # capacity 1.3 req/s under SLO's 2 s
        rows = [row(i, ttft=ttft) for i in range(40)]
        return {"metrics": {}}, rows, {"wall_s": 1.0}

    monkeypatch.setattr(run, "bench", fake_bench)
    ctx = Context(Store(tmp_path), plan.QUICK, 7, None, tmp_path, common)  # type: ignore[arg-type]
    cal_doc = {"intercept_s": 0.1, "per_token_s": 0.001, "idle_tpot_s": 0.05, "points": [],
               "idle_ttft_longest_s": 1.0}  # fmt: skip

    class Spec:
        def __init__(self, key: str) -> None:
            self.key = key

    for key in ("ts-slo", "vllm"):
        probes, _, note = run.search(ctx, Spec(key), "", plan.LONGTAIL, SLO, cal_doc, 20.0, 0.0)  # type: ignore[arg-type]
        assert len(probes) >= 2 and not note
    if common:
        assert len(set(seeds.values())) == 1  # every probe, both servers
        saved = ctx.store.points("vllm", "longtail", "probe-")
        assert {run.prompts_of(p) for p in saved} == {run.COMMON_PROBE_PROMPTS}  # a replay sends them too
    else:
        assert len(set(seeds.values())) == len({name for _, name in seeds})  # one per probe name
    seeds.clear()
    run.search(ctx, Spec("ts-slo"), "", plan.WORKLOADS["multiturn"], SLO, cal_doc, 20.0, 0.0)  # type: ignore[arg-type]
    assert len(set(seeds.values())) == len(seeds) >= 2


def test_slow_server_gets_fewer_points_never_fewer_requests() -> None:
    sizes = plan.Sizes(368, 368, 20, 3, budget_s=3600)
    fast, fast_dropped = plan.rate_points(4.0, 2.4, sizes, drain_s=5, spent_s=600)
    slow, slow_dropped = plan.rate_points(0.1, 3.2, sizes, drain_s=5, spent_s=600)
    assert [p.name for p in fast] == [
        "at-0.8x",
        "over-2x",
        "over-1.5x",
        "reference",
        "at-0.5x",
    ] and not fast_dropped
    # At 0.08 req/s one point takes ~80 min: it still runs (always the first), the rest are recorded as left out.
    assert [p.name for p in slow] == ["at-0.8x"]
    assert {p.name for p, _ in slow_dropped} == {"over-2x", "over-1.5x", "reference", "at-0.5x"}
    assert all(seconds > 0 for _, seconds in slow_dropped)
    same, _ = plan.rate_points(4.0, 3.2, sizes, 5, 0)  # the reference rate equal to 80%: run once
    assert len({p.rate for p in same}) == len(same)


# ----- one run's analysis -------------------------------------------------------------------------
def test_fates_of_requests() -> None:
    assert fate(row(0), SLO) == "met"
    assert fate(row(1, ttft=3.0), SLO) == "slow_miss"
    assert fate(row(2, tpot=0.2), SLO) == "slow_miss"
    assert fate(row(3, status=429, done_s=3.05), SLO) == "fast_429"
    assert fate(row(4, status=429, done_s=9.0), SLO) == "slow_miss"  # refused, but only after 5 s
    assert fate(row(5, status=0, error_kind="timeout"), SLO) == "slow_miss"
    assert fate(row(6, status=500, error_kind="server_error"), SLO) == "error"


def test_analysis_goodput_slowdown_and_probe_verdict() -> None:
    rows = [row(i, ttft=0.5 + 0.001 * i, input_tokens=100) for i in range(380)]
    rows += [row(380 + i, status=429, done_s=380.0 + i + 0.01) for i in range(20)]
    cal = Calibration(intercept_s=0.05, per_token_s=0.0025, idle_tpot_s=0.04)  # 100 tokens: 0.3 s idle
    figures = analyze(rows, {"throughput": {"duration_s": 400.0}}, SLO, cal)
    assert figures["fates"] == {"met": 380, "fast_429": 20, "slow_miss": 0, "error": 0}
    assert figures["goodput_per_s"]["value"] == pytest.approx(380 / 400)
    assert figures["goodput_per_s"]["low"] < 0.95 < figures["goodput_per_s"]["high"]
    slowdown = figures["metrics"]["slowdown"]["p99"]
    assert slowdown["value"] == pytest.approx((0.5 + 0.001 * 376) / 0.3)  # rank ceil(0.99 * 380) = 377
    assert figures["metrics"]["queue_delay_s"]["p50"]["value"] == pytest.approx(0.5 + 0.001 * 189 - 0.3)
    ok, reason = passes(figures, SLO)
    assert not ok and "error rate 5.0%" in reason  # 429s count as errors
    few = analyze(rows[:250], {"throughput": {"duration_s": 250.0}}, SLO, cal)
    ok, reason = passes(few, SLO)
    assert not ok and "unbounded" in reason  # under 299 requests nothing bounds a P99 from above
    ok, _ = passes(analyze(rows[:380], {"throughput": {"duration_s": 380.0}}, SLO, cal), SLO)
    assert ok


def test_calibration_line_and_windows() -> None:
    rows = [row(i, ttft=0.1 + 0.002 * n, input_tokens=n) for i, n in enumerate((64, 512, 1024, 1650))]
    cal = calibration_from(rows)
    assert cal.intercept_s == pytest.approx(0.1) and cal.per_token_s == pytest.approx(0.002)
    assert cal.isolated_ttft_s(1000) == pytest.approx(2.1)
    spread = [row(i, sent_s=i * 0.5) for i in range(40)]
    rows_by_window = windows(spread, 5.0)
    assert [w["sent"] for w in rows_by_window] == [10, 10, 10, 10]
    assert rows_by_window[0]["ttft_p99"]["high"] is None  # 10 requests: the P99 is open above


# ----- checkpoints and resume ---------------------------------------------------------------------
def test_store_saves_atomically_and_lists_points_in_order(tmp_path: Path) -> None:
    store = Store(tmp_path)
    for name in ("probe-02", "probe-01", "at-0.8x"):
        store.save({"name": name}, "ts-slo", "longtail", name)
    assert [p["name"] for p in store.points("ts-slo", "longtail", "probe-")] == ["probe-01", "probe-02"]
    assert store.has("ts-slo", "longtail", "at-0.8x") and not list(tmp_path.rglob("*.tmp"))
    store.log("hello")
    assert "hello" in (tmp_path / "progress.log").read_text()


def test_a_saved_point_is_not_run_again(tmp_path: Path) -> None:
    store = Store(tmp_path)
    saved = {"name": "at-0.8x", "rate": 1.0, "passed": True}
    store.save(saved, "ts-slo", "longtail", "at-0.8x")
    ctx = Context(store, plan.QUICK, 0, None, tmp_path)  # type: ignore[arg-type]

    class Spec:  # only its key is read on the resume path; a bench run would need much more
        key = "ts-slo"

    got = run_point(
        ctx, Spec(), "http://127.0.0.1:9", plan.LONGTAIL, SLO, Calibration(0, 0, 0), "at-0.8x", 1.0, 10, ""
    )  # type: ignore[arg-type]
    assert got == saved


def test_a_finished_server_is_not_started_again(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.save({"intercept_s": 0.1, "per_token_s": 0.001, "idle_tpot_s": 0.05, "points": [], "idle_ttft_longest_s": 1.7},
               "vllm", "longtail", "calibration")  # fmt: skip
    store.save({"capacity": 0.75, "complete": True}, "vllm", "longtail", "points")
    ctx = Context(store, plan.QUICK, 0, None, tmp_path)  # type: ignore[arg-type]
    assert measure(ctx, "vllm", plan.LONGTAIL, SLO, None, 20.0) == 0.75


def test_a_replay_can_name_a_rate_point_of_the_source(tmp_path: Path) -> None:
    """`--replay ts-slo:at-0.8x` sends that point's rate and prompts (a probe or any saved run)."""
    from compare.run import prompts_of, source_points

    store = Store(tmp_path)
    store.save(
        {"name": "probe-01", "rate": 3.2, "passed": False, "figures": {}}, "ts-slo", "longtail", "probe-01"
    )
    store.save(
        {"name": "at-0.8x", "rate": 2.2, "passed": True, "figures": {}}, "ts-slo", "longtail", "at-0.8x"
    )
    store.save({"capacity": 2.75, "complete": True}, "ts-slo", "longtail", "points")  # not a run: no rate
    assert [p["name"] for p in source_points(store, "ts-slo", "longtail", [])] == ["probe-01"]
    named = source_points(store, "ts-slo", "longtail", ["at-0.8x", "points", "missing"])
    assert [(p["name"], p["rate"]) for p in named] == [("at-0.8x", 2.2)]
    assert prompts_of(named[0]) == "at-0.8x"  # its own seed: the prompts it was measured on

    from compare.cli import compare_all, parse_args

    args = parse_args(["--replay", "ts-slo:at-0.8x,at-2x", "--servers", "vllm"])
    ctx = Context(store, plan.QUICK, 0, None, tmp_path)  # type: ignore[arg-type]
    with pytest.raises(SystemExit, match="no saved run at-2x"):  # refused before any server starts
        compare_all(ctx, ["vllm"], [plan.LONGTAIL], args)
    assert not store.has("vllm", "longtail", "calibration")


def test_a_replay_takes_the_source_probes_by_name_and_skips_the_saved(tmp_path: Path) -> None:
    from compare.run import replay

    store = Store(tmp_path)
    for i, rate in ((1, 3.2), (2, 1.6), (3, 0.8)):
        store.save(
            {"name": f"probe-0{i}", "rate": rate, "passed": False}, "ts-slo", "longtail", f"probe-0{i}"
        )
    store.save({"intercept_s": 0.1, "per_token_s": 0.001, "idle_tpot_s": 0.05, "points": []},
               "ts-fcfs", "longtail", "calibration")  # fmt: skip
    for name in ("probe-01", "probe-02"):  # already replayed: nothing is left, so no server starts
        store.save({"name": name}, "ts-fcfs", "longtail", f"replay-ts-slo-{name}")
    ctx = Context(store, plan.QUICK, 0, None, tmp_path)  # type: ignore[arg-type]
    replay(ctx, "ts-fcfs", plan.LONGTAIL, SLO, "ts-slo", ["probe-01", "probe-02"])
    assert "replay of ts-slo: nothing left" in (tmp_path / "progress.log").read_text()
    assert not store.has("ts-fcfs", "longtail", "replay-ts-slo-probe-03")


# ----- verdicts in the report ---------------------------------------------------------------------
def point(
    rate: float, queue: tuple[float, float, float], goodput: tuple[float, float, float], passed: bool = True
) -> dict[str, Any]:
    def iv(t: tuple[float, float, float]) -> dict[str, Any]:
        return {"value": t[0], "low": t[1], "high": t[2], "count": 400}

    metrics = {"queue_delay_s": {"p99": iv(queue)}, "tpot_s": {"p99_over_mean": iv((1.2, 1.1, 1.3))},
               "slowdown": {"p99_over_mean": iv((1.9, 1.7, 2.4))}}  # fmt: skip
    figures = {"metrics": metrics, "goodput_per_s": iv(goodput), "measured": 400, "ok": 400, "failed": 0,
               "fates": {"met": 300, "fast_429": 90, "slow_miss": 10, "error": 0}}  # fmt: skip
    run = {"bench_json": "runs/none.json", "wall_s": 1.0}  # no JSONL behind it: no CDF drawn
    return {"rate": rate, "passed": passed, "figures": figures, "fail_reason": "", "run": run}


def test_report_targets_from_intervals(tmp_path: Path) -> None:
    store = Store(tmp_path)
    for key, cap, above in (("ts-slo", 2.0, 2.2), ("ts-fcfs", 1.0, 1.2), ("llamacpp", 1.0, 1.1)):
        calibration = {"intercept_s": 0, "per_token_s": 0, "idle_tpot_s": 0, "points": [], "idle_ttft_longest_s": 1.0,
                       "server": {"ready_s": 5.0, "notes": "test", "command": "x"}}  # fmt: skip
        store.save(calibration, key, "longtail", "calibration")
        store.save(
            {"capacity": cap, "capacity_bracket": [cap, above], "complete": True}, key, "longtail", "points"
        )
        store.save(point(cap, (1, 1, 1), (cap, cap * 0.9, cap * 1.1)), key, "longtail", "probe-01")
    store.save(point(1.6, (0.5, 0.4, 0.6), (1.5, 1.4, 1.6)), "ts-slo", "longtail", "at-0.8x")
    store.save(point(1.6, (3.0, 2.0, 4.0), (1.0, 0.9, 1.1)), "ts-fcfs", "longtail", "reference")
    store.save(point(4.0, (9, 8, 10), (1.9, 1.8, 2.0)), "ts-slo", "longtail", "over-2x")
    lines = report.targets(store, "longtail")
    text = "\n".join(lines)
    # capacity 2.0 vs the best peer 1.0 (next failing 1.1): 2.0 / 1.1 = 1.82x >= 1.5 at worst.
    assert "capacity under the SLO" in lines[0] and "**MET**" in lines[0]
    assert "**MET**" in lines[1] and "TPOT" in lines[1]  # 1.3 <= 1.5
    assert "**not enough data**" in lines[2] and "slowdown" in lines[2]  # 1.7..2.4 straddles 2.0
    assert "**MET**" in lines[3] and "queue delay" in lines[3]  # 0.6 <= 0.5 x 2.0
    # goodput at 2x 1.8..2.0 vs at capacity 1.8..2.2: 1.8 >= 0.8 x 2.2 = 1.76.
    assert "**MET**" in lines[4] and "2x capacity" in lines[4]
    assert "llama.cpp" not in text.split("peers at their own 2x")[1]  # it has no 2x point: not shown
    store.save({"ttft_s": 5.0, "tpot_s": 0.1, "error_rate": 0.01, "basis": "test"}, "slo-longtail")
    rendered, _ = report.render(store)
    # The same offered load for every server: fcfs's P99 queue delay is apart from (above) slo's.
    assert "| tailserve (fcfs) | - | - | - | 3.00 [2.00, 4.00] (higher) |" in rendered


def test_soak_in_a_new_folder_freezes_the_given_slo_and_takes_the_window_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from compare import cli

    calls: list[tuple[str, Slo, float, float, float]] = []

    def fake_soak(
        ctx: Any, key: str, workload: Any, slo: Slo, rate: float, duration_s: float, window_s: float
    ) -> Any:
        calls.append((key, slo, rate, duration_s, window_s))

    monkeypatch.setattr(cli, "soak", fake_soak)
    ctx = Context(Store(tmp_path), plan.full_sizes(), 0, None, tmp_path, False)  # type: ignore[arg-type]
    args = cli.parse_args(["--soak", "ts-slo", "--soak-rate", "4.9"])
    with pytest.raises(SystemExit, match="no long-tail SLO"):  # nothing to judge by: refused, nothing run
        cli.run_soaks(ctx, ["ts-slo"], plan.LONGTAIL, args)
    assert not calls and ctx.store.load("slo-longtail") is None
    args = cli.parse_args(
        ["--soak", "ts-slo", "--soak-rate", "4.9", "--slo-ttft", "1.06", "--soak-window", "600"]
    )
    cli.run_soaks(ctx, ["ts-slo"], plan.LONGTAIL, args)
    key, slo, rate, duration_s, window_s = calls[-1]
    assert (key, slo.ttft_s, slo.tpot_s, rate, duration_s, window_s) == (
        "ts-slo",
        1.06,
        0.1,
        4.9,
        1800.0,
        600.0,
    )
    assert ctx.store.load("slo-longtail")["ttft_s"] == 1.06  # frozen for the next server's soak
    cli.run_soaks(ctx, ["vllm"], plan.LONGTAIL, cli.parse_args(["--soak", "vllm", "--soak-rate", "0.5"]))
    assert calls[-1][1].ttft_s == 1.06 and calls[-1][4] == 736.0  # 368 requests at 0.5 req/s


def test_soak_memory_and_kv_readings(tmp_path: Path) -> None:
    import os

    from compare.run import group_rss_bytes, prometheus_values

    assert group_rss_bytes(os.getpgrp()) > 10 * 2**20  # this test process alone holds more than 10 MiB
    page = '# HELP x\ntailserve_kv_blocks_used 0.0\nvllm:kv_cache_usage_perc{engine="0"} 0.25\nother 3\n'
    assert prometheus_values(page, ("tailserve_kv_blocks_used", "vllm:kv_cache_usage_perc")) == {
        "tailserve_kv_blocks_used": 0.0,
        "vllm:kv_cache_usage_perc": 0.25,
    }


def test_report_renders_the_soak_verdicts(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.save({"ttft_s": 5.0, "tpot_s": 0.1, "error_rate": 0.01, "basis": "test"}, "slo-longtail")
    rows = [row(i, ttft=1.0 + (i % 10) * 0.01, sent_s=i * 0.5) for i in range(1200)]
    window_rows = windows(rows, 200.0)
    figures = analyze(rows, {"throughput": {"duration_s": 600.0}}, SLO, None)
    soak = {"name": "soak-10min", "rate": 2.0, "duration_s": 600.0, "window_s": 200.0, "figures": figures,
            "windows": window_rows, "kv_after": {"tailserve_kv_blocks_used": 0.0}, "rss_steady": [100 * 2**20, 102 * 2**20],
            "errors": {"by_kind": {}}}  # fmt: skip
    store.save(soak, "ts-slo", "longtail", "soak-10min")
    text, svgs = report.render(store)
    assert "### Soak: tailserve (slo)" in text
    assert "no window's P99 above 1.3x the whole run's: **MET**" in text  # every window's P99 is the same
    assert "0 errors: **MET**" in text and "0 KV blocks in use after the run: **MET**" in text
    assert "RSS growth < 5% after warm-up: **MET**" in text and "+2.0%" in text
    assert {name for name, _ in svgs} >= {"soak-ts-slo-10min-ttft.svg", "soak-ts-slo-10min-tpot.svg"}
    assert all(svg.startswith("<svg") for _, svg in svgs)


def test_slo_is_set_from_the_fastest_calibration_and_frozen(tmp_path: Path) -> None:
    from compare.cli import frozen_slo, parse_args

    store = Store(tmp_path)
    for key, idle in (("ts-slo", 2.0), ("vllm", 1.6), ("llamacpp", 9.0)):
        store.save({"idle_ttft_longest_s": idle}, key, "longtail", "calibration")
    args = parse_args([])
    slo = frozen_slo(store, plan.LONGTAIL, ["ts-slo", "vllm", "llamacpp"], args)
    assert slo is not None and slo.ttft_s == pytest.approx(2.4) and slo.tpot_s == pytest.approx(0.1)
    assert "vllm" in slo.basis and "1650 tokens" in slo.basis
    store.save({"idle_ttft_longest_s": 0.5}, "hf-cb", "longtail", "calibration")  # a server added later
    again = frozen_slo(store, plan.LONGTAIL, ["ts-slo", "vllm", "llamacpp", "hf-cb"], args)
    assert again == slo  # the saved SLO stands, so resumed points stay comparable


def test_length_scale_keeps_the_shapes_and_is_frozen_in_the_folder(tmp_path: Path) -> None:
    from compare.cli import length_scale, parse_args, record_invocation

    assert plan.scaled_workloads(1.0) == plan.WORKLOADS  # 1 is the workloads exactly
    half = plan.scaled_workloads(0.5)
    assert half["longtail"].input_len == "longtail:100,750,0.05,0.5"
    assert half["longtail"].output_len == "uniform:16,64" and half["longtail"].longest_tokens == 825
    assert "x0.5" in half["longtail"].title
    turns = half["multiturn"]
    assert turns.shared_prefix_tokens == 200 and turns.input_len == "uniform:232,328"
    assert turns.longest_tokens == 200 + 3 * 128 + 2 * 64  # the third turn's longest prompt
    with pytest.raises(ValueError, match="outside"):
        plan.scaled_workloads(0.0)

    store = Store(tmp_path)
    args = parse_args(["--length-scale", "0.5"])
    assert length_scale(store, args) == 0.5
    record_invocation(store, [], args, plan.QUICK)
    assert length_scale(store, parse_args([])) == 0.5  # a resumed run keeps the folder's lengths
    assert (store.load("run") or {})["probe_prompts"] == "common"  # a new folder's probes share prompts
    older = Store(tmp_path / "older")
    older.save({"invocations": []}, "run")  # a folder from before common probe prompts
    record_invocation(older, [], args, plan.QUICK)
    assert (older.load("run") or {})["probe_prompts"] == "own"
    with pytest.raises(SystemExit, match="x0.5"):
        length_scale(store, parse_args(["--length-scale", "1"]))
    assert "x0.5" in report.render(store)[0]


def test_replayed_probes_are_set_beside_the_reference_only_at_the_same_rate(tmp_path: Path) -> None:
    store = Store(tmp_path)
    for key in ("ts-slo", "ts-fcfs", "vllm"):
        store.save(
            {"intercept_s": 0, "per_token_s": 0, "idle_tpot_s": 0, "points": []},
            key,
            "longtail",
            "calibration",
        )
    store.save(
        {**point(1.6, (0.5, 0.4, 0.6), (1.5, 1.4, 1.6)), "name": "probe-01"}, "ts-slo", "longtail", "probe-01"
    )
    replayed = {**point(1.6, (3.0, 2.0, 4.0), (1.0, 0.9, 1.1)), "name": "replay-ts-slo-probe-01"}
    store.save({**replayed, "replay_of": "probe-01"}, "ts-fcfs", "longtail", "replay-ts-slo-probe-01")
    # vLLM's own search: the same name, another rate and prompts, so not set beside it
    store.save(
        {**point(1.9, (0.1, 0.05, 0.2), (1.8, 1.7, 1.9)), "name": "probe-01"}, "vllm", "longtail", "probe-01"
    )
    rerun = {**point(1.6, (0.5, 0.4, 0.6), (1.5, 1.4, 1.6)), "name": "replay-ts-slo-probe-01"}
    store.save({**rerun, "replay_of": "probe-01"}, "ts-slo", "longtail", "replay-ts-slo-probe-01")
    table = report.same_prompts_table(store, "longtail")
    rows = [r for r in table if r.startswith("| probe-01 |")]
    assert len(rows) == 4  # the rerun of slo in a fresh process and fcfs, each under slo's original; not vLLM
    assert "| tailserve (slo), rerun |" in rows[1] and "0.50 [0.40, 0.60] (not enough data)" in rows[1]
    fcfs = next(r for r in table if "fcfs" in r)
    assert "3.00 [2.00, 4.00] (higher)" in fcfs  # queue delay intervals apart: fcfs waits longer
    probes = report.probe_rows(store, "longtail")
    assert [r.split("|")[2].strip() for r in probes[2:]] == [
        "1.9",
        "1.6",
        "1.6",
        "1.6",
    ]  # by rate, highest first


def test_cpu_shares_split_busy_idle_and_steal() -> None:
    from machine import cpu_shares, cpu_times

    before = (100, 0, 10, 500, 0, 0, 0, 10)
    after = (160, 0, 20, 520, 0, 0, 0, 30)  # 70 busy, 20 idle, 20 stolen of 110 ticks
    shares = cpu_shares(before, after)
    assert shares == pytest.approx({"busy": 70 / 110, "idle": 20 / 110, "steal": 20 / 110})
    assert cpu_shares((), after) is None and cpu_shares(after, after) is None
    now = cpu_times()
    assert now == () or len(now) == 8  # Linux: the eight counters


def test_a_replay_of_an_unknown_server_is_refused_before_anything_runs(tmp_path: Path) -> None:
    from compare.cli import main

    with pytest.raises(SystemExit, match="unknown server 'nobody'"):
        main(["--out", str(tmp_path / "run"), "--servers", "ts-fcfs", "--replay", "nobody:probe-01"])
    assert not (tmp_path / "run").exists()


def test_interleaved_rounds_alternate_the_order_and_resume(tmp_path: Path) -> None:
    from compare.run import interleave, rounds_todo

    store = Store(tmp_path)
    for i, rate in ((1, 3.2), (2, 1.6)):
        store.save(
            {"name": f"probe-0{i}", "rate": rate, "passed": False}, "ts-slo", "longtail", f"probe-0{i}"
        )
    keys = ["ts-slo", "vllm"]
    order = [(r, p["name"], k) for r, p, k in rounds_todo(store, keys, "longtail", "ts-slo", ["probe-02"], 3)]
    assert order == [
        (1, "probe-02", "ts-slo"), (1, "probe-02", "vllm"),
        (2, "probe-02", "vllm"), (2, "probe-02", "ts-slo"),
        (3, "probe-02", "ts-slo"), (3, "probe-02", "vllm"),
    ]  # fmt: skip
    store.save({"name": "x"}, "vllm", "longtail", "rounds-ts-slo-probe-02-r2")  # saved: not run again
    left = rounds_todo(store, keys, "longtail", "ts-slo", ["probe-02"], 2)
    assert [(r, k) for r, _, k in left] == [(1, "ts-slo"), (1, "vllm"), (2, "ts-slo")]
    # Uncalibrated servers are left out, so with none calibrated nothing starts.
    ctx = Context(store, plan.QUICK, 0, None, tmp_path)  # type: ignore[arg-type]
    interleave(ctx, keys, plan.LONGTAIL, SLO, "ts-slo", ["probe-02"], 2)
    assert "interleaved rounds of ts-slo's probes: nothing left" in (tmp_path / "progress.log").read_text()


def test_rounds_on_a_prefix_caching_workload_draw_new_conversations() -> None:
    """Servers stay up between rounds: replaying round 1's conversations would hit the prefix cache
    round 1 filled. Long-tail rounds keep the probe's prompts; multi-turn rounds from 2 on draw their
    own, the same for every server of the round."""
    from compare.run import point_seed, round_prompts

    probe = {"name": "probe-02", "rate": 1.6}
    assert {round_prompts(probe, r, plan.LONGTAIL) for r in (1, 2, 3)} == {"probe-02"}
    names = [round_prompts(probe, r, plan.MULTITURN) for r in (1, 2, 3)]
    assert names[0] == "probe-02"
    assert len({point_seed(0, n) for n in names}) == 3
    assert round_prompts({"name": "replay-x", "prompts_of": "probe-05"}, 1, plan.MULTITURN) == "probe-05"


def test_an_interleaved_verdict_needs_the_same_side_in_every_round(tmp_path: Path) -> None:
    store = Store(tmp_path)
    for key in ("ts-slo", "vllm"):
        store.save(
            {"intercept_s": 0, "per_token_s": 0, "idle_tpot_s": 0, "points": []},
            key,
            "longtail",
            "calibration",
        )

    def save(
        key: str, r: int, queue: tuple[float, float, float], goodput: tuple[float, float, float]
    ) -> None:
        doc = {**point(1.6, queue, goodput), "name": f"rounds-ts-slo-probe-02-r{r}", "replay_of": "probe-02",
               "rounds_of": "ts-slo", "round": r, "idle_draw": {"busy": 0.01, "idle": 0.99, "steal": 0.0}}  # fmt: skip
        store.save(doc, key, "longtail", f"rounds-ts-slo-probe-02-r{r}")

    save("ts-slo", 1, (0.5, 0.4, 0.6), (1.5, 1.4, 1.6))
    save("vllm", 1, (3.0, 2.0, 4.0), (1.0, 0.9, 1.1))
    save("ts-slo", 2, (0.5, 0.4, 0.6), (1.5, 1.4, 1.6))
    save("vllm", 2, (3.0, 2.0, 4.0), (1.5, 1.3, 1.7))  # goodput overlaps in round 2
    table = report.rounds_table(store, "longtail")
    assert sum(r.startswith("| ts-slo probe-02 |") for r in table) == 4
    queue = next(r for r in table if "queue delay" in r and r.startswith("- "))
    assert "2 round(s): **lower in every round**" in queue
    goodput = next(r for r in table if "goodput:" in r)
    assert "not enough data (higher, not enough data)" in goodput
    assert "1.0% busy" in table[2]


def test_rounds_need_a_replay(tmp_path: Path) -> None:
    from compare.cli import main

    with pytest.raises(SystemExit, match="--rounds N needs --replay"):
        main(["--out", str(tmp_path / "run"), "--servers", "ts-slo,vllm", "--rounds", "2"])
    assert not (tmp_path / "run").exists()


def test_the_cpu_log_and_the_steal_the_p99_tail_saw(tmp_path: Path) -> None:
    """The slowest requests waited through a burst of steal: the tail's share is the burst's, the run's
    is diluted over all of it; where the log does not cover the run there is no figure."""
    import time

    from compare.analyze import tail_steal
    from machine import CpuLog, read_cpu_log, steal_between

    log = tmp_path / "cpu-1s.log"
    with CpuLog(log, every_s=0.05):
        time.sleep(0.3)
    real = read_cpu_log(log)
    assert len(real) >= 2 and all(len(c) == 8 for _, c in real)
    # 100 s, 100 ticks a second: no steal but 50% during seconds 40-50.
    samples, total = [], [0] * 8
    for t in range(101):
        samples.append((1000.0 + t, tuple(total)))
        burst = 40 <= t < 50
        total[0] += 50 if burst else 100
        total[7] += 50 if burst else 0
    assert steal_between(samples, 1040.0, 1050.0) == pytest.approx(0.5)
    assert steal_between(samples, 1000.0, 1100.0) == pytest.approx(500 / 10000)
    assert steal_between(samples, 990.0, 1010.0) is None  # before the log starts
    rows = [row(i, ttft=0.2, sent_s=float(i), done_s=1.0) for i in range(95)]
    rows.append(row(95, ttft=3.0, sent_s=41.0, done_s=4.0))  # waited inside the burst
    got = tail_steal(rows, 1000.0, 3.0, samples)
    assert got is not None and got["tail_requests"] == 1
    assert got["tail"] == pytest.approx(0.5) and got["run"] < 0.1
    assert tail_steal(rows, 5000.0, 3.0, samples) is None  # the log covers none of it
    partly = tail_steal(rows, 1000.0, 3.0, samples[30:])  # the log starts mid-run: no run figure
    assert partly is not None and partly["run"] is None and partly["tail"] == pytest.approx(0.5)


def test_the_gil_variant_is_tailserve_slo_at_a_tenth_of_the_switch_interval() -> None:
    """`--servers ts-slo,ts-slo-gil05`: the A/B of --switch-interval-ms (the same server at 0.5 ms
    against the default, Python's own 5 ms), saved and labelled apart from ts-slo."""
    from compare.run import server_spec
    from peers.launch import Limits

    limits = Limits(threads=2, max_seqs=16, step_tokens=256, ctx_per_seq=2048)
    base = server_spec("ts-slo", plan.WORKLOADS["longtail"], 8001, Path("m.gguf"), limits, SLO)
    gil05 = server_spec("ts-slo-gil05", plan.WORKLOADS["longtail"], 8001, Path("m.gguf"), limits, SLO)
    assert (gil05.key, gil05.label) == ("ts-slo-gil05", "tailserve (slo, GIL switch 0.5 ms)")
    assert gil05.command == [*base.command, "--switch-interval-ms", "0.5"]
    assert "--switch-interval-ms" not in base.command  # ts-slo runs the server's default (5 ms)
    assert report.LABELS["ts-slo-gil05"] == gil05.label
    # `ts-slo-edf`: the A/B of --urgent-slack, every prompt in deadline order.
    edf = server_spec("ts-slo-edf", plan.WORKLOADS["longtail"], 8001, Path("m.gguf"), limits, SLO)
    assert edf.command == [*base.command, "--urgent-slack", "1"]
    assert report.LABELS["ts-slo-edf"] == edf.label != base.label


# ----- capacity across prompt draws ---------------------------------------------------------------
def probe(rate: float, ttft: tuple[float, float], errors: float = 0.0) -> dict[str, Any]:
    """A saved capacity probe whose P99 TTFT is `ttft` = (point, upper end); TPOT always passes."""
    p99 = {"value": ttft[0], "low": ttft[0] * 0.8, "high": ttft[1], "count": 368}
    tpot = {"value": 0.05, "low": 0.04, "high": 0.06, "count": 368}
    figures = {"metrics": {"ttft_s": {"p99": p99}, "tpot_s": {"p99": tpot}}, "error_rate": errors}
    return {"rate": rate, "passed": ttft[1] <= 1.0 and errors <= 0.01, "figures": figures}


def draw(root: Path, seed: int, probes: dict[str, list[dict[str, Any]]]) -> Store:
    store = Store(root)
    store.save({"seed": seed, "invocations": []}, "run")
    store.save({"ttft_s": 1.0, "tpot_s": 0.1, "error_rate": 0.01, "basis": "test"}, "slo-longtail")
    for key, docs in probes.items():
        for i, doc in enumerate(docs, 1):
            store.save(doc, key, "longtail", f"probe-{i:02d}")
    return store


def test_capacity_across_draws_reads_every_draw_under_both_rules(tmp_path: Path) -> None:
    from compare import across

    # Draw 0: tailserve passes 6 and, on its point P99 only, 7; vLLM passes 3 and fails 3.5.
    first = draw(tmp_path / "d0", 0, {
        "ts-slo": [probe(6.0, (0.5, 0.9)), probe(7.0, (0.9, 1.2))],
        "vllm": [probe(3.0, (0.5, 0.8)), probe(3.5, (1.1, 1.3))],
    })  # fmt: skip
    # Draws 1 and 2: both servers pass 4 and fail 4.4-4.5 (a 429 share over 1% fails one probe).
    even = [
        draw(
            tmp_path / f"d{seed}",
            seed,
            {
                "ts-slo": [probe(4.0, (0.5, 0.9)), probe(4.5, (0.6, 0.9), errors=0.02)],
                "vllm": [probe(4.0, (0.5, 0.9)), probe(4.4, (1.2, 1.4))],
            },
        )  # fmt: skip
        for seed in (1, 2)
    ]
    lines = across.across_table([first, *even])
    text = "\n".join(lines)
    # Conservative: 6 / 3 = 2.00x, bracket 6 / 3.5 .. 7 / 3 = 1.71 .. 2.33: met on this draw.
    assert (
        "| d0, seed 0 | upper | 6.00 (< 7.00) | vLLM CPU (bf16) | 3.00 (< 3.50) | 2.00x [1.71, 2.33] | MET |"
        in text
    )
    # Point P99: tailserve's 7 now passes and nothing failed above it: the bracket is open.
    assert (
        "| d0, seed 0 | point | 7.00 (none failed above) | vLLM CPU (bf16) | 3.00 (< 3.50) | 2.33x [2.00, open] | MET |"
        in text
    )
    # 4 / 4 = 1.00x, at most 4.5 / 4 = 1.12x: missed on those draws.
    assert (
        "| d1, seed 1 | upper | 4.00 (< 4.50) | vLLM CPU (bf16) | 4.00 (< 4.40) | 1.00x [0.91, 1.12] | MISSED |"
        in text
    )
    summary = [line for line in lines if line.startswith("- upper rule")][0]
    assert "3 draws" in summary and "1 met, 2 missed" in summary and "**MISSED**" in summary
    assert "geometric mean 1.26x" in summary  # (2 x 1 x 1) ** (1/3)
    # One good draw alone is met; one good and one bad draw are not enough data.
    assert "**MET**" in [x for x in across.across_table([first]) if x.startswith("- upper")][0]
    assert across.overall_verdict([stats.MET, stats.MISSED]) == stats.NOT_ENOUGH
