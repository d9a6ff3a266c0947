"""Measuring the servers: start one, warm it up, then either calibrate it (idle TTFT against prompt
length, idle TPOT) or search its capacity under the SLO and run its rate points; and the soak.
Every finished `tailserve bench` run is analysed and saved as its point at once (store.py), and a
point already saved is never run again, so an interrupted comparison resumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
import urllib.request
import zlib
from pathlib import Path
from typing import Any

from loadgen import run_bench
from machine import cpu_shares, cpu_times
from peers import launch
from peers.envs import HF_DIR, ROOT
from peers.launch import Limits, ServerSpec
from proc import ServerProcess, free_port

from compare import plan as planning
from compare.analyze import (
    BENCH_CALIBRATION,
    BENCH_SERVER_SAMPLES,
    Calibration,
    Slo,
    analyze,
    calibration_from,
    dig,
    passes,
    read_rows,
    windows,
)
from compare.plan import Sizes, Workload
from compare.store import Store

REFERENCE = "ts-slo"  # its capacity sets the shared reference rate, so it is measured first
SERVERS = ("ts-slo", "ts-fcfs", "vllm", "llamacpp", "hf-cb")  # the order they run in
# tailserve (slo) variants for A/Bs: key -> (extra flags, label)
TS_VARIANTS = {
    # the A/B of --switch-interval-ms (default 5)
    "ts-slo-gil05": (("--switch-interval-ms", "0.5"), "tailserve (slo, GIL switch 0.5 ms)"),
    # the A/B of --urgent-slack (default 0.25)
    "ts-slo-edf": (("--urgent-slack", "1"), "tailserve (slo, deadline order)"),
    # the A/B of the TPOT cap on prefill: --prefill-floor 1 keeps every step's whole budget for prompts
    "ts-slo-nocap": (("--prefill-floor", "1"), "tailserve (slo, no TPOT cap on prefill)"),
    # the server plans to a tighter TPOT target than the one it is judged by (argparse: last wins)
    "ts-slo-tpot80": (("--slo-tpot", "0.08"), "tailserve (slo, plans to a TPOT of 80 ms)"),
    "ts-slo-tpot90": (("--slo-tpot", "0.09"), "tailserve (slo, plans to a TPOT of 90 ms)"),
    # the A/B of admission's learned correction of the engine's TTFT predictions
    "ts-slo-rawadm": (("--no-admission-correction",), "tailserve (slo, admission on raw predictions)"),
    # the A/B of creating every prompt-row kernel before /ready (docs/ENGINE.md "Prompt-row kernels")
    "ts-slo-nowarm": (("--no-kernel-warmup",), "tailserve (slo, prompt-row kernels compiled on first use)"),
}
OTHER_SERVERS = ("llamacpp-1t", "hf", *TS_VARIANTS)  # known, not run unless asked
CALIBRATION_LENGTHS = (64, 512, 1024)  # plus the workload's longest prompt
CALIBRATION_OUTPUT = 32


@dataclasses.dataclass(frozen=True)
class Context:
    """What every measurement shares."""

    store: Store
    sizes: Sizes
    seed: int
    limits: Limits
    gguf: Path
    # Every capacity probe of every server sends one prompt sequence (seed COMMON_PROBE_PROMPTS),
    # only faster or slower: a collision of long prompts then falls on every probe and server alike
    # (common random numbers). Not for a workload with the prefix cache on, whose next probe would
    # find its prompts cached; False in folders whose probes each drew their own (older runs).
    common_probes: bool = False


COMMON_PROBE_PROMPTS = "probe"


def prompts_of(doc: dict[str, Any]) -> str:
    """The name whose seed drew a saved point's prompts (its own name unless it says otherwise)."""
    return str(doc.get("prompts_of") or doc.get("replay_of") or doc["name"])


