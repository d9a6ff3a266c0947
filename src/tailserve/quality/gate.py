"""The quality gate: may this weight format serve this model? Measured once, then read from a cache.

A format passes when, against the fp32 reference on held-out text, perplexity stays within 1% and
top-1 agreement is at least 95%, on prompt rows and on decode rows each (a phase serves through its
own kernels). Results are cached per model fingerprint, format, kernel plan, KV dtype, thresholds
and measurement plan, so a server start never measures twice.
It never serves a failing format unless forced, and never gates dummy (random) weights.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import torch

import tailserve
from tailserve.errors import ConfigError
from tailserve.kernels import cpu as cpu_kernels
from tailserve.model import cpu_fused
from tailserve.model.transformer import TransformerLM
from tailserve.quality.cache import GateCache, fingerprint
from tailserve.quality.evaluate import Agreement, EvalPlan, HeldOutText, ModelTrace, compare, trace_model
from tailserve.weights.loader import LoadedModel, load_model

log = logging.getLogger(__name__)

GATE_VERSION = 2  # bump when what is measured changes: older cache entries then stop matching
_KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Fastest first. The formats that can be built today; `auto` takes the first one that passes.
_CANDIDATES = {"cpu": ("int4", "int8", "bf16"), "cuda": ("bf16",)}


@dataclass(frozen=True)
class GateThresholds:
    """Pass when ppl(format) / ppl(fp32) <= max_ppl_ratio and top-1 agreement >= min_top1."""

    min_top1: float = 0.95
    max_ppl_ratio: float = 1.01


@dataclass(frozen=True)
class GateResult:
    """One format's figures against fp32 on one model, and the verdict. `origin`: measured or cache."""

    weight_format: str
    kv_cache_dtype: str
    model: str
    model_fingerprint: str  # sha256 of size + first and last MiB of each weight file (see fingerprint)
    device: str
    tokens: int
    top1: float
    ppl_ref: float
    ppl: float
    ppl_ratio: float
    prefill_top1: float
    prefill_ppl_ratio: float
    decode_top1: float
    decode_ppl_ratio: float
    greedy_identical: float
    greedy_prefix_tokens: float
    greedy_prompts: int
    greedy_tokens: int
    min_top1: float
    max_ppl_ratio: float
    passed: bool
    seconds: float
    tailserve_version: str
    date: str
    origin: str = "measured"

    def summary(self) -> str:
        """One log line: both gate figures, per phase, and the verdict."""
        verdict = "passed" if self.passed else "FAILED"
        return (
            f"{self.weight_format} (kv {self.kv_cache_dtype}) {verdict} the quality gate: top-1 "
            f"{self.top1:.1%} (prefill {self.prefill_top1:.1%}, decode {self.decode_top1:.1%}; "
            f"min {self.min_top1:.1%}), perplexity ratio {self.ppl_ratio:.4f} (prefill "
            f"{self.prefill_ppl_ratio:.4f}, decode {self.decode_ppl_ratio:.4f}; max {self.max_ppl_ratio:.4f}) "
            f"over {self.tokens} tokens; greedy {self.greedy_identical:.0%} identical [{self.origin}]"
        )


class FormatChoice(NamedTuple):
    """What `resolve_format` decided: the format to serve and the gate figures behind it (None: ungated)."""

    weight_format: str
    gate: GateResult | None


def passes(a: Agreement, t: GateThresholds) -> bool:
    """Both figures within bounds on prompt rows and on decode rows, each phase on its own.

    Pooled over both phases, int8 passed (top-1 95.3%) while its decode rows, the ones its kernel
    serves, agreed 94.9%. Per phase the figures need enough rows: at 2,048 a phase (the default)
    top-1 noise is ~0.4%; at 256 it is ~1%, enough to flip bf16 (97%) now and then."""
    top1 = min(a.prefill_top1, a.decode_top1)
    ratio = max(a.prefill_ppl_ratio, a.decode_ppl_ratio)
    return top1 >= t.min_top1 and ratio <= t.max_ppl_ratio


