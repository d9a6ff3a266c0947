"""The comparison as markdown and plots, read from the results folder only (so a finished or half
finished run can be re-rendered): SLO and its basis, calibration, capacity, every rate point with
intervals, overload, the soak, the issue's targets each MET / MISSED / "not enough data" from the
intervals, and every server's command line. Writes DIR/report/compare.md, compare.html and SVGs.
"""

from __future__ import annotations

import datetime
import html
import json
from pathlib import Path
from typing import Any

from machine import read_cpu_log

from compare import plots
from compare.analyze import Calibration, interval, metric_values, read_rows, tail_steal
from compare.plan import scaled_workloads
from compare.run import OTHER_SERVERS, REFERENCE, SERVERS, TS_VARIANTS
from compare.stats import MET, MISSED, NOT_ENOUGH, Interval, at_most, compare
from compare.store import Store

ANALYSIS_HEADING = "## Analysis"  # from here on, --doc keeps the old document's text
POINT_ORDER = ("at-0.5x", "at-0.8x", "reference", "over-1.5x", "over-2x")
LABELS = {
    "ts-slo": "tailserve (slo)",
    "ts-fcfs": "tailserve (fcfs)",
    "vllm": "vLLM CPU (bf16)",
    "llamacpp": "llama.cpp (Q4_1)",
    "llamacpp-1t": "llama.cpp (Q4_1, 1 thread)",
    "hf-cb": "transformers serve --cb",
    "hf": "transformers serve",
    "ts-slo-gil5": "tailserve (slo, GIL switch 5 ms)",  # saved by the A/B when the default was 0.5 ms
    **{key: label for key, (_, label) in TS_VARIANTS.items()},
}


REPRODUCE = """## How to reproduce

On an otherwise idle box (the comparison is a benchmark, not CI: hours), from the repository root:

```
nohup .venv/bin/python benchmarks/compare_engines.py --out bench-results/compare-issue15 > /dev/null 2>&1 &
tail -f bench-results/compare-issue15/progress.log
# after it: the soak of tailserve (slo) and of the peer with the highest long-tail capacity
.venv/bin/python benchmarks/compare_engines.py --out bench-results/compare-issue15 --soak ts-slo,best
# the report again at any time (also mid-run), into the doc
.venv/bin/python benchmarks/compare_engines.py --render bench-results/compare-issue15 --doc docs/COMPARE.md
```

Rerunning a command with the same `--out` resumes: every (server, workload, point) is saved when it
completes and never run again; the SLO of each workload is frozen in the folder once set. Phase 1
calibrates every server on both workloads (`tailserve bench`'s calibration phase: idle TTFT at 7
quantiles of the prompt lengths, a line fitted); phase 2 searches each server's capacity (probes of
368 measured requests: ramp x2 from twice one stream's service rate, then bisection to 15%; in a new
folder every probe of every server sends the same prompt sequence at its own rate) and runs
its rate points (368 measured requests each: 80% of capacity, 2x, 1.5x, the shared reference rate,
half of capacity) within a budget of 3 h per server and workload (`--budget-h`; the points left out
are listed with the time they would have taken). A probe or point takes requests / rate seconds, so
duration grows as capacity falls: about 1.5-2.5 h per server and workload at 0.5-1 req/s, i.e.
~10-20 h for five servers and two workloads (`--workloads longtail` first carries most targets),
plus ~40 min per soak. The soak's windows are max(5 min, 368 requests / rate) long, so that each
window's P99 has a bounded interval: below ~0.6 req/s a 30-minute soak has fewer than 3 windows
(`--soak-min 60` then); `--soak-window` sets longer ones, whose P99 intervals are narrower. A
soak in a folder with no comparison in it takes its SLO from `--slo-ttft` (and `--slo-tpot-ms`) and
its rate from `--soak-rate`. `--quick` (12 requests a point, tailserve + llama.cpp) checks the harness
in minutes; its numbers carry no verdict.

When the hours are not there: `--length-scale F` multiplies every prompt and output length (frozen
in the folder by its first run; x0.25 makes a 368-request probe 2-16 minutes here),
`--search-only` runs the capacity searches and leaves every rate point out (listed as such),
`--rate-start RATE` or `--rate-start SERVER=RATE,...` starts each search near its capacity instead of
ramping from one stream's rate (with `--probe-requests 1000`, the low-rate probes of the ramp take
longest; `--growth` and `--tolerance` set the ramp and the bisection's stop), and
`--replay KEY[:probe-01,at-0.8x,...]` runs `--servers` at the rates of KEY's saved probes (or of the
saved runs named) with the same prompts (saved as `replay-KEY-NAME`, set beside KEY's in the
report); with `--rounds N` it runs
interleaved repeats instead: every server named, KEY included, up at once, and each probe run N times
on each in alternating order (A B, B A, ...), so the machine's drift falls on all of them alike; a
verdict between two servers then needs the same answer in every round. One folder's capacity
search is one prompt draw, and under the conservative rule its capacity is set by the draw's single
worst request (at 368 requests the upper end of a P99's interval is the largest value): run the
searches into several folders with `--seed 0`, `--seed 1`, ... and read them together with
`--across DIR DIR ...`, which gives each draw's capacities under the conservative and the point
P99, the ratio to the best peer with its bracket, and a verdict over the draws. Every bench run records the
machine's busy / idle / steal shares of CPU time (`run.cpu`); on a VM, steal moves P99s as much as
a server does, so read each row with its steal column. The comparison also logs the machine's CPU
counters once a second (`cpu-1s.log` in the folder). For each run, the report gives the steal share
while the requests that set the P99 TTFT (those at or above it) waited for their first token
("steal, P99 TTFT tail"): far above the run's own steal, it says that a burst on the machine, not
the server, made the tail.

The SLO of each workload, set from phase 1 and frozen: P99 TTFT <= 1.5 x the fastest server's idle
TTFT of the workload's longest prompt (1650 tokens long-tail, 1424 multi-turn), the tightest target
some server meets when idle (a server slower than that at prefill cannot meet it even alone: its
search is skipped and says so); P99 TPOT <= 100 ms; at most 1% errors, 429s included.
`--slo-factor`, `--slo-ttft` and `--slo-tpot-ms` change it before it is frozen.

Servers and prefix caching (on only in the multi-turn workload): tailserve without
`--no-prefix-caching` (hashed full KV blocks), vLLM `--enable-prefix-caching`, llama.cpp
`cache_prompt` per slot plus a 256 MiB host prompt cache, `transformers serve --continuous-batching`
with its block sharing left on; in the long-tail workload all of them run with it off.
"""