def server_spec(
    key: str, workload: Workload, port: int, gguf: Path, limits: Limits, slo: Slo | None
) -> ServerSpec:
    """The command line of one server for one workload (prefix caching as the workload asks)."""
    cache = workload.prefix_caching
    if key in ("ts-slo", "ts-fcfs"):
        targets = (slo.ttft_s, slo.tpot_s) if slo else None
        return launch.tailserve(key.removeprefix("ts-"), port, limits, targets, prefix_caching=cache)
    if key in TS_VARIANTS:
        targets = (slo.ttft_s, slo.tpot_s) if slo else None
        flags, label = TS_VARIANTS[key]
        return launch.tailserve("slo", port, limits, targets, extra_args=flags, prefix_caching=cache,
                                key=key, label=label)  # fmt: skip
    if key in ("hf", "hf-cb"):
        return launch.transformers_serve(
            port, limits, continuous_batching=key == "hf-cb", prefix_caching=cache
        )
    if key == "llamacpp":
        return launch.llamacpp(port, gguf, limits, prefix_caching=cache)
    if key == "llamacpp-1t":
        one = dataclasses.replace(limits, threads=1)
        return launch.llamacpp(port, gguf, one, key="llamacpp-1t", prefix_caching=cache)
    if key == "vllm":
        return launch.vllm_cpu(port, limits, prefix_caching=cache)
    raise ValueError(f"unknown server {key!r}")


def point_seed(base: int, name: str) -> int:
    """The same prompts for the same point name on every server, different ones across points
    (so no point's prompts sit in a prefix cache from the one before)."""
    return base + zlib.crc32(name.encode()) % 100_000


def request_timeout_s(slo: Slo | None) -> float:
    """Generous: a request is a `timeout` only long after it has missed the SLO."""
    return 300.0 if slo is None else max(60.0, 3 * (slo.ttft_s + 128 * slo.tpot_s))


def bench(
    ctx: Context,
    spec: ServerSpec,
    url: str,
    workload: Workload,
    name: str,
    args: list[str],
    slo: Slo | None,
    deadline_s: float | None = None,
    seed_name: str | None = None,
) -> tuple[dict[str, Any] | None, list[dict[str, Any]], dict[str, Any]]:
    """One `tailserve bench run` of `workload`; returns its result, its rows and the run record."""
    prefix = ctx.store.folder(spec.key, workload.name, "runs", name)
    slo_args = ["--slo-ttft", "off", "--slo-tpot-ms", "off"]
    if slo is not None:
        slo_args = ["--slo-ttft", f"{slo.ttft_s:g}", "--slo-tpot-ms", f"{slo.tpot_s * 1000:g}"]
    full = [
        "--no-calibrate", "--base-url", url, "--tokenizer", str(HF_DIR), "--seed", str(point_seed(ctx.seed, seed_name or name)),
        "--timeout", f"{request_timeout_s(slo):g}", *slo_args, "--slo-e2e", "off",
        "--label", f"{spec.label}: {workload.name} {name}", "--extra-body", json.dumps(spec.extra_body),
        *spec.bench_args, *workload.bench_args(), *args,
    ]  # fmt: skip
    done = run_bench(full, prefix, "run", deadline_s=deadline_s)
    jsonl = prefix.with_name(prefix.name + ".jsonl")
    rows = read_rows(jsonl) if jsonl.exists() else []
    record = {
        "bench_json": str(done.json_path.relative_to(ctx.store.root)),
        "exit_code": done.exit_code,
        "wall_s": done.wall_s,
        "load_before": done.load_before,
        "load_after": done.load_after,
        "interrupted": done.interrupted,
        "cpu": done.cpu,
    }
    if done.exit_code not in (0, 3):
        ctx.store.log(
            f"{spec.key}/{workload.name}/{name}: bench exited {done.exit_code}; see {done.log_path}"
        )
    return done.result(), rows, record


def open_loop(workload: Workload, rate: float, sizes: Sizes, requests: int) -> list[str]:
    """Poisson at `rate` requests/s until `requests` measured ones (after the warm-up requests)."""
    return [
        "--arrival", "poisson", "--rate", f"{workload.arrival_rate(rate):.6g}",
        "-n", str(requests + sizes.warmup_requests), "--warmup-requests", str(sizes.warmup_requests), "--no-html",
    ]  # fmt: skip


def warm_up(ctx: Context, spec: ServerSpec, url: str, workload: Workload) -> None:
    """Short and long prompts two at a time, so lazy allocations and first-use paths happen now."""
    args = ["--arrival", "closed", "--concurrency", "2", "-n", "6", "--warmup-requests", "0",
            "--input-len", f"uniform:64,{workload.longest_tokens}", "--output-len", "fixed:16", "--no-html"]  # fmt: skip
    bench(
        ctx, spec, url, dataclasses.replace(workload, turns=1, shared_prefix_tokens=0), "warmup", args, None
    )