def concrete_kv_dtype(weight_format: str, kv_cache_dtype: str) -> str:
    """`auto` KV is the activation dtype of the weight format: fp32 for fp32, bf16 for the rest."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    return "fp32" if weight_format == "fp32" else "bf16"


def build_format_model(
    loaded: LoadedModel, weight_format: str, kv_cache_dtype: str, max_positions: int, device: torch.device
) -> TransformerLM:
    """The model in `weight_format` as the server builds it (model.formats), from the fp32 load."""
    from tailserve.model.plans import build_model

    if weight_format not in (available := buildable_formats(device)):
        raise ConfigError(
            f"weight format {weight_format} is not available on {device.type} ({', '.join(available)} are)"
        )
    if kv_cache_dtype not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"--kv-cache-dtype must be auto, fp32 or bf16, got {kv_cache_dtype!r}")
    return build_model(loaded, weight_format, device, max_positions)


ModelBuilder = Callable[[LoadedModel, str, str, int, torch.device], TransformerLM]


@dataclass
class QualityGate:
    """Measures formats of one model against its fp32 reference, reading and writing the cache."""

    model: str
    device: torch.device
    thresholds: GateThresholds = dataclasses.field(default_factory=GateThresholds)
    plan: EvalPlan = dataclasses.field(default_factory=EvalPlan)
    cache_dir: Path | None = None  # None: default_cache_dir()
    loaded: LoadedModel | None = None  # fp32 weights; loaded on first measurement when None
    build: ModelBuilder = build_format_model  # tests pass a deliberately broken one
    num_measured: int = 0  # formats traced by this gate (not counting the fp32 reference)

    def __post_init__(self) -> None:
        self.cache = GateCache(self.cache_dir)
        self._fingerprint = fingerprint(self.model)
        self._reference: ModelTrace | None = None
        self._text: HeldOutText | None = None

    def result(
        self, weight_format: str, kv_cache_dtype: str = "auto", *, use_cache: bool = True
    ) -> GateResult:
        """The gate figures of one format: from the cache when present, else measured and cached."""
        kv = concrete_kv_dtype(weight_format, kv_cache_dtype)
        if use_cache and (hit := self.cached(weight_format, kv)) is not None:
            return hit
        key = self._key(weight_format, kv)
        agreement, seconds = self._measure(weight_format, kv)
        result = self._result(weight_format, kv, agreement, seconds)
        self.cache.write(key, {"key": key, "result": dataclasses.asdict(result)})
        return result

    def cached(self, weight_format: str, kv_cache_dtype: str = "auto") -> GateResult | None:
        """The cached result, or None (a corrupt or mismatching file is ignored with a warning)."""
        kv = concrete_kv_dtype(weight_format, kv_cache_dtype)
        key = self._key(weight_format, kv)
        entry = self.cache.read(key)
        if entry is None:
            return None
        try:
            return _result_from_json(entry["result"])
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("ignoring corrupt quality-gate cache file %s: %s", self.cache.path(key), exc)
            return None

    def _measure(self, weight_format: str, kv: str) -> tuple[Agreement, float]:
        """The candidate against the reference, and the seconds the candidate took (build + trace)."""
        loaded = self._fp32()
        text = self._held_out(loaded)
        reference = self.reference_trace()
        log.info(
            "quality gate: measuring %s (kv %s) against fp32 on %d tokens of the bundled corpus",
            weight_format,
            kv,
            self.plan.scored_tokens,
        )
        start = time.perf_counter()
        model = self.build(loaded, weight_format, kv, self.plan.max_positions, self.device)
        kv_dtype = _KV_DTYPES[kv]
        trace = trace_model(
            model, text, self.plan, self.device, None if kv_dtype == model.embed.dtype else kv_dtype
        )
        self.num_measured += 1
        return compare(trace, reference), time.perf_counter() - start

    def _fp32(self) -> LoadedModel:
        if self.loaded is None or self.loaded.weights["model.embed_tokens.weight"].dtype != torch.float32:
            self.loaded = load_model(self.model, torch.float32)
        return self.loaded

    def _held_out(self, loaded: LoadedModel) -> HeldOutText:
        if self._text is None:
            self._text = HeldOutText.from_corpus(loaded.tokenizer, self.plan)
        return self._text

    def reference_trace(self) -> ModelTrace:
        """The fp32 trace, run through the same shapes as every candidate; cached on disk too."""
        if self._reference is not None:
            return self._reference
        key = self._key("reference", "fp32")
        entry = self.cache.read(key)
        if entry is not None:
            try:
                self._reference = ModelTrace(**entry["trace"])
                return self._reference
            except (KeyError, TypeError) as exc:
                log.warning("ignoring quality-gate reference %s: %s", self.cache.path(key), exc)
        log.info("quality gate: tracing the fp32 reference (once per model; cached)")
        loaded = self._fp32()
        text = self._held_out(loaded)
        model = build_format_model(loaded, "fp32", "fp32", self.plan.max_positions, self.device)
        self._reference = trace_model(model, text, self.plan, self.device)
        self.cache.write(key, {"key": key, "trace": dataclasses.asdict(self._reference)})
        return self._reference

    def _result(self, weight_format: str, kv: str, a: Agreement, seconds: float) -> GateResult:
        return GateResult(
            weight_format=weight_format,
            kv_cache_dtype=kv,
            model=self.model,
            model_fingerprint=self._fingerprint,
            device=self.device.type,
            tokens=a.tokens,
            top1=a.top1,
            ppl_ref=a.ppl_ref,
            ppl=a.ppl,
            ppl_ratio=a.ppl_ratio,
            prefill_top1=a.prefill_top1,
            prefill_ppl_ratio=a.prefill_ppl_ratio,
            decode_top1=a.decode_top1,
            decode_ppl_ratio=a.decode_ppl_ratio,
            greedy_identical=a.greedy_identical,
            greedy_prefix_tokens=a.greedy_prefix_tokens,
            greedy_prompts=self.plan.greedy_prompts,
            greedy_tokens=self.plan.greedy_tokens,
            min_top1=self.thresholds.min_top1,
            max_ppl_ratio=self.thresholds.max_ppl_ratio,
            passed=passes(a, self.thresholds),
            seconds=seconds,
            tailserve_version=tailserve.__version__,
            date=datetime.now(UTC).isoformat(timespec="seconds"),
        )

    # --- the cache: one JSON file per key, named by the key's hash -----------------------------

    def _key(self, weight_format: str, kv: str) -> dict[str, object]:
        key: dict[str, object] = {
            "gate_version": GATE_VERSION,
            "tailserve_version": tailserve.__version__,
            "model_fingerprint": self._fingerprint,
            "device": self.device.type,
            "torch_version": torch.__version__,  # the kernels are torch's
            "weight_format": weight_format,
            "kernels": _kernels(weight_format, self.device),  # a format whose kernel plan changes re-measures
            "kv_cache_dtype": kv,
            # the fused CPU kernels serve every CPU format but fp32: a rebuilt kernel re-measures
            "cpu_kernels": (
                f"{cpu_kernels.identity()} forward-r{cpu_fused.FORWARD_REVISION}"
                if self.device.type == "cpu" and weight_format not in ("reference", "fp32")
                else "n/a"
            ),
            "plan": dataclasses.asdict(self.plan),
        }
        if weight_format != "reference":  # the reference trace does not depend on the thresholds
            key["thresholds"] = dataclasses.asdict(self.thresholds)
        return key


def _kernels(weight_format: str, device: torch.device) -> str:
    """The kernel plan behind a format name (per phase and for the LM head), as text for the cache key."""
    from tailserve.model.plans import plan_for

    try:
        return repr(plan_for("fp32" if weight_format == "reference" else weight_format, device))
    except ConfigError:
        return "unavailable"


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "float": (float, int),
    "int": (int,),
    "bool": (bool,),
}


def _result_from_json(fields: Any) -> GateResult:
    """A GateResult from its cached JSON, every field present with its type (else ValueError)."""
    if not isinstance(fields, dict):
        raise ValueError("the result is not an object")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(GateResult):
        if f.name == "origin":
            continue
        value = fields[f.name]
        if not isinstance(value, _JSON_TYPES[str(f.type)]) or (f.type != "bool" and isinstance(value, bool)):
            raise ValueError(f"field {f.name} is {value!r}")
        values[f.name] = value
    return GateResult(**values, origin="cache")


def buildable_formats(device: torch.device) -> tuple[str, ...]:
    """Weight formats this build can construct on `device`, and therefore measure."""
    from tailserve.model.plans import PLANS

    return tuple(f for f in PLANS if _kernels(f, device) != "unavailable")


def candidate_formats(device: torch.device) -> tuple[str, ...]:
    """Formats `auto` tries on this device, fastest first (fp32, the reference, is the fallback)."""
    return tuple(f for f in _CANDIDATES.get(device.type, ()) if f in buildable_formats(device))


def choose_weight_format(
    model_spec: str,
    requested: str,
    device: torch.device,
    *,
    kv_cache_dtype: str = "auto",
    force: bool = False,
    cache_dir: Path | None = None,
    thresholds: GateThresholds | None = None,
    plan: EvalPlan | None = None,
    loaded: LoadedModel | None = None,
) -> FormatChoice:
    """The weight format to serve: `auto` is the fastest candidate that passes the gate (else fp32);
    an explicit format must pass unless `force`. Raises ConfigError for a failing explicit format."""
    if model_spec.startswith("dummy:"):
        chosen = requested if requested != "auto" else (candidate_formats(device) or ("fp32",))[0]
        log.info(
            "serving %s weights of %s ungated: dummy weights are random, the gate has nothing to measure",
            chosen,
            model_spec,
        )
        return FormatChoice(chosen, None)
    if requested == "fp32":
        return FormatChoice("fp32", None)  # the reference itself
    gate = QualityGate(
        model_spec, device, thresholds or GateThresholds(), plan or EvalPlan(), cache_dir, loaded
    )
    if requested != "auto":
        if force:
            cached = gate.cached(requested, kv_cache_dtype)
            log.warning(
                "serving %s by --force-weight-format; %s",
                requested,
                cached.summary() if cached else "its quality gate was not run",
            )
            return FormatChoice(requested, cached)
        result = gate.result(requested, kv_cache_dtype)
        if not result.passed:
            raise ConfigError(
                f"--weight-format {requested} is refused for {model_spec}: {result.summary()}. "
                "Serve another format, or pass --force-weight-format to serve it anyway"
            )
        log.info("serving %s", result.summary())
        return FormatChoice(requested, result)
    for candidate in candidate_formats(device):
        try:
            result = gate.result(candidate, kv_cache_dtype)
        except ConfigError as exc:  # not buildable for this model or not available
            log.info("auto weight format: skipping %s (%s)", candidate, exc)
            continue
        if result.passed:
            log.info("auto weight format: serving %s", result.summary())
            return FormatChoice(candidate, result)
        log.warning("auto weight format: %s", result.summary())
    log.info("auto weight format: serving fp32 (the reference)")
    return FormatChoice("fp32", None)
