"""What the client observed for one request, and the SPEC.md metrics derived from it (seconds).

TTFT = sent -> first token, E2E = sent -> last token, TPOT = (E2E - TTFT) / (tokens - 1). ITL is per
token: a chunk of k tokens splits its gap since the previous token-bearing chunk into k equal gaps;
the extra tokens of the first chunk came with the first token (gap 0)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Failures that mean the target as configured cannot be benchmarked (the run stops early on them).
FATAL_ERROR_KINDS = frozenset({"connect", "auth", "not_found", "malformed_sse"})
PHASES = ("warmup", "measured", "cooldown", "cancelled")


@dataclass
class RequestRecord:
    """One request, filled in by the client while it streams, then classified into a phase."""

    index: int
    conversation: int
    turn: int
    requested_output_tokens: int
    planned_input_tokens: int
    scheduled_s: float | None = None
    sent_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    done_s: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    output_tokens_source: str = "chunks"
    cached_tokens: int | None = None
    finish_reason: str | None = None
    http_status: int | None = None
    retry_after_s: float | None = None
    error_kind: str | None = None
    error_message: str | None = None
    server_timings: dict[str, float] | None = None
    shared_prefix: bool = False
    phase: str = "measured"
    output_text: str = ""

    @property
    def ok(self) -> bool:
        """Completed with at least one token and no error."""
        return self.error_kind is None and self.output_tokens > 0 and bool(self.chunk_times_s)

    @property
    def client_queue_s(self) -> float:
        """Time the request waited on the client past its due time (0 in a closed loop)."""
        return 0.0 if self.scheduled_s is None else max(0.0, self.sent_s - self.scheduled_s)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[self._first_token_chunk()] if self.ok else None

    @property
    def e2e_s(self) -> float | None:
        return self.chunk_times_s[self._last_token_chunk()] if self.ok else None

    @property
    def tpot_s(self) -> float | None:
        """Undefined (None) for a single-token output."""
        ttft, e2e = self.ttft_s, self.e2e_s
        if ttft is None or e2e is None or self.output_tokens < 2:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

    @property
    def end_s(self) -> float:
        """When the request finished (last token, stream end or failure), from the run start."""
        if self.done_s is not None:
            return self.sent_s + self.done_s
        return self.sent_s + (self.chunk_times_s[-1] if self.chunk_times_s else 0.0)

    def itl_s(self) -> list[float]:
        """Per-token inter-token latencies (output_tokens - 1 values; see module docstring)."""
        if not self.ok:
            return []
        gaps: list[float] = []
        previous: float | None = None
        for at, tokens in zip(self.chunk_times_s, self.chunk_tokens, strict=True):
            if tokens <= 0:
                continue
            if previous is None:
                gaps.extend([0.0] * (tokens - 1))
            else:
                gaps.extend([(at - previous) / tokens] * tokens)
            previous = at
        return gaps

    def token_times_s(self) -> list[tuple[float, int]]:
        """(arrival from run start, tokens) per token-bearing chunk: for throughput over time."""
        return [(self.sent_s + t, k) for t, k in zip(self.chunk_times_s, self.chunk_tokens, strict=True) if k]

    def _first_token_chunk(self) -> int:
        return next(i for i, k in enumerate(self.chunk_tokens) if k > 0)

    def _last_token_chunk(self) -> int:
        return max(i for i, k in enumerate(self.chunk_tokens) if k > 0)

    def to_json(self) -> dict[str, Any]:
        """The per-request JSONL row: raw observations plus the derived metrics."""
        row = asdict(self)
        row.pop("output_text")
        row["chunk_times_s"] = [round(t, 6) for t in self.chunk_times_s]
        row.update(
            ttft_s=self.ttft_s,
            tpot_s=self.tpot_s,
            e2e_s=self.e2e_s,
            client_queue_s=self.client_queue_s,
            ok=self.ok,
        )
        return row

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> RequestRecord:
        """Inverse of `to_json` (derived fields are recomputed, not read)."""
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in row.items() if k in names})


def allocate_tokens(weights: list[int], total: int) -> list[int]:
    """Split `total` tokens over chunks in proportion to `weights` (largest remainder).

    Every chunk gets at least one token when there are enough to go round, so a chunk that the
    server sent is never read as having carried nothing.
    """
    n = len(weights)
    if n == 0 or total <= 0:
        return [0] * n
    if total < n:
        # Fewer tokens than chunks: keep the first and the last chunks' tokens (TTFT and E2E).
        return [1] + [0] * (n - total) + [1] * (total - 1)
    # Each chunk has one token; spread the rest by what each chunk holds beyond one (else evenly).
    extra = [max(0, x - 1) for x in weights]
    if sum(extra) == 0:
        extra = [1] * n
    remaining = total - n
    shares = [remaining * x / sum(extra) for x in extra]
    floors = [int(s) for s in shares]
    order = sorted(range(n), key=lambda i: (shares[i] - floors[i], -i), reverse=True)
    for i in order[: remaining - sum(floors)]:
        floors[i] += 1
    return [1 + f for f in floors]
