"""Capacity across prompt draws: several results folders, each a capacity search on its own common
prompt sequence (`--seed N`), read together.

One folder's capacity is one draw. Under the conservative rule a probe passes only when the upper
ends of its P99 intervals meet the SLO, and at 368 requests that upper end is the largest value:
the capacity is set by the draw's single worst request, so it moves with where the draw's long
prompts fall. This table puts the draws side by side, under the conservative rule and under the
point P99 (the same probes judged again), with each draw's ratio of tailserve (slo) to the best
peer, the bracket the searches leave around it, and a verdict over all draws.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from compare.analyze import Slo, passes
from compare.report import LABELS
from compare.run import OTHER_SERVERS, REFERENCE, SERVERS
from compare.stats import MET, MISSED, NOT_ENOUGH
from compare.store import Store

RULES = (("upper", True), ("point", False))  # (name, conservative)


def capacity_of(probes: Sequence[dict[str, Any]], slo: Slo, conservative: bool) -> tuple[float, float | None]:
    """(the highest passing probed rate, the lowest failing probe above it or None) with every probe
    judged again by `conservative`; (0, lowest failing) when none passed."""
    verdicts = [(float(p["rate"]), passes(p["figures"], slo, conservative)[0]) for p in probes]
    best = max((rate for rate, ok in verdicts if ok), default=0.0)
    above = [rate for rate, ok in verdicts if not ok and rate > best]
    return best, min(above, default=None)


def ratio_bracket(
    ours: tuple[float, float | None], peer: tuple[float, float | None]
) -> tuple[float, float, float]:
    """Our capacity over the peer's, with the range the two searches' brackets allow: from ours over
    the peer's next failing rate to our next failing rate over the peer's (0 or inf where a search
    left its side open: nothing failed above the capacity it found)."""
    ratio = ours[0] / peer[0]
    low = ours[0] / peer[1] if peer[1] else 0.0
    high = ours[1] / peer[0] if ours[1] else math.inf
    return ratio, low, high


def draw_verdict(low: float, high: float, bound: float) -> str:
    if low >= bound:
        return MET
    if high < bound:
        return MISSED
    return NOT_ENOUGH


def overall_verdict(verdicts: Sequence[str]) -> str:
    """MET only when every draw met it, MISSED when most draws missed it, else not enough data."""
    if verdicts and all(v == MET for v in verdicts):
        return MET
    if sum(v == MISSED for v in verdicts) * 2 > len(verdicts):
        return MISSED
    return NOT_ENOUGH


def _fmt_cap(cap: tuple[float, float | None]) -> str:
    return f"{cap[0]:.2f} (< {cap[1]:.2f})" if cap[1] else f"{cap[0]:.2f} (none failed above)"


def across_table(stores: Sequence[Store], workload: str = "longtail", bound: float = 1.5) -> list[str]:
    """Markdown: one row per folder (draw), then the ratios' geometric mean and range and the verdict
    over the draws, for each rule."""
    lines = [
        "| draw (folder, seed) | rule | tailserve (slo) req/s (next failing) | best peer | its req/s (next failing) "
        "| ratio [bracket] | draw's verdict |",
        "| --- | --- | ---: | --- | ---: | ---: | --- |",
    ]
    per_rule: dict[str, list[tuple[float, str]]] = {name: [] for name, _ in RULES}
    for store in stores:
        run, saved = store.load("run") or {}, store.load(f"slo-{workload}")
        if saved is None:
            continue
        slo = Slo(**saved)
        where = f"{store.root.name}, seed {run.get('seed', '?')}"
        for name, conservative in RULES:
            caps = {
                key: capacity_of(probes, slo, conservative)
                for key in (*SERVERS, *OTHER_SERVERS)
                if (probes := store.points(key, workload, "probe-"))
            }
            ours = caps.pop(REFERENCE, None)
            peers = {k: c for k, c in caps.items() if not k.startswith("ts-") and c[0] > 0}
            if ours is None or not peers:
                lines.append(
                    f"| {where} | {name} | {_fmt_cap(ours) if ours else '-'} | - | - | - | not enough data |"
                )
                continue
            best = max(peers, key=lambda k: peers[k][0])
            ratio, low, high = ratio_bracket(ours, peers[best])
            verdict = draw_verdict(low, high, bound)
            per_rule[name].append((ratio, verdict))
            lines.append(
                f"| {where} | {name} | {_fmt_cap(ours)} | {LABELS[best]} | {_fmt_cap(peers[best])} "
                f"| {ratio:.2f}x [{f'{low:.2f}' if low else 'open'}, {'open' if math.isinf(high) else f'{high:.2f}'}] "
                f"| {verdict} |"
            )
    lines.append("")
    for name, rows in per_rule.items():
        if not rows:
            continue
        ratios = [r for r, _ in rows]
        verdicts = [v for _, v in rows]
        lines.append(
            f"- {name} rule, {len(rows)} draws: ratios {', '.join(f'{r:.2f}' for r in ratios)}; geometric mean "
            f"{statistics.geometric_mean(ratios):.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x; "
            f"{verdicts.count(MET)} met, {verdicts.count(MISSED)} missed, {verdicts.count(NOT_ENOUGH)} unclear: "
            f"capacity >= {bound:g}x the best peer **{overall_verdict(verdicts)}**"
        )
    return lines