def started(
    ctx: Context, key: str, workload: Workload, slo: Slo | None, what: str
) -> tuple[ServerSpec, ServerProcess]:
    port = free_port()
    spec = server_spec(key, workload, port, ctx.gguf, ctx.limits, slo)
    log_path = ctx.store.folder(key, workload.name, f"server-{what}.log")
    return spec, ServerProcess(spec.command, port, log_path, spec.ready_path, spec.env, ROOT)


def start_and_warm(
    ctx: Context, key: str, workload: Workload, spec: ServerSpec, server: ServerProcess
) -> str:
    """Wait for a started server to be ready, then warm it up; "" when it is, else why not (logged)."""
    try:
        server.wait_ready(timeout_s=900)
    except RuntimeError as exc:
        ctx.store.log(f"{key}/{workload.name}: did not start: {exc}")
        return f"did not start: {exc}"
    warm_up(ctx, spec, server.url, workload)
    return ""


def server_record(spec: ServerSpec, server: ServerProcess) -> dict[str, Any]:
    env = " ".join(f"{k}={v}" for k, v in spec.env.items())
    command = " ".join(spec.command).replace(launch.HF_LAUNCH, '"$HF_LAUNCH"')
    return {"label": spec.label, "command": f"{env} {command}", "notes": spec.notes, "ready_s": server.ready_after_s,
            "extra_body": spec.extra_body, "bench_args": spec.bench_args}  # fmt: skip


def calibrate(ctx: Context, key: str, workload: Workload) -> dict[str, Any] | None:
    """Phase 1 for one server and workload: idle TTFT at several prompt lengths, one request at a
    time, fitted as a line; saved as `calibration`. Skipped when already saved."""
    store = ctx.store
    if (saved := store.load(key, workload.name, "calibration")) is not None:
        return saved
    spec, server = started(ctx, key, workload, None, "calibration")
    store.log(f"{key}/{workload.name}: starting {spec.label} to calibrate")
    with server:
        if error := start_and_warm(ctx, key, workload, spec, server):
            store.save({"error": error}, key, workload.name, "failed")
            return None
        cal = bench_calibration(ctx, spec, server.url, workload) or own_calibration(
            ctx, spec, server.url, workload
        )
        if cal is None:
            store.save({"error": "calibration failed: no request succeeded"}, key, workload.name, "failed")
            return None
        doc = {**dataclasses.asdict(cal), "idle_ttft_longest_s": cal.isolated_ttft_s(workload.longest_tokens),
               "server": server_record(spec, server)}  # fmt: skip
    store.save(doc, key, workload.name, "calibration")
    store.log(
        f"{key}/{workload.name}: calibrated: idle TTFT {cal.intercept_s:.3f} s + {cal.per_token_s * 1000:.3f} ms/token "
        f"(longest prompt {doc['idle_ttft_longest_s']:.2f} s), idle TPOT {cal.idle_tpot_s * 1000:.1f} ms"
    )
    return doc


def bench_calibration(ctx: Context, spec: ServerSpec, url: str, workload: Workload) -> Calibration | None:
    """`tailserve bench`'s own calibration phase (idle TTFT at quantiles of the prompt lengths,
    max_tokens 1, fitted as a line) over the workload's range, then 3 requests one at a time for the
    idle TPOT. None when the bench wrote no fit."""
    single = dataclasses.replace(
        workload, turns=1, shared_prefix_tokens=0, input_len=workload.calibration_len
    )
    args = ["--calibrate", "--calibration-repeats", str(ctx.sizes.calibration_requests), "--arrival", "closed",
            "--concurrency", "1", "-n", "3", "--warmup-requests", "0", "--output-len", f"fixed:{CALIBRATION_OUTPUT}",
            "--no-html"]  # fmt: skip
    result, rows, _ = bench(ctx, spec, url, single, "calibration", args, None)
    section = dig(result, BENCH_CALIBRATION) or {}
    fit = section.get("fit")
    tpots = [float(r["tpot_s"]) for r in rows if r.get("ok") and r.get("tpot_s") is not None]
    if not fit or not tpots:
        return None
    points = tuple((int(m["input_tokens"]), float(m["ttft_s"])) for m in section.get("medians", []))
    return Calibration(
        float(fit["intercept_s"]), float(fit["slope_s_per_token"]), sum(tpots) / len(tpots), points
    )


