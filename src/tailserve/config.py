"""One frozen dataclass per concern, validated on construction.

Configs are plain values: building one never loads a model or touches a device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, TypeVar

from tailserve.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")

SCHEDULE_POLICIES = ("fcfs", "slo")
# --dtype, vLLM's choices: the compute (activation) dtype. float32 / float run fp32 weights and
# activations; bfloat16 runs bf16 activations (bf16 weights unless an int format is asked for);
# float16 / half have no kernels here and are refused.
DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
WEIGHT_FORMATS = ("auto", "fp32", "bf16", "int4", "int8")
KV_CACHE_DTYPES = ("auto", "fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how: path / `default` / `dummy:<preset>`, weight format, device.

    `weight_format` decides the weights and, with them, the activation dtype: fp32 runs fp32
    activations; bf16, int4 and int8 run bf16 activations (the int kernels need them). `dtype` is
    vLLM's `--dtype`, the activation dtype, folded into `weight_format`: float32 -> fp32,
    bfloat16 -> bf16 when no int format is asked for (DTYPES).
    """

    model: str = "default"
    weight_format: str = "auto"  # auto: the fastest format that keeps quality (CPU), bf16 on CUDA
    kv_cache_dtype: str = "auto"  # auto: the activation dtype of the weight format
    force_weight_format: bool = False  # serve an explicit weight format even if it fails the quality gate
    dtype: str = "auto"  # vLLM's --dtype (the activation dtype): folded into weight_format
    device: str = "auto"  # auto: CUDA when available
    max_model_len: int | None = None  # None: the model's own context, capped at 8192
    served_model_name: str | None = None
    seed: int = 0  # for dummy weights
    enforce_eager: bool = False  # no CUDA graphs
    num_threads: int | None = None  # CPU threads for torch (None: one fewer than the cores)
    tensor_parallel_size: int = 1  # ranks one model is sharded over (rank 0 here, N-1 worker processes)

    def __post_init__(self) -> None:
        _require(bool(self.model), "--model must not be empty")
        _require(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _require(
            self.weight_format in WEIGHT_FORMATS,
            f"--weight-format must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weight_format!r}",
        )
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
        )
        object.__setattr__(self, "weight_format", _fold_dtype(self.dtype, self.weight_format))
        _require(self.device in DEVICES, f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        _require(self.num_threads is None or self.num_threads >= 1, "--num-threads must be at least 1")
        _require(
            self.tensor_parallel_size >= 1,
            f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 16,
            f"--max-model-len must be at least 16, got {self.max_model_len}",
        )


def _fold_dtype(dtype: str, weight_format: str) -> str:
    """The weight format `--dtype` (vLLM's, the activation dtype) leaves: fp32 activations need fp32
    weights; bf16 activations run bf16 weights, or the int4 / int8 weights asked for."""
    if dtype == "auto":
        return weight_format
    _require(
        dtype not in ("float16", "half"),
        f"--dtype {dtype} is refused: tailserve computes in bfloat16 or float32 only (no float16 "
        "kernels); pass --dtype bfloat16",
    )
    if dtype in ("float32", "float"):
        _require(
            weight_format in ("auto", "fp32"),
            f"--dtype {dtype} (fp32 activations) needs fp32 weights, not --weight-format {weight_format}",
        )
        return "fp32"
    _require(
        weight_format != "fp32",
        f"--dtype {dtype} (bf16 activations) contradicts --weight-format fp32 (fp32 activations)",
    )
    return "bf16" if weight_format == "auto" else weight_format


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: block size and how much memory to preallocate for it, once."""

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # None: 1 GiB on CPU, gpu_memory_utilization on CUDA
    gpu_memory_utilization: float = 0.90
    enable_prefix_caching: bool = True
    # The root of the prefix cache's block keys, as vLLM's PYTHONHASHSEED: set, keys are reproducible
    # (by other replicas and external routers); None, a random root per engine (engine/block_keys.py).
    prefix_cache_seed: str | None = None

    def __post_init__(self) -> None:
        _require(
            self.block_size in (8, 16, 32, 64, 128),
            f"--block-size must be 8..128 (power of 2), got {self.block_size}",
        )
        _require(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            "--kv-cache-memory must be positive",
        )
        _require(
            0.05 <= self.gpu_memory_utilization <= 0.99,
            f"--gpu-memory-utilization must be in [0.05, 0.99], got {self.gpu_memory_utilization}",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits and the ordering policy of waiting requests."""

    max_num_batched_tokens: int = 256  # the per-step token budget (decodes + prefill chunks)
    max_num_seqs: int = 64
    policy: str = "slo"
    max_waiting: int = 512  # bound of the waiting queue (admission control)
    slo_ttft_s: float = 2.0  # the default per-request targets; a request may carry its own (SloTarget)
    slo_tpot_s: float = 0.150
    # slo: prefill keeps at least this share of the step budget beside decodes (0: only one block).
    prefill_floor: float = 0.25
    # slo: the share of each step's prefill budget that requests past saving (their TTFT deadline
    # is lost) keep, so they yield to savable requests without starving (docs/ENGINE.md).
    past_saving_share: float = 0.25
    # slo: a prompt whose slack (deadline - now - its predicted prefill) is under this share of its
    # TTFT target goes earliest deadline first; above it, least prompt x target first. 1 (default):
    # deadline order for all, the least maximum lateness, and an order a later arrival cannot jump
    # with an equal target, so the wait admission promised holds; 0: Smith's rule until a prompt
    # is past saving (the least mean TTFT, a longer tail; docs/ENGINE.md).
    urgent_slack: float = 1.0
    # CPU, 2+ threads: while streams decode, prompt chunks run on a thread of their own with half the
    # threads, beside the decode steps, instead of inside them (engine/prefill_lane.py).
    prefill_lane: bool = True
    # Prompt tokens a lane chunk may carry (its own budget: a chunk shares no step with decodes, so
    # the step budget need not bound it). Longer chunks pay the lane's fixed cost per chunk, and the
    # wait between a chunk's hand-over and its first token, fewer times per prompt (issue 40).
    lane_chunk_tokens: int = 512
    # With no stream decoding (nothing whose TPOT a long step would hurt), a step may carry up to
    # this many prompt tokens instead of max_num_batched_tokens (the larger of the two counts; 0: the
    # step budget). Off where prompt rows run oneDNN (kernels per row count, created before serving).
    prefill_step_tokens: int = 2048
    # The tightest TTFT target a request may be served by (the server's tightest SLO class; None:
    # slo_ttft_s). A longer step with no decode is predicted to take at most half of it, so a
    # request of that class that arrives as one starts keeps half its target for its own prompt.
    tightest_ttft_s: float | None = None
    # Where admitting a request at once would push a running stream over its TPOT target, hold its
    # prompt in the queue until a stream is expected to end, if its first token still comes within
    # its TTFT target, instead of refusing it (engine/tpot_model.py; False: refuse, 429 slo_tpot).
    admission_hold: bool = True
    # With a prefill lane: a prompt chunk goes on the lane only where every decoding stream's TPOT
    # room covers what the chunk slows it by (else the decodes take all threads that step), unless
    # the first prompt's TTFT deadline needs it now (Scheduler._lane_waits).
    pace_lane: bool = True
    # With a prefill lane: where the first prompt's TTFT deadline passes if it runs on the lane and not
    # if it runs on all threads, its chunk goes in the decodes' step on all threads, as long as every
    # decoding stream's TPOT target has room for that long step (Scheduler._all_threads_saves).
    late_prompts_all_threads: bool = True

    def __post_init__(self) -> None:
        _require(self.max_num_batched_tokens >= 1, "--max-num-batched-tokens must be at least 1")
        _require(self.max_num_seqs >= 1, "--max-num-seqs must be at least 1")
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least --max-num-seqs "
            f"({self.max_num_seqs}): every running request needs a token of budget each step",
        )
        _require(
            self.policy in SCHEDULE_POLICIES,
            f"--schedule-policy must be one of {', '.join(SCHEDULE_POLICIES)}, got {self.policy!r}",
        )
        _require(self.max_waiting >= 1, "--max-waiting must be at least 1")
        _require(self.lane_chunk_tokens >= 1, "--lane-chunk-tokens must be at least 1")
        _require(self.prefill_step_tokens >= 0, "--prefill-step-tokens must be at least 0")
        _require(self.slo_ttft_s > 0 and self.slo_tpot_s > 0, "SLO targets must be positive")
        _require(self.tightest_ttft_s is None or self.tightest_ttft_s > 0, "SLO targets must be positive")
        _require(
            0.0 <= self.prefill_floor <= 1.0, f"--prefill-floor must be in [0, 1], got {self.prefill_floor}"
        )
        _require(
            0.0 < self.past_saving_share <= 1.0,
            f"--past-saving-share must be in (0, 1] (0 would starve late requests), got {self.past_saving_share}",
        )
        _require(
            0.0 <= self.urgent_slack <= 1.0, f"--urgent-slack must be in [0, 1], got {self.urgent_slack}"
        )

    @property
    def idle_step_tokens(self) -> int:
        """Prompt tokens a step with no decode may give the first prompt in line, where the engine's
        kernels allow a longer step (engine/llm_engine.py `idle_budget`): at least the step budget."""
        return max(self.max_num_batched_tokens, self.prefill_step_tokens)


