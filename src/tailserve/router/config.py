"""The router's settings as one frozen dataclass, validated on construction.

A config is a plain value: building one opens no socket and starts no task.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tailserve.errors import ConfigError

POLICIES = ("round_robin", "hash", "least_load", "prefix")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class LoadWeights:
    """How a replica's live load folds into one score (units: requests)."""

    # A queued request means the replica is saturated: it predicts TTFT more than a running one.
    waiting_weight: float = 2.0
    running_weight: float = 1.0
    # A full KV pool is worth this many requests: it is where preemption and queueing start.
    kv_weight: float = 4.0


@dataclass(frozen=True)
class RouterConfig:
    """Replicas, placement policy, health checking, retry and prefix-affinity settings."""

    replicas: tuple[str, ...]
    policy: str = "prefix"
    host: str = "127.0.0.1"
    port: int = 8080
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    unhealthy_threshold: int = 2  # consecutive failed /ready checks before a replica is taken out
    healthy_threshold: int = 2  # consecutive good /ready checks before it is put back
    load_interval_s: float = 0.25  # how often each replica's /metrics is read
    max_attempts: int = 3  # replicas tried per request before giving up
    retry_backoff_s: float = 0.05  # doubled per retry, capped at 1 s
    connect_timeout_s: float = 2.0
    upstream_timeout_s: float = 600.0  # per read from a replica (a long queue is not a failure)
    prefix_block_chars: int = 256
    prefix_load_bound: float = 4.0  # max load above the least loaded replica that affinity may cost
    prefix_map_blocks: int = 200_000  # LRU bound of the prefix-block -> replica map
    load_weights: LoadWeights = field(default_factory=LoadWeights)
    # The client-facing gate, checked before a body is read (as the server does).
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "replicas", tuple(url.rstrip("/") for url in self.replicas))
        _require(len(self.replicas) >= 1, "give at least one --replica URL")
        _require(len(set(self.replicas)) == len(self.replicas), "each --replica URL must be given once")
        for url in self.replicas:
            _require(
                url.startswith(("http://", "https://")), f"--replica must be an http(s) URL, got {url!r}"
            )
        _require(
            self.policy in POLICIES, f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}"
        )
        _require(0 < self.port < 65536, f"--port must be in 1..65535, got {self.port}")
        _require(
            self.health_interval_s > 0 and self.health_timeout_s > 0, "health interval/timeout must be > 0"
        )
        _require(
            self.unhealthy_threshold >= 1 and self.healthy_threshold >= 1, "health thresholds must be >= 1"
        )
        _require(self.load_interval_s > 0, "--load-interval must be > 0")
        _require(self.max_attempts >= 1, "--max-attempts must be at least 1")
        _require(self.retry_backoff_s >= 0, "--retry-backoff must be >= 0")
        _require(self.connect_timeout_s > 0 and self.upstream_timeout_s > 0, "timeouts must be > 0")
        _require(self.prefix_block_chars >= 1, "--prefix-block-chars must be at least 1")
        _require(self.prefix_load_bound >= 0, "--prefix-load-bound must be >= 0")
        _require(self.prefix_map_blocks >= 1, "the prefix map must hold at least one block")
        _require(self.api_key is None or bool(self.api_key), "--api-key must not be empty")
        _require(self.max_body_bytes >= 1024, "--max-body-bytes must be at least 1024")
        _require(self.drain_timeout_s >= 0, "--drain-timeout must not be negative")
