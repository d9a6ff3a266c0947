"""The engine's border with admission: what a newcomer would cost, priced once, and its stream.

AsyncEngine.submit prices a request (WaitQuote), lets the caller's admission decide on that price,
and queues it only if admitted (Admitted). It never decides admission itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from tailserve.engine.request import RequestOutput
from tailserve.engine.tpot_model import TpotPrice

T = TypeVar("T")


@dataclass(frozen=True)
class WaitQuote:
    """A newcomer's price, computed once at submit and used both to admit and to queue it."""

    work_tokens: int  # prompt tokens it would compute: the prompt less the prefix cached now
    ttft_s: float  # its TTFT target: its slo's, else --slo-ttft
    predicted_wait_s: float  # its TTFT predicted now: the work queued ahead of it, then its own prefill
    alone_s: float = 0.0  # its own prefill at today's load: the TTFT with nothing queued ahead
    tpot: TpotPrice | None = (
        None  # every stream's predicted TPOT with it and without it; None: not yet priced
    )

    @property
    def queued(self) -> bool:
        """Whether work is predicted ahead of it (else it starts with the next step)."""
        return self.predicted_wait_s > self.alone_s


@dataclass(frozen=True)
class Admitted(Generic[T]):
    """A request admission let in: the admission's own record of it and the request's outputs
    (a RequestOutput per step, the last finished; the engine's refusal raised on first iteration)."""

    ticket: T
    stream: AsyncIterator[RequestOutput]