def own_calibration(ctx: Context, spec: ServerSpec, url: str, workload: Workload) -> Calibration | None:
    """The same line from closed-loop runs at fixed prompt lengths (for a bench without the phase)."""
    rows: list[dict[str, Any]] = []
    single = dataclasses.replace(workload, turns=1, shared_prefix_tokens=0)
    for n in (*CALIBRATION_LENGTHS, workload.longest_tokens):
        args = ["--arrival", "closed", "--concurrency", "1", "-n", str(ctx.sizes.calibration_requests),
                "--warmup-requests", "0", "--input-len", f"fixed:{n}",
                "--output-len", f"fixed:{CALIBRATION_OUTPUT}", "--no-html"]  # fmt: skip
        rows += bench(ctx, spec, url, single, f"calibration-{n}", args, None)[1]
    try:
        return calibration_from(rows)
    except ValueError:
        return None


def calibration_of(doc: dict[str, Any]) -> Calibration:
    return Calibration(
        doc["intercept_s"], doc["per_token_s"], doc["idle_tpot_s"], tuple(map(tuple, doc["points"]))
    )


def run_point(
    ctx: Context, spec: ServerSpec, url: str, workload: Workload, slo: Slo, cal: Calibration,
    name: str, rate: float, requests: int, why: str, replay_of: str | None = None,
    extra: dict[str, Any] | None = None, prompts: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One rate point or probe: run, analyse, save (unless saved already). `replay_of`: the name of
    the point it replays; `prompts`: the name whose seed draws its prompts, when that is not its own
    (default: `replay_of`'s); `extra`: fields saved with it."""
    store = ctx.store
    if (saved := store.load(spec.key, workload.name, name)) is not None:
        return saved
    store.log(f"{spec.key}/{workload.name}: {name} at {rate:g} req/s ({requests} measured requests, ~"
              f"{planning.expected_s(requests + ctx.sizes.warmup_requests, rate) / 60:.1f} min)")  # fmt: skip
    result, rows, record = bench(
        ctx,
        spec,
        url,
        workload,
        name,
        open_loop(workload, rate, ctx.sizes, requests),
        slo,
        seed_name=prompts or replay_of,
    )
    figures = analyze(rows, result, slo, cal)
    ok, reason = passes(figures, slo, conservative=ctx.sizes.conservative)
    doc = {"name": name, "rate": rate, "why": why, "requests": requests, "passed": ok, "fail_reason": reason,
           "figures": figures, "run": record, "client": (result or {}).get("client")}  # fmt: skip
    if replay_of:
        doc["replay_of"] = replay_of
    if prompts or replay_of:
        doc["prompts_of"] = prompts or replay_of
    doc.update(extra or {})
    store.save(doc, spec.key, workload.name, name)
    store.log(f"{spec.key}/{workload.name}: {name} {'pass' if ok else 'FAIL: ' + reason}")
    return doc


def search(
    ctx: Context, spec: ServerSpec, url: str, workload: Workload, slo: Slo, cal_doc: dict[str, Any],
    rate_max: float, drain_s: float,
) -> tuple[list[tuple[float, bool]], float, str]:  # fmt: skip
    """The capacity search: probes of `probe_requests` each (saved ones are reused), ramping from
    `--rate-start` or else twice one stream's service rate, then bisecting. Returns the probes
    (rate, passed), the seconds they took and why it stopped early ("" when it did not)."""
    store, sizes, cal = ctx.store, ctx.sizes, calibration_of(cal_doc)
    saved = store.points(spec.key, workload.name, "probe-")
    probes = [(p["rate"], bool(p["passed"])) for p in saved]
    spent = sum(p["run"]["wall_s"] for p in saved)
    if cal_doc["idle_ttft_longest_s"] > slo.ttft_s:  # its longest prompts miss the target even alone
        return probes, spent, (
            f"no search: idle TTFT of the longest prompt {cal_doc['idle_ttft_longest_s']:.2f} s > the "
            f"{slo.ttft_s:g} s target"
        )  # fmt: skip
    prompt, output = workload.typical
    start = sizes.start_for(spec.key) or planning.search_start(
        cal.isolated_ttft_s(prompt) + output * cal.idle_tpot_s
    )
    while (rate := planning.next_probe(probes, start, sizes.growth, sizes.tolerance, sizes.max_probes, rate_max)) is not None:  # fmt: skip
        cost = planning.expected_s(sizes.probe_requests + sizes.warmup_requests, rate, drain_s)
        if spent + cost > sizes.budget_s:
            return (
                probes,
                spent,
                f"search stopped: a probe at {rate:g} req/s would take ~{cost / 60:.0f} min, past the budget",
            )
        name = f"probe-{len(probes) + 1:02d}"
        common = COMMON_PROBE_PROMPTS if ctx.common_probes and not workload.prefix_caching else None
        doc = run_point(ctx, spec, url, workload, slo, cal, name, rate, sizes.probe_requests,
                        "capacity probe", prompts=common)  # fmt: skip
        probes.append((rate, bool(doc["passed"])))
        spent += doc["run"]["wall_s"]
    return probes, spent, ""


def measure(
    ctx: Context,
    key: str,
    workload: Workload,
    slo: Slo,
    reference_rate: float | None,
    rate_max: float,
    search_only: bool = False,
) -> float | None:
    """Phase 2 for one server and workload: the capacity search (probes of `probe_requests`, judged
    by the P99s' upper ends), then the rate points that fit its budget. Returns its capacity (None
    when it could not be measured). Starts the server only if something is left to run."""
    store, sizes = ctx.store, ctx.sizes
    cal_doc = store.load(key, workload.name, "calibration")
    if cal_doc is None:
        return None
    if (done := store.load(key, workload.name, "points")) is not None and done.get("complete"):
        return float(done["capacity"])
    cal = calibration_of(cal_doc)
    drain_s = cal_doc["idle_ttft_longest_s"] + 128 * cal.idle_tpot_s
    spec, server = started(ctx, key, workload, slo, "measure")
    store.log(f"{key}/{workload.name}: starting {spec.label}")
    with server:
        if start_and_warm(ctx, key, workload, spec, server):
            return None
        probes, spent, note = search(ctx, spec, server.url, workload, slo, cal_doc, rate_max, drain_s)
        if note:
            store.log(f"{key}/{workload.name}: {note}")
        capacity, above = planning.capacity_bracket(probes)
        if capacity and above is None and not note:
            note = f"no probe failed up to {capacity:g} req/s (probe limit or --rate-max): capacity is a lower bound"
        store.log(f"{key}/{workload.name}: capacity {capacity:g} req/s (next failing probe: {above})")
        ref = None if key == REFERENCE else reference_rate
        kept, dropped = planning.rate_points(capacity, ref, sizes, drain_s, spent)
        if search_only:  # --search-only: every rate point is left out, and listed as such
            cost = sizes.point_requests + sizes.warmup_requests
            dropped = [(p, planning.expected_s(cost, p.rate, drain_s)) for p in kept] + dropped
            kept = []
        for point in kept:
            run_point(
                ctx,
                spec,
                server.url,
                workload,
                slo,
                cal,
                point.name,
                point.rate,
                sizes.point_requests,
                point.why,
            )
        summary = {
            "capacity": capacity,
            "capacity_bracket": [capacity, above],
            "search_note": note,
            "probes": [[r, ok] for r, ok in probes],
            "kept": [dataclasses.asdict(p) for p in kept],
            "dropped": [{**dataclasses.asdict(p), "would_take_s": s} for p, s in dropped],
            "server": server_record(spec, server),
            "complete": True,
        }
    store.save(summary, key, workload.name, "points")
    if dropped:
        store.log(f"{key}/{workload.name}: left out (budget): {', '.join(p.name for p, _ in dropped)}")
    return capacity


def replay_name(source: str, probe: str) -> str:
    return f"replay-{source}-{probe}"


def source_points(store: Store, source: str, workload: str, names: list[str]) -> list[dict[str, Any]]:
    """What a replay runs again: `source`'s saved probes, or the saved runs named (probes or rate
    points such as at-0.8x: anything saved with a rate)."""
    if not names:
        return store.points(source, workload, "probe-")
    docs = [store.load(source, workload, n) for n in names]
    return [d for d in docs if d is not None and "rate" in d and "name" in d]


def replay(ctx: Context, key: str, workload: Workload, slo: Slo, source: str, names: list[str]) -> None:
    """Run server `key` at the rates of `source`'s saved probes (all of them, or the saved runs in
    `names`, rate points too) with the same prompts (their seeds): two servers measured on the same offered load, request for request.
    Saved as `replay-SOURCE-PROBE`, apart from the server's own probes (its search never reads them)."""
    store, sizes = ctx.store, ctx.sizes
    cal_doc = store.load(key, workload.name, "calibration")
    probes = source_points(store, source, workload.name, names)
    todo = [p for p in probes if not store.has(key, workload.name, replay_name(source, p["name"]))]
    if cal_doc is None or not todo:
        store.log(
            f"{key}/{workload.name}: replay of {source}: {'nothing left' if cal_doc else 'not calibrated'}"
        )
        return
    spec, server = started(ctx, key, workload, slo, f"replay-{source}")
    store.log(f"{key}/{workload.name}: starting {spec.label} to replay {source}'s probes")
    with server:
        if start_and_warm(ctx, key, workload, spec, server):
            return
        for p in todo:
            run_point(ctx, spec, server.url, workload, slo, calibration_of(cal_doc), replay_name(source, p["name"]),
                      p["rate"], sizes.probe_requests, f"{source}'s {p['name']} replayed (same rate, same prompts)",
                      replay_of=p["name"], prompts=prompts_of(p))  # fmt: skip


def rounds_name(source: str, probe: str, round_no: int) -> str:
    return f"rounds-{source}-{probe}-r{round_no}"


def round_prompts(probe: dict[str, Any], round_no: int, workload: Workload) -> str:
    """The name whose seed draws a round's prompts: the probe's own in every round, except on a
    workload with prefix caching, where round 2 on draws its own conversations. Servers stay up
    between rounds, and a replayed conversation would find its history in the cache from the round
    before (largest TTFT 0.15-0.46 s in such a round against 0.99-1.53 s in the first). Every server
    of a round still gets the same prompts."""
    own = prompts_of(probe)
    return own if round_no == 1 or not workload.prefix_caching else f"{own}-round{round_no}"


def rounds_todo(
    store: Store, keys: list[str], workload: str, source: str, names: list[str], rounds: int
) -> list[tuple[int, dict[str, Any], str]]:
    """The interleaved runs not saved yet, in the order they run: per probe of `source` (all, or
    `names`), round 1 in the order of `keys`, round 2 reversed, and so on: (round, probe, server)."""
    probes = source_points(store, source, workload, names)
    return [
        (r, p, k)
        for p in probes
        for r in range(1, rounds + 1)
        for k in (keys if r % 2 else list(reversed(keys)))
        if not store.has(k, workload, rounds_name(source, p["name"], r))
    ]


IDLE_SAMPLE_S = 3.0  # the machine's CPU shares with every server idle, before each interleaved run


def interleave(
    ctx: Context, keys: list[str], workload: Workload, slo: Slo, source: str, names: list[str], rounds: int
) -> None:
    """Interleaved repeats (`--replay SOURCE --rounds N`): every server in `keys` started and warmed up
    at once, then each of `source`'s probes (all, or `names`) run `rounds` times on each server in
    alternating order (A B, B A, ...), same rate and prompts (on a prefix-caching workload, new
    conversations from round 2 on: `round_prompts`). The machine's drift (CPU steal moves on a
    scale of minutes) then falls on every server alike, and a verdict between two servers can ask for
    the same answer in every round. Before each run the idle servers' draw on the machine is sampled
    for IDLE_SAMPLE_S and saved with it. Saved as `rounds-SOURCE-PROBE-rN`; a saved one is not rerun."""
    store = ctx.store
    cals = {k: store.load(k, workload.name, "calibration") for k in keys}
    todo = rounds_todo(store, [k for k in keys if cals[k] is not None], workload.name, source, names, rounds)
    if not todo:
        store.log(f"{workload.name}: interleaved rounds of {source}'s probes: nothing left")
        return
    with contextlib.ExitStack() as stack:
        urls: dict[str, tuple[ServerSpec, str]] = {}
        for key in dict.fromkeys(k for _, _, k in todo):
            spec, server = started(ctx, key, workload, slo, f"rounds-{source}")
            store.log(f"{key}/{workload.name}: starting {spec.label} for interleaved rounds")
            stack.enter_context(server)
            if start_and_warm(ctx, key, workload, spec, server):
                return
            urls[key] = (spec, server.url)
        for round_no, probe, key in todo:
            spec, url = urls[key]
            cal = cals[key]
            assert cal is not None  # todo holds calibrated servers only
            before = cpu_times()
            time.sleep(IDLE_SAMPLE_S)
            idle_draw = cpu_shares(before, cpu_times())
            name = rounds_name(source, probe["name"], round_no)
            run_point(ctx, spec, url, workload, slo, calibration_of(cal), name, probe["rate"],
                      ctx.sizes.probe_requests, f"{source}'s {probe['name']}, interleaved round {round_no}",
                      replay_of=probe["name"], prompts=round_prompts(probe, round_no, workload), extra={"rounds_of": source, "round": round_no,
                      "idle_draw": idle_draw, "servers_up": sorted(urls)})  # fmt: skip


class RssSampler:
    """Resident memory of a server's whole process group (vLLM and transformers fork workers),
    read from /proc every `every_s` on a thread: [(seconds since start, bytes)]."""

    def __init__(self, pgid: int, every_s: float) -> None:
        self.pgid, self.every_s = pgid, every_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - self._t0, group_rss_bytes(self.pgid)))
            self._stop.wait(self.every_s)