def fmt(x: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def ci(data: dict[str, Any] | Interval | None, scale: float = 1.0, digits: int = 2) -> str:
    """`value [low, high]`, an open end as `?` (too few requests to bound it)."""
    i = data if isinstance(data, Interval) else interval(data)
    if i.value is None:
        return "-"
    low = "?" if i.low is None else fmt(i.low, scale, digits)
    high = "?" if i.high is None else fmt(i.high, scale, digits)
    return f"{fmt(i.value, scale, digits)} [{low}, {high}]"


def servers_in(store: Store, workload: str) -> list[str]:
    return [
        k
        for k in SERVERS + OTHER_SERVERS
        if store.load(k, workload, "calibration") or store.has(k, workload, "failed")
    ]


def metric(point: dict[str, Any] | None, name: str, field: str = "p99") -> dict[str, Any] | None:
    return ((point or {}).get("figures", {}).get("metrics", {}).get(name) or {}).get(field)


def capacity_probe(store: Store, key: str, workload: str) -> dict[str, Any] | None:
    """The passing probe at the server's capacity (its goodput is 'goodput at capacity')."""
    done = store.load(key, workload, "points")
    if not done or not done.get("capacity"):
        return None
    probes = [
        p for p in store.points(key, workload, "probe-") if p["passed"] and p["rate"] == done["capacity"]
    ]
    return probes[-1] if probes else None


def calibration_table(store: Store, workload: str) -> list[str]:
    lines = [
        "| server | idle TTFT line | idle TTFT, longest prompt s | idle TPOT ms | ready s | flags note |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for key in servers_in(store, workload):
        cal = store.load(key, workload, "calibration")
        if cal is None:
            failed = store.load(key, workload, "failed") or {}
            lines.append(
                f"| {LABELS[key]} | failed: {str(failed.get('error', '?')).splitlines()[0]} | | | | |"
            )
            continue
        lines.append(
            f"| {LABELS[key]} | {cal['intercept_s']:.3f} s + {cal['per_token_s'] * 1000:.3f} ms/token "
            f"| {cal['idle_ttft_longest_s']:.2f} | {cal['idle_tpot_s'] * 1000:.1f} | {fmt(cal['server']['ready_s'], digits=0)} "
            f"| {cal['server']['notes']} |"
        )
    return lines


def capacity_table(store: Store, workload: str) -> list[str]:
    lines = [
        "| server | capacity req/s | next failing probe | probes (rate: verdict) | search note | points left out (budget) |",
        "| --- | ---: | ---: | --- | --- | --- |",
    ]
    for key in servers_in(store, workload):
        done = store.load(key, workload, "points")
        probes = store.points(key, workload, "probe-")
        text = ", ".join(
            f"{p['rate']:g}: {'pass' if p['passed'] else 'FAIL (' + p['fail_reason'] + ')'}" for p in probes
        )
        if done is None:
            lines.append(f"| {LABELS[key]} | not finished | | {text} | | |")
            continue
        dropped = ", ".join(
            f"{d['name']} ({d['rate']:g} req/s, ~{d['would_take_s'] / 60:.0f} min)"
            for d in done.get("dropped", [])
        )
        above = done["capacity_bracket"][1]
        lines.append(
            f"| {LABELS[key]} | {done['capacity']:g} | {'-' if above is None else f'{above:g}'} | {text} | {done.get('search_note') or '-'} | {dropped or '-'} |"
        )
    return lines


POINT_HEADER = [
    "| point | req/s | server | n | P99 TTFT s | TTFT P99/mean | P99 TPOT ms | TPOT P99/mean | P99 slowdown "
    "| slowdown P99/mean | P99 queue delay s | goodput req/s | met / fast 429 / slow miss / error | cached prompt "
    "| CPU steal | steal, P99 TTFT tail |",
    "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
]
CPU_LOG = "cpu-1s.log"  # compare_engines.py's 1-second CpuLog of the machine, in the results folder
_cpu_logs: dict[Path, list[tuple[float, tuple[int, ...]]]] = {}


def steal_of_tail(store: Store, p: dict[str, Any]) -> dict[str, Any] | None:
    """`tail_steal` of a saved point: its rows, its bench's start time and the folder's CPU log."""
    path = store.root / CPU_LOG
    if path not in _cpu_logs:
        _cpu_logs[path] = read_cpu_log(path)
    samples, run = _cpu_logs[path], p.get("run") or {}
    p99 = (metric(p, "ttft_s") or {}).get("value")
    if not samples or not run.get("bench_json") or p99 is None:
        return None
    bench_json = store.root / run["bench_json"]
    try:
        started = json.loads(bench_json.read_text())["started_at"]
        rows = read_rows(bench_json.with_suffix(".jsonl"))
    except (OSError, ValueError, KeyError):
        return None
    return tail_steal(rows, datetime.datetime.fromisoformat(started).timestamp(), p99, samples)


def point_row(name: str, key: str, p: dict[str, Any], store: Store | None = None) -> str:
    f = p["figures"]
    fates = f["fates"]
    share = f.get("cached_token_fraction")
    cached = "-" if share is None else f"{share:.0%}"  # prompt tokens the server said it had cached
    cpu = (p.get("run") or {}).get("cpu")  # recorded from this harness's version on
    steal = "-" if not cpu else f"{cpu['steal']:.1%}"
    seen = None if store is None else steal_of_tail(store, p)
    tail = "-" if seen is None else f"{seen['tail']:.1%} ({seen['tail_requests']} of {seen['tail_of']} req.)"
    return (
        f"| {name} | {p['rate']:g} | {LABELS[key]} | {f['measured']} | {ci(metric(p, 'ttft_s'))} "
        f"| {ci(metric(p, 'ttft_s', 'p99_over_mean'))} | {ci(metric(p, 'tpot_s'), 1000, 0)} "
        f"| {ci(metric(p, 'tpot_s', 'p99_over_mean'))} | {ci(metric(p, 'slowdown'))} "
        f"| {ci(metric(p, 'slowdown', 'p99_over_mean'))} | {ci(metric(p, 'queue_delay_s'))} "
        f"| {ci(f['goodput_per_s'], digits=3)} | {fates['met']} / {fates['fast_429']} / {fates['slow_miss']} / {fates['error']} | {cached} "
        f"| {steal} | {tail} |"
    )


def point_rows(store: Store, workload: str) -> list[str]:
    lines = list(POINT_HEADER)
    for name in POINT_ORDER:
        for key in servers_in(store, workload):
            if (p := store.load(key, workload, name)) is not None:
                lines.append(point_row(name, key, p, store))
    return lines


def probe_rows(store: Store, workload: str) -> list[str]:
    """Every capacity probe (and replayed probe) of every server, by rate, highest first: each is a
    full run of its own, with the same figures as a rate point."""
    keys = servers_in(store, workload)
    probes = [
        (p["rate"], key, p)
        for key in keys
        for prefix in ("probe-", "replay-", "rounds-")
        for p in store.points(key, workload, prefix)
    ]
    if not probes:
        return ["(no probe yet)"]
    probes.sort(key=lambda x: (-x[0], keys.index(x[1])))
    return [*POINT_HEADER, *(point_row(p.get("name", "probe"), key, p, store) for _, key, p in probes)]


def same_prompts_table(store: Store, workload: str) -> list[str]:
    """Probes that another server replayed (`--replay`: same name, rate and prompts), each P99 beside
    tailserve (slo)'s with `compare` on the intervals (lower / higher only when they are apart)."""
    ours = {
        p.get("name"): p
        for kind in ("probe-", "at-", "over-")
        for p in store.points(REFERENCE, workload, kind)
    }
    names = (("ttft_s", 1.0, "P99 TTFT s", "p99"), ("tpot_s", 1000.0, "P99 TPOT ms", "p99"),
             ("tpot_s", 1.0, "TPOT P99/mean", "p99_over_mean"), ("queue_delay_s", 1.0, "P99 queue delay s", "p99"),
             ("slowdown", 1.0, "P99 slowdown", "p99"), ("slowdown", 1.0, "slowdown P99/mean", "p99_over_mean"))  # fmt: skip
    lines = [
        "| run | req/s | server | " + " | ".join(label for _, _, label, _ in names) + " | goodput req/s |",
        "| --- | ---: | --- |" + " ---: |" * (len(names) + 1),
    ]
    found = False
    for key in servers_in(store, workload):  # tailserve (slo)'s own replays are reruns in a fresh process
        for p in store.points(key, workload, f"replay-{REFERENCE}-"):
            mine_ref = ours.get(p.get("replay_of"))
            if mine_ref is None or abs(mine_ref["rate"] - p["rate"]) > 1e-9:
                continue  # its own search's probe, at another rate
            found = True
            label = f"{LABELS[key]}, rerun" if key == REFERENCE else LABELS[key]
            for row, (who, doc) in enumerate(((LABELS[REFERENCE], mine_ref), (label, p))):
                cells = []
                for name, scale, _, field in names:
                    mine = metric(doc, name, field)
                    theirs = metric(mine_ref, name, field)
                    verdict = f" ({compare(interval(mine), interval(theirs))})" if row else ""
                    cells.append(ci(mine, scale, 0 if scale > 1 else 2) + verdict)
                lines.append(
                    f"| {p['replay_of']} | {p['rate']:g} | {who} | {' | '.join(cells)} "
                    f"| {ci(doc['figures']['goodput_per_s'], digits=3)} |"
                )
    return lines if found else ["(no replayed probe yet: `--replay ts-slo` runs another server on them)"]


ROUND_METRICS = (("ttft_s", 1.0, "P99 TTFT s"), ("tpot_s", 1000.0, "P99 TPOT ms"),
                 ("queue_delay_s", 1.0, "P99 queue delay s"))  # fmt: skip


def rounds_of(store: Store, workload: str) -> dict[tuple[str, str], dict[int, dict[str, dict[str, Any]]]]:
    """Interleaved rounds (`--replay SOURCE --rounds N`): {(source, probe): {round: {server: point}}}."""
    found: dict[tuple[str, str], dict[int, dict[str, dict[str, Any]]]] = {}
    for key in servers_in(store, workload):
        for p in store.points(key, workload, "rounds-"):
            found.setdefault((p["rounds_of"], p["replay_of"]), {}).setdefault(int(p["round"]), {})[key] = p
    return found


def round_verdict(verdicts: list[str]) -> str:
    """One answer from every round's `compare`: the same side in every round, or not enough data."""
    if verdicts and all(v == verdicts[0] for v in verdicts) and verdicts[0] != NOT_ENOUGH:
        return f"**{verdicts[0]} in every round**"
    return f"{NOT_ENOUGH} ({', '.join(verdicts) or 'no round'})"


def rounds_table(store: Store, workload: str) -> list[str]:
    """Each interleaved round's P99s and goodput with intervals, the machine's steal during the run
    and the idle servers' draw just before it; then, for tailserve (slo) against every other server,
    a verdict per metric that needs the same side (intervals apart) in every round."""
    groups = rounds_of(store, workload)
    if not groups:
        return ["(no interleaved rounds yet: `--replay ts-slo:probe-02 --rounds 2` runs them)"]
    lines = [
        "| probe | round | req/s | server | " + " | ".join(m[2] for m in ROUND_METRICS)
        + " | goodput req/s | steal | idle draw |",
        "| --- | ---: | ---: | --- |" + " ---: |" * (len(ROUND_METRICS) + 3),
    ]  # fmt: skip
    verdicts: list[str] = []
    for (source, probe), by_round in sorted(groups.items()):
        for round_no, by_key in sorted(by_round.items()):
            for key, p in sorted(
                by_key.items(), key=lambda kv: (kv[1].get("run") or {}).get("bench_json", "")
            ):
                cells = [
                    ci(metric(p, name), scale, 0 if scale > 1 else 2) for name, scale, _ in ROUND_METRICS
                ]
                cpu, idle = (p.get("run") or {}).get("cpu"), p.get("idle_draw")
                steal = "-" if not cpu else f"{cpu['steal']:.1%}"
                if seen := steal_of_tail(store, p):
                    steal += f" (tail {seen['tail']:.1%})"
                draw = "-" if not idle else f"{idle['busy']:.1%} busy"
                lines.append(
                    f"| {source} {probe} | {round_no} | {p['rate']:g} | {LABELS[key]} | {' | '.join(cells)} "
                    f"| {ci(p['figures']['goodput_per_s'], digits=3)} | {steal} | {draw} |"
                )
        others = sorted({k for by_key in by_round.values() for k in by_key} - {REFERENCE})
        for other in others if any(REFERENCE in b for b in by_round.values()) else []:
            both = [b for _, b in sorted(by_round.items()) if REFERENCE in b and other in b]
            for name, _, label in (*ROUND_METRICS, ("goodput_per_s", 1.0, "goodput")):

                def iv(doc: dict[str, Any], name: str = name) -> Any:
                    return doc["figures"]["goodput_per_s"] if name == "goodput_per_s" else metric(doc, name)

                per_round = [compare(interval(iv(b[REFERENCE])), interval(iv(b[other]))) for b in both]
                verdicts.append(
                    f"- {source} {probe}, {label}: {LABELS[REFERENCE]} against {LABELS[other]}, "
                    f"{len(both)} round(s): {round_verdict(per_round)}"
                )
    return [*lines, "", *verdicts]


def reference_table(store: Store, workload: str) -> list[str]:
    """Every server at the same offered load (80% of tailserve (slo)'s capacity), each P99 against
    tailserve (slo)'s: lower / higher only when the intervals are apart."""
    ours = store.load(REFERENCE, workload, "at-0.8x")
    if ours is None:
        return ["(no reference rate yet: tailserve (slo) has no 80%-of-capacity point)"]
    names = (("ttft_s", 1.0, "P99 TTFT s"), ("tpot_s", 1000.0, "P99 TPOT ms"), ("slowdown", 1.0, "P99 slowdown"),
             ("queue_delay_s", 1.0, "P99 queue delay s"))  # fmt: skip
    lines = [
        f"At {ours['rate']:g} req/s for every server; beside each P99, how it compares with tailserve (slo)'s:",
        "",
        "| server | " + " | ".join(label for _, _, label in names) + " | goodput req/s | errors |",
        "| --- |" + " ---: |" * (len(names) + 1) + " ---: |",
    ]
    for key in servers_in(store, workload):
        p = ours if key == REFERENCE else store.load(key, workload, "reference")
        if p is None:
            continue
        cells = []
        for name, scale, _ in names:
            mine = metric(p, name)
            apart = compare(interval(mine), interval(metric(ours, name)))
            verdict = "" if key == REFERENCE or mine is None else f" ({apart})"
            cells.append(ci(mine, scale, 0 if scale > 1 else 2) + verdict)
        f = p["figures"]
        lines.append(
            f"| {LABELS[key]} | {' | '.join(cells)} | {ci(f['goodput_per_s'], digits=3)} | {f['failed']} of {f['measured']} |"
        )
    return lines


def overload_table(store: Store, workload: str) -> list[str]:
    lines = [
        "| server | goodput at capacity | at 1.5x | at 2x | 2x / capacity | at 2x: fast 429 | slow miss | error |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key in servers_in(store, workload):
        cap = capacity_probe(store, key, workload)
        p15, p2 = store.load(key, workload, "over-1.5x"), store.load(key, workload, "over-2x")
        if cap is None and p2 is None:
            continue
        g_cap = interval(cap["figures"]["goodput_per_s"]) if cap else Interval(None, None, None, 0)
        g_2 = interval(p2["figures"]["goodput_per_s"]) if p2 else Interval(None, None, None, 0)
        share = ""
        if p2:
            n = p2["figures"]["measured"] or 1
            fates = p2["figures"]["fates"]
            share = f"{fates['fast_429'] / n:.0%} | {fates['slow_miss'] / n:.0%} | {fates['error'] / n:.0%}"
        ratio = fmt(g_2.value / g_cap.value) if g_2.value is not None and g_cap.value else "-"
        lines.append(
            f"| {LABELS[key]} | {ci(g_cap, digits=3)} | {ci(p15['figures']['goodput_per_s'] if p15 else None, digits=3)} "
            f"| {ci(g_2, digits=3)} | {ratio} | {share or '| |'} |"
        )
    return lines


def verdict_line(name: str, verdict: str, detail: str) -> str:
    return f"- {name}: **{verdict}**: {detail}"


def targets(store: Store, workload: str) -> list[str]:
    """The issue's targets for one workload, each from the intervals."""
    lines: list[str] = []
    done = store.load(REFERENCE, workload, "points")
    peers = {
        k: d
        for k in servers_in(store, workload)
        if not k.startswith("ts-") and (d := store.load(k, workload, "points"))
    }
    if done and peers:
        ours = Interval(done["capacity"], done["capacity"], done["capacity_bracket"][1], 0)
        best = max(peers, key=lambda k: peers[k]["capacity"])
        theirs = Interval(
            peers[best]["capacity"], peers[best]["capacity"], peers[best]["capacity_bracket"][1], 0
        )
        if theirs.value == 0:
            v = MET if ours.value else NOT_ENOUGH
            detail = f"tailserve (slo) {ours.value:g} req/s, {LABELS[best]} 0 (no passing rate)"
        else:
            assert theirs.value is not None and ours.value is not None
            low_ratio = ours.value / (theirs.high or float("inf"))
            high_ratio = (ours.high / theirs.value) if ours.high else None
            v = (
                MET
                if low_ratio >= 1.5
                else (MISSED if high_ratio is not None and high_ratio < 1.5 else NOT_ENOUGH)
            )
            detail = (
                f"tailserve (slo) {ours.value:g} req/s (next failing probe {fmt(ours.high, digits=3)}) vs the best peer, "
                f"{LABELS[best]}, {theirs.value:g} req/s (next failing {fmt(theirs.high, digits=3)}): "
                f"{ours.value / theirs.value:.2f}x at the passing rates, ratio between {low_ratio:.2f}x and "
                f"{'?' if high_ratio is None else f'{high_ratio:.2f}x'} given the search brackets"
            )
        lines.append(
            verdict_line("capacity under the SLO >= 1.5x the best peer's (conservative capacity)", v, detail)
        )
    else:
        lines.append("- capacity >= 1.5x the best peer's: not measured (a capacity search is missing)")
    at80 = store.load(REFERENCE, workload, "at-0.8x")
    if at80:
        for name, bound, label in (("tpot_s", 1.5, "TPOT"), ("slowdown", 2.0, "slowdown")):
            r = interval(metric(at80, name, "p99_over_mean"))
            lines.append(verdict_line(f"tailserve (slo) {label} P99/mean <= {bound:g} at 80% of capacity ({at80['rate']:g} req/s)",
                                      at_most(r, bound), f"{ci(r)}" + (f", {r.value / bound:.2f}x the bound" if r.value else "")))  # fmt: skip
    else:
        lines.append("- P99/mean at 80% of capacity: not measured")
    fcfs = store.load("ts-fcfs", workload, "reference")
    if at80 and fcfs:
        a, b = interval(metric(at80, "queue_delay_s")), interval(metric(fcfs, "queue_delay_s"))
        if a.high is not None and b.low is not None and a.high <= 0.5 * b.low:
            v = MET
        elif a.low is not None and b.high is not None and a.low > 0.5 * b.high:
            v = MISSED
        else:
            v = NOT_ENOUGH
        ratio = f"{a.value / b.value:.2f}x" if a.value is not None and b.value else "-"
        lines.append(verdict_line(f"slo's P99 queue delay <= 0.5x fcfs's at {at80['rate']:g} req/s, intervals apart", v,
                                  f"slo {ci(a)} s vs fcfs {ci(b)} s ({ratio})"))  # fmt: skip
    else:
        lines.append("- slo vs fcfs queue delay: not measured (needs ts-slo at-0.8x and ts-fcfs reference)")
    cap, over = capacity_probe(store, REFERENCE, workload), store.load(REFERENCE, workload, "over-2x")
    if cap and over:
        g_cap, g_2 = interval(cap["figures"]["goodput_per_s"]), interval(over["figures"]["goodput_per_s"])
        assert g_cap.value is not None
        if g_2.low is not None and g_cap.high is not None and g_2.low >= 0.8 * g_cap.high:
            v = MET
        elif g_2.high is not None and g_cap.low is not None and g_2.high < 0.8 * g_cap.low:
            v = MISSED
        else:
            v = NOT_ENOUGH
        others = ", ".join(
            f"{LABELS[k]} {ci(p['figures']['goodput_per_s'], digits=3)}"
            for k in servers_in(store, workload) if k != REFERENCE and (p := store.load(k, workload, "over-2x"))
        )  # fmt: skip
        lines.append(verdict_line("tailserve (slo) goodput at 2x capacity >= 80% of its goodput at capacity", v,
                                  f"{ci(g_2, digits=3)} vs {ci(g_cap, digits=3)} req/s "
                                  f"({(g_2.value or 0) / g_cap.value:.0%} of it); peers at their own 2x: {others or '-'}"))  # fmt: skip
    else:
        lines.append("- goodput at 2x capacity: not measured")
    return lines


def soak_section(store: Store) -> tuple[list[str], list[tuple[str, str]]]:
    lines: list[str] = []
    svgs: list[tuple[str, str]] = []
    for key in SERVERS + OTHER_SERVERS:
        for doc in store.points(key, "longtail", "soak-"):
            whole = interval(metric(doc, "ttft_s"))
            whole_tpot = interval(metric(doc, "tpot_s"))
            lines += [
                f"### Soak: {LABELS[key]}, {doc['rate']:g} req/s for {doc['duration_s'] / 60:g} min, "
                f"{doc['window_s']:g} s windows (`{doc['name']}`)",
                "",
                "| window s | sent | failed | P99 TTFT s | P99 TPOT ms |",
                "| --- | ---: | ---: | ---: | ---: |",
            ]
            worst = []
            for w in doc["windows"]:
                lines.append(f"| {w['start_s']:g}-{w['end_s']:g} | {w['sent']} | {w['failed']} | {ci(w['ttft_p99'])} "
                             f"| {ci(w['tpot_p99'], 1000, 0)} |")  # fmt: skip
                for name, total in (("ttft_p99", whole), ("tpot_p99", whole_tpot)):
                    if total.value:
                        worst.append(at_most(interval(w[name]), 1.3 * total.value))
            window_v = (
                MISSED if MISSED in worst else (MET if worst and all(v == MET for v in worst) else NOT_ENOUGH)
            )
            lines.append(
                f"| whole run | {doc['figures']['measured']} | {doc['figures']['failed']} | {ci(whole)} | {ci(whole_tpot, 1000, 0)} |"
            )
            kv = doc.get("kv_after") or {}
            used = kv.get(
                "tailserve_kv_blocks_used", kv.get("vllm:kv_cache_usage_perc")
            )  # blocks, or vLLM's share
            rss = doc.get("rss_steady")
            growth = (rss[1] / rss[0] - 1) if rss and rss[0] else None
            errors = doc["figures"]["failed"]
            lines += [
                "",
                verdict_line(
                    "no window's P99 above 1.3x the whole run's",
                    window_v,
                    "each window's P99 interval against 1.3x the whole run's P99 (TTFT and TPOT)",
                ),  # fmt: skip
                verdict_line(
                    "0 errors",
                    MET if errors == 0 else MISSED,
                    f"{errors} failed of {doc['figures']['measured']}"
                    + (f" ({doc['errors'].get('by_kind')})" if errors and doc.get("errors") else ""),
                ),  # fmt: skip
                verdict_line(
                    "0 KV blocks in use after the run",
                    "not exported" if used is None else (MET if used == 0 else MISSED),
                    f"/metrics after the run: {kv or 'nothing exported'}",
                ),  # fmt: skip
                verdict_line(
                    "RSS growth < 5% after warm-up",
                    "-" if growth is None else (MET if growth < 0.05 else MISSED),
                    "-"
                    if not rss
                    else f"{rss[0] / 2**20:.0f} MiB at the end of the first window -> "
                    f"{rss[1] / 2**20:.0f} MiB at the end ({(growth or 0):+.1%}; process group VmRSS from /proc)",
                ),  # fmt: skip
                "",
            ]
            tag = key + doc["name"].removeprefix("soak")  # one plot per saved soak (ts-slo-30min)
            series = [
                plots.Series("P99 TTFT s", [(w["end_s"] / 60, *_tri(w["ttft_p99"])) for w in doc["windows"] if w["ttft_p99"]["value"] is not None]),
            ]  # fmt: skip
            tpot = [plots.Series("P99 TPOT ms", [(w["end_s"] / 60, *_tri(w["tpot_p99"], 1000)) for w in doc["windows"]
                                                  if w["tpot_p99"]["value"] is not None])]  # fmt: skip
            svgs.append(
                (
                    f"soak-{tag}-ttft.svg",
                    plots.chart(f"Soak {LABELS[key]}: P99 TTFT per window", "minutes", "s", series),
                )
            )
            svgs.append(
                (
                    f"soak-{tag}-tpot.svg",
                    plots.chart(f"Soak {LABELS[key]}: P99 TPOT per window", "minutes", "ms", tpot),
                )
            )
            lines += [f"![soak TTFT](soak-{tag}-ttft.svg) ![soak TPOT](soak-{tag}-tpot.svg)", ""]
    return lines, svgs


def _tri(data: dict[str, Any], scale: float = 1.0) -> tuple[float, float | None, float | None]:
    i = interval(data).scaled(scale)
    assert i.value is not None
    return i.value, i.low, i.high


def workload_plots(store: Store, workload: str, slo: dict[str, Any]) -> list[tuple[str, str]]:
    """Goodput and P99 TTFT against offered load per server, CDFs of TTFT and slowdown at 80%."""
    goodput, ttft, cdf_ttft, cdf_slow = [], [], [], []
    for key in servers_in(store, workload):
        points = [
            *store.points(key, workload, "probe-"),
            *(p for n in POINT_ORDER if (p := store.load(key, workload, n))),
        ]
        if not points:
            continue
        goodput.append(plots.Series(LABELS[key], [(p["rate"], *_tri(p["figures"]["goodput_per_s"])) for p in points
                                                  if p["figures"]["goodput_per_s"]["value"] is not None]))  # fmt: skip
        ttft.append(
            plots.Series(
                LABELS[key],
                [(p["rate"], *_tri(metric(p, "ttft_s") or {})) for p in points if metric(p, "ttft_s")],
            )
        )
        at80 = store.load(key, workload, "at-0.8x")
        cal = store.load(key, workload, "calibration")
        if at80 and cal:
            jsonl = store.root / Path(at80["run"]["bench_json"]).with_suffix(".jsonl")
            if jsonl.exists():
                c = Calibration(cal["intercept_s"], cal["per_token_s"], cal["idle_tpot_s"])
                values = metric_values(read_rows(jsonl), c)
                cdf_ttft.append(plots.cdf_series(f"{LABELS[key]} @ {at80['rate']:g}", values["ttft_s"]))
                cdf_slow.append(plots.cdf_series(f"{LABELS[key]} @ {at80['rate']:g}", values["slowdown"]))
    w = workload
    return [
        (
            f"{w}-goodput.svg",
            plots.chart(f"{w}: goodput vs offered load", "offered req/s", "goodput req/s", goodput),
        ),
        (
            f"{w}-p99-ttft.svg",
            plots.chart(
                f"{w}: P99 TTFT vs offered load",
                "offered req/s",
                "s",
                ttft,
                (slo["ttft_s"], f"SLO {slo['ttft_s']:g} s"),
            ),
        ),  # fmt: skip
        (
            f"{w}-cdf-ttft.svg",
            plots.chart(f"{w}: TTFT CDF at 80% of each server's capacity", "TTFT s", "fraction", cdf_ttft),
        ),
        (
            f"{w}-cdf-slowdown.svg",
            plots.chart(f"{w}: slowdown CDF at 80% of capacity", "TTFT / idle TTFT", "fraction", cdf_slow),
        ),
    ]


def render(store: Store) -> tuple[str, list[tuple[str, str]]]:
    run = store.load("run") or {}
    sizes = run.get("sizes", {})
    scale = float(run.get("length_scale", 1.0))
    workloads = scaled_workloads(scale)
    invocations = run.get("invocations", [])
    out = [
        "# tailserve vs vLLM's CPU engine, llama.cpp and transformers serve, with intervals",
        "",
        "Generated by `benchmarks/compare_engines.py` from `" + str(store.root) + "`.",
        "",
        *(
            f"- `{i['command']}` at {i['at']} on {i['machine']}, commit {i['git_commit']}, load average {i['load']}"
            for i in invocations
        ),
        f"- {run.get('threads', '?')} CPU threads for every server; seed {run.get('seed', '?')}"
        + (
            f"; every prompt and output length x{scale:g} of the issue's shapes (`--length-scale`), so that "
            "each point's requests fit in minutes on this machine"
            if scale != 1
            else ""
        )
        + ("; **quick run: sizes too small for any verdict**" if run.get("quick") else ""),
        f"- every rate point {sizes.get('point_requests')} measured requests, every capacity probe "
        f"{sizes.get('probe_requests')} (after {sizes.get('warmup_requests')} warm-up requests each); 368 is the "
        "fewest whose P99 has a bounded 95% interval (binomial order statistics), so a P99 of fewer is open above",
        "- intervals: 95%, distribution-free (order statistics) for percentiles, Wilson for goodput's met fraction; "
        "P99/mean shows the P99's interval over the mean. Verdicts: MET / MISSED when the interval lies on one side "
        "of the bound, **not enough data** when it straddles it or is open",
        "- capacity: the highest probed rate whose P99 TTFT and P99 TPOT have the *upper ends* of their intervals "
        "within the SLO, with at most 1% errors (429s count): conservative, it understates every server alike",
        (
            "- capacity probes: one prompt sequence for every probe of every server (common random numbers; "
            "a workload with the prefix cache on draws each probe's own), sent faster or slower, so a "
            "collision of long prompts that fails one server's probe is in every other server's probes too"
            if run.get("probe_prompts") == "common"
            else "- capacity probes: each draws its own prompt sequence (seeded by its name; a folder from "
            "before common probe prompts), so two servers' probes at different rates met different collisions"
        ),
        "",
    ]
    svgs: list[tuple[str, str]] = []
    for name, workload in workloads.items():
        slo = store.load(f"slo-{name}")
        if slo is None:
            continue
        out += [
            f"## {workload.title}",
            "",
            f"SLO: P99 TTFT <= {slo['ttft_s']:g} s, P99 TPOT <= {slo['tpot_s'] * 1000:g} ms, errors <= "
            f"{slo['error_rate']:.0%}. {slo['basis']}.",
            "",
            *(
                [
                    "Prefix caching is on for every server that has it (flags below): the idle line is of "
                    "uncached prompts, so a mostly cached prompt shows slowdown < 1 and a negative queue delay; "
                    "`cached prompt` is the share of prompt tokens the server reported cached.",
                    "",
                ]
                if workload.prefix_caching
                else []
            ),
            "### Calibration (idle, one request at a time)",
            *calibration_table(store, name),
            "",
            "### Capacity",
            *capacity_table(store, name),
            "",
            "### Every capacity probe (each a full run; highest rate first)",
            *probe_rows(store, name),
            "",
            "### Same rate, same prompts (runs of tailserve (slo), probes or rate points, replayed on another server)",
            *same_prompts_table(store, name),
            "",
            "### Interleaved rounds (servers up together, runs alternating A B, B A, ...)",
            *rounds_table(store, name),
            "",
            "### Rate points",
            *point_rows(store, name),
            "",
            "### Same offered load for every server",
            *reference_table(store, name),
            "",
            "### Overload",
            *overload_table(store, name),
            "",
            "### Targets",
            *targets(store, name),
            "",
        ]
        figures = workload_plots(store, name, slo)
        svgs += figures
        out += [" ".join(f"![{f}]({f})" for f, _ in figures), ""]
    out += [REPRODUCE]
    soak_lines, soak_svgs = soak_section(store)
    if soak_lines:
        out += ["## Soak", "", *soak_lines]
    svgs += soak_svgs
    out += ["## Servers and flags", ""]
    for name in workloads:
        for key in servers_in(store, name):
            doc = store.load(key, name, "points") or store.load(key, name, "calibration") or {}
            if server := doc.get("server"):
                out += [f"- {LABELS[key]}, {name}: {server['notes']}. `{server['command']}`"]
    return "\n".join(out).rstrip() + "\n", svgs


def write(store: Store, doc: Path | None = None) -> Path:
    """DIR/report/compare.md (+ .html with the plots inline, + the SVGs); `doc` gets the markdown too."""
    text, svgs = render(store)
    folder = store.folder("report")
    folder.mkdir(parents=True, exist_ok=True)
    for name, svg in svgs:
        (folder / name).write_text(svg)
    (folder / "compare.md").write_text(text)
    body = [f"<pre>{html.escape(text)}</pre>", *(svg for _, svg in svgs)]
    (folder / "compare.html").write_text(
        "<!doctype html><meta charset=utf-8><title>compare</title>\n" + "\n".join(body)
    )
    if doc is not None:  # a hand-written analysis section of the old document survives
        old = doc.read_text() if doc.exists() else ""
        kept = old[old.index(ANALYSIS_HEADING) :] if ANALYSIS_HEADING in old else ""
        doc.write_text(text + ("\n" + kept if kept else ""))
    store.log(f"report: {folder / 'compare.md'}")
    return folder / "compare.md"
