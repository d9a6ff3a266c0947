"""Background checks of every replica: /ready for health (with thresholds), /metrics for load.

Both loops only read replicas and report into the pool; a slow or dead replica never delays the
checks of the others (each round runs concurrently, each call bounded by a timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import httpx

from tailserve.router.config import RouterConfig
from tailserve.router.load import snapshot_from_metrics
from tailserve.router.pool import Replica, ReplicaPool


class ReplicaMonitor:
    """Runs the health and load loops of one router until stopped."""

    def __init__(self, config: RouterConfig, pool: ReplicaPool, client: httpx.AsyncClient) -> None:
        self._config = config
        self._pool = pool
        self._client = client
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Check every replica once (so the router starts knowing who is up), then loop."""
        results = await asyncio.gather(*(self._ready(r) for r in self._pool.replicas))
        for replica, (ready, _) in zip(self._pool.replicas, results, strict=True):
            self._pool.set_initial(replica, ready)
        await self.read_loads()
        self._tasks = [
            asyncio.create_task(self._every(self._config.health_interval_s, self.check_health)),
            asyncio.create_task(self._every(self._config.load_interval_s, self.read_loads)),
        ]

    async def stop(self) -> None:
        """Cancel the loops and wait for them to end."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def check_health(self) -> None:
        """One round of /ready checks, folded into the pool with its thresholds."""
        results = await asyncio.gather(*(self._ready(r) for r in self._pool.replicas))
        for replica, (ready, detail) in zip(self._pool.replicas, results, strict=True):
            self._pool.record_check(replica, ready, detail)

    async def read_loads(self) -> None:
        """One round of /metrics reads from the healthy replicas."""
        await asyncio.gather(*(self._read_load(r) for r in self._pool.healthy()))

    async def _every(self, interval_s: float, round_fn: Callable[[], Awaitable[None]]) -> None:
        while True:
            started = time.monotonic()
            await round_fn()
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))

    async def _ready(self, replica: Replica) -> tuple[bool, str]:
        try:
            response = await self._client.get(replica.url + "/ready", timeout=self._config.health_timeout_s)
        except httpx.HTTPError as exc:
            return False, f"/ready failed: {exc!r}"
        if response.status_code != 200:
            return False, f"/ready answered {response.status_code}"
        return True, ""

    async def _read_load(self, replica: Replica) -> None:
        try:
            response = await self._client.get(replica.url + "/metrics", timeout=self._config.health_timeout_s)
        except httpx.HTTPError:
            return  # health checks decide about failures; an old snapshot just goes stale
        if response.status_code == 200:
            replica.snapshot = snapshot_from_metrics(response.text, replica.in_flight, time.monotonic())