@dataclass(frozen=True)
class KVEventsConfig:
    """KV-cache events for routers outside the process, in vLLM's KVEventsConfig shape (vLLM's
    `--kv-events-config` JSON is accepted as is): ZMQ PUB on `endpoint` (bound when it has `*`, `::`,
    ipc:// or inproc://, else connected), replay on a ROUTER at `replay_endpoint`. Off by default.
    Two keys are tailserve's own: `int_block_hashes` (vLLM reads VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES):
    block hashes as the key's low 64 bits, as vLLM by default, or false: the whole 32-byte key;
    `event_encoding`: each event as a tagged array ("array", the published format every consumer
    reads) or as a tagged map ("map", what vLLM has sent since its PR #42892, June 2026)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null" (as vLLM)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000
    max_queue_size: int = 100_000  # events waiting for the publisher thread (vLLM counts batches)
    topic: str = ""
    int_block_hashes: bool = True
    event_encoding: str = "array"

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        _require(
            self.publisher in ("null", "zmq"),
            f"--kv-events-config: publisher must be null or zmq, got {self.publisher!r}",
        )
        _require(bool(self.endpoint), "--kv-events-config: endpoint must not be empty")
        _require(
            self.buffer_steps >= 1 and self.hwm >= 0 and self.max_queue_size >= 1,
            "--kv-events-config: buffer_steps and max_queue_size must be at least 1, hwm at least 0",
        )
        _require(
            self.event_encoding in ("array", "map"),
            f"--kv-events-config: event_encoding must be array or map, got {self.event_encoding!r}",
        )

    @property
    def enabled(self) -> bool:
        """Events are recorded and published (a `null` publisher records nothing here)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """The `--kv-events-config` JSON object; an unknown key or a wrong type is a ConfigError."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--kv-events-config is not JSON: {exc}") from None
        _require(isinstance(data, dict), "--kv-events-config must be a JSON object")
        unknown = sorted(set(data) - set(_KV_EVENTS_TYPES))
        _require(
            not unknown, f"--kv-events-config: unknown keys {unknown} (known: {sorted(_KV_EVENTS_TYPES)})"
        )
        for key, value in data.items():
            # bool is an int to isinstance: a count given as true/false is refused too.
            ok = isinstance(value, _KV_EVENTS_TYPES[key]) and not (
                isinstance(value, bool) and bool not in _KV_EVENTS_TYPES[key]
            )
            _require(ok, f"--kv-events-config: {key} has the wrong type: {value!r}")
        return cls(**data)


# The JSON types of each --kv-events-config key.
_KV_EVENTS_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str, type(None)),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
    "int_block_hashes": (bool,),
    "event_encoding": (str,),
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is built from."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5G', '1000000' -> bytes."""
    units = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30, "kib": 2**10}
    units |= {"mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    s = text.strip().lower()
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    number, unit = s[:i].strip(), s[i:]
    try:
        value = float(number)
    except ValueError:
        raise ConfigError(f"not a byte size: {text!r} (try 2GiB or 536870912)") from None
    if unit not in units or value <= 0:
        raise ConfigError(f"not a byte size: {text!r} (try 2GiB or 536870912)")
    return int(value * units[unit])


def from_flags(config: type[C], args: object, **given: object) -> C:
    """A config from parsed command-line flags, each named after its field (--max-num-seqs:
    max_num_seqs); `given`: the fields whose flag is spelled otherwise or needs converting. A field
    with neither keeps its default (`generate` has fewer flags than `serve`)."""
    names = [f.name for f in fields(config) if f.name not in given and hasattr(args, f.name)]
    return config(**{name: getattr(args, name) for name in names}, **given)
