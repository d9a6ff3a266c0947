"""Siblings waiting to share a parent's prompt (n > 1): the requests held back until the parent's
prompt is computed, then started on its blocks through `Scheduler.fork`.

It holds requests and hands them to the scheduler; it never touches the KV cache itself.
"""

from __future__ import annotations

from tailserve.engine.request import Request
from tailserve.engine.scheduler import Scheduler


class ForkWaitlist:
    """Per parent id, the siblings waiting for its prompt; every other request goes to the scheduler."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._waiting: dict[str, list[Request]] = {}

    def add(self, req: Request, parent: Request | None) -> None:
        """Queue `req`, or hold it for `parent` when it may take that prompt's blocks: the same
        prompt under the same cache salt (it shares the parent's blocks)."""
        if (
            parent is not None
            and parent is not req
            and parent.prompt_token_ids == req.prompt_token_ids
            and parent.params.cache_salt == req.params.cache_salt
        ):
            self._waiting.setdefault(parent.request_id, []).append(req)
        else:
            self.scheduler.add(req)

    def start(self, scheduled: list[tuple[Request, int]], now: float) -> None:
        """After a step: the siblings of each parent whose prompt is now computed start on its blocks."""
        for parent, _ in scheduled:
            if parent.request_id in self._waiting and parent.num_computed_tokens >= parent.num_prompt_tokens:
                for child in self._waiting.pop(parent.request_id):
                    child.prompt_logprobs = list(parent.prompt_logprobs)  # same prompt, same scores
                    self.scheduler.fork(parent, child, now)

    def release(self, parent: Request) -> None:
        """The parent ends before its prompt was shared: its siblings queue as ordinary requests."""
        for child in self._waiting.pop(parent.request_id, []):
            self.scheduler.add(child)

    def forget(self, req: Request) -> None:
        """`req` is aborted: it waits for no parent (its own siblings: `release`)."""
        for waiting in self._waiting.values():
            if req in waiting:
                waiting.remove(req)