def group_rss_bytes(pgid: int) -> int:
    """Sum of VmRSS over the processes of process group `pgid`."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # after the command: state, ppid, pgrp
                continue
            status = stat.with_name("status").read_text()
        except (OSError, IndexError, ValueError):
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


KV_METRICS = (
    "tailserve_kv_blocks_used",
    "tailserve_kv_blocks_capacity",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "process_resident_memory_bytes",
)


def kv_in_use(url: str) -> dict[str, float]:
    """KV figures the server exports on /metrics (tailserve's blocks, vLLM's usage), else {}."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            return prometheus_values(response.read().decode(), KV_METRICS)
    except OSError:
        return {}


def prometheus_values(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The named samples of a Prometheus text page, summed over their labels."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names and not line.startswith("#"):
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def soak(
    ctx: Context, key: str, workload: Workload, slo: Slo, rate: float, duration_s: float, window_s: float
) -> dict[str, Any]:
    """`tailserve bench` at `rate` for `duration_s`: windowed P99s with intervals, errors, KV in use
    after the run, server RSS at the start and end of the steady state (the first window is warm-up)."""
    store = ctx.store
    name = f"soak-{duration_s / 60:g}min"
    if (saved := store.load(key, workload.name, name)) is not None:
        return saved
    cal_doc = store.load(key, workload.name, "calibration")
    cal = calibration_of(cal_doc) if cal_doc else None
    spec, server = started(ctx, key, workload, slo, "soak")
    store.log(
        f"{key}/{workload.name}: soak at {rate:g} req/s for {duration_s / 60:g} min, {window_s:g} s windows"
    )
    with server:
        server.wait_ready(timeout_s=900)
        warm_up(ctx, spec, server.url, workload)
        assert server.proc is not None
        args = ["--arrival", "poisson", "--rate", f"{workload.arrival_rate(rate):.6g}", "--duration", f"{duration_s:g}",
                "--warmup", "0", "--window", f"{window_s:g}"]  # fmt: skip
        with RssSampler(server.proc.pid, every_s=min(30.0, window_s / 4)) as rss:
            result, rows, record = bench(ctx, spec, server.url, workload, name, args, slo)
        time.sleep(5)  # let the last requests' blocks return
        kv = kv_in_use(server.url)
    figures = analyze(rows, result, slo, cal)
    rows_by_window = windows(rows, window_s)
    steady = [s for s in rss.samples if s[0] >= window_s and s[0] <= duration_s]
    doc = {
        "name": name, "rate": rate, "duration_s": duration_s, "window_s": window_s, "figures": figures,
        "windows": rows_by_window, "kv_after": kv, "rss_samples": rss.samples,
        "rss_steady": [steady[0][1], steady[-1][1]] if steady else None, "run": record,
        "errors": (result or {}).get("errors"), "server": server_record(spec, server),
        "bench_server_samples": dig(result, BENCH_SERVER_SAMPLES),
    }  # fmt: skip
    store.save(doc, key, workload.name, name)
    store.log(
        f"{key}/{workload.name}: soak done ({figures['measured']} measured, {figures['failed']} failed)"
    )
    return doc
