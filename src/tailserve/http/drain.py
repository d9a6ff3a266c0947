"""Graceful drain state shared by the server and the router: in-flight count, draining, the deadline.

`begin()` stops admission; `wait_idle()` waits for in-flight work; `close_streams()` marks the drain
deadline, at which every open response ends itself (an SSE error event and [DONE], or a 503).
Event-loop thread only; it never cancels a task itself.
"""

from __future__ import annotations

import asyncio
import contextlib


class Drain:
    """Counts in-flight requests and carries the two shutdown moments (drain start, deadline)."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.closing = asyncio.Event()  # set at the drain deadline: open responses end now

    def enter(self) -> None:
        """One more request in flight."""
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        """A request finished (exactly once per enter)."""
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def begin(self) -> None:
        """Stop admitting: every new request gets 503 from now on."""
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when every in-flight request finished within timeout_s."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        return self.in_flight == 0

    def close_streams(self) -> None:
        """The deadline passed: tell every open response to end now."""
        self.draining = True
        self.closing.set()
