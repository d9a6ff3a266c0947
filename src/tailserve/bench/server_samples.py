"""Server-side readings from the target's Prometheus `/metrics`: RSS, KV blocks in use, engine busy
time and (tensor parallel) time in all-reduce vs compute.

Sampled at the start, at the end of warm-up and after the run (a soak checks that memory stays flat
and that every KV block came back; the counters' differences give the measured window's busy share
and communication share). Any server without `/metrics`, or without a metric, gives nulls; reading
never fails the run.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from tailserve.bench.client import TargetConfig

RSS_METRIC = "process_resident_memory_bytes"
KV_BLOCKS_METRIC = "tailserve_kv_blocks_used"
BUSY_METRIC = "tailserve_engine_busy_seconds_total"
TP_ALLREDUCE_METRIC = "tailserve_tp_allreduce_seconds_sum"  # rank 0's time in collectives, all steps
TP_COMPUTE_METRIC = "tailserve_tp_compute_seconds_sum"
_METRICS = (RSS_METRIC, KV_BLOCKS_METRIC, BUSY_METRIC, TP_ALLREDUCE_METRIC, TP_COMPUTE_METRIC)
# The engine frees a request's blocks just after its last chunk: let it settle before the end sample.
END_SETTLE_S = 0.5


@dataclass(frozen=True)
class ServerSample:
    """One scrape; `at_s` counts from the start of the run (to within its preflight)."""

    at_s: float
    rss_bytes: float | None
    kv_blocks_used: float | None
    engine_busy_s: float | None = None
    tp_allreduce_s: float | None = None
    tp_compute_s: float | None = None


def parse_gauges(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of each named metric's samples (over labels) in Prometheus text format."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line[: line.index("{")], line[line.rindex("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        if name in names:
            try:
                found[name] = found.get(name, 0.0) + float(rest.split()[0])
            except (ValueError, IndexError):
                continue
    return found


async def scrape(target: TargetConfig, at_s: float) -> ServerSample | None:
    """One sample, or None when `/metrics` does not answer with 200."""
    try:
        async with httpx.AsyncClient(timeout=min(10.0, target.timeout_s)) as http:
            resp = await http.get(target.root + "/metrics", headers=target.headers())
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    g = parse_gauges(resp.text, _METRICS)
    return ServerSample(
        at_s,
        g.get(RSS_METRIC),
        g.get(KV_BLOCKS_METRIC),
        g.get(BUSY_METRIC),
        g.get(TP_ALLREDUCE_METRIC),
        g.get(TP_COMPUTE_METRIC),
    )


def engine_window(first: ServerSample | None, last: ServerSample | None) -> dict[str, float | None] | None:
    """Busy share and tensor-parallel communication share between two samples, from counter deltas."""
    if first is None or last is None or last.at_s <= first.at_s:
        return None

    def delta(name: str) -> float | None:
        a, b = getattr(first, name), getattr(last, name)
        return None if a is None or b is None else max(0.0, b - a)

    wall_s = last.at_s - first.at_s
    busy, comm, compute = delta("engine_busy_s"), delta("tp_allreduce_s"), delta("tp_compute_s")
    if busy is None and comm is None:
        return None
    share = None
    if comm is not None and compute is not None and comm + compute > 0:
        share = comm / (comm + compute)
    return {
        "wall_s": wall_s,
        "busy_s": busy,
        "busy_share": None if busy is None else min(1.0, busy / wall_s),
        "tp_allreduce_s": comm,
        "tp_compute_s": compute,
        "tp_comm_share": share,
    }


class ServerSampler:
    """Takes the three samples around a run; `warmup_end_s` None skips the middle one."""

    def __init__(self, target: TargetConfig, warmup_end_s: float | None) -> None:
        self.target = target
        self.warmup_end_s = warmup_end_s
        self.samples: dict[str, ServerSample | None] = {"start": None, "warmup_end": None, "end": None}
        self._origin = time.perf_counter()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._origin = time.perf_counter()
        self.samples["start"] = await scrape(self.target, 0.0)
        if self.warmup_end_s is not None and self.warmup_end_s > 0:
            self._task = asyncio.create_task(self._at_warmup_end(self.warmup_end_s))

    async def _at_warmup_end(self, at_s: float) -> None:
        await asyncio.sleep(max(0.0, at_s - (time.perf_counter() - self._origin)))
        self.samples["warmup_end"] = await scrape(self.target, time.perf_counter() - self._origin)

    async def finish(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.sleep(END_SETTLE_S)
        self.samples["end"] = await scrape(self.target, time.perf_counter() - self._origin)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: asdict(v) if v else None for k, v in self.samples.items()}
        warm, end = self.samples["warmup_end"], self.samples["end"]
        growth = None
        if warm and end and warm.rss_bytes and end.rss_bytes is not None:
            growth = end.rss_bytes / warm.rss_bytes - 1.0
        out["rss_growth_after_warmup"] = growth
        # The measured window: from the end of warm-up when there was one, else from the start.
        out["engine_window"] = engine_window(warm or self.samples["start"], end)
        return out
