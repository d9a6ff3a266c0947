"""SLO classes: named TTFT/TPOT targets, and which targets one HTTP request gets.

The gateway's `x-slo-ttft-ms` / `x-slo-tpot-ms` headers win, then the request's own `slo` field, then
its `priority` (a class name, or vLLM's integer), then the class of its API key, then that of its model
name, then the server default. None of the client's choices (headers, `slo`, `priority`) tightens past
the caller's class unless the front is trusted (--trust-request-slo). No engine call.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailserve.config import SchedulerConfig
from tailserve.engine.request import SloTarget
from tailserve.errors import ConfigError, InvalidRequestError

INTERACTIVE, BATCH = "interactive", "batch"
BATCH_TTFT_FACTOR, BATCH_TPOT_FACTOR = 10.0, 4.0  # built-in batch: this much looser than interactive
TTFT_HEADER, TPOT_HEADER = "x-slo-ttft-ms", "x-slo-tpot-ms"  # what the gateway's SLO-aware routing sends
MAX_REQUEST_TARGET_MS = 3_600_000.0  # a per-request target past an hour is a mistake, not a latency target
_DECIMAL = re.compile(r"[0-9]+(\.[0-9]+)?")  # a header's number: no sign, exponent, inf or nan


@dataclass(frozen=True)
class SloHeaders:
    """The SLO headers as received (every value, to catch repeats; empty: absent)."""

    ttft_ms: tuple[str, ...] = ()
    tpot_ms: tuple[str, ...] = ()


@dataclass(frozen=True)
class SloClasses:
    """Class name -> targets (both set), the default class, and API key / model name -> class."""

    classes: dict[str, SloTarget]
    default: str = INTERACTIVE
    api_keys: dict[str, str] = field(default_factory=dict)
    models: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        named = [("default", self.default)]
        named += [(f"api_keys[...{key[-4:]}]", c) for key, c in self.api_keys.items()]
        named += [(f"models[{model!r}]", c) for model, c in self.models.items()]
        for where, name in named:
            if name not in self.classes:
                raise ConfigError(f"--slo-classes: {where} names unknown class {name!r} ({self._known()})")

    @property
    def tightest_ttft_s(self) -> float:
        """The tightest TTFT target of any class (SchedulerConfig.tightest_ttft_s)."""
        return min(float(t.ttft_s or math.inf) for t in self.classes.values())

    def scheduler_config(self, scheduler: SchedulerConfig) -> SchedulerConfig:
        """`scheduler` told this file's tightest TTFT (a step with no decode leaves that class its time)."""
        return dataclasses.replace(scheduler, tightest_ttft_s=self.tightest_ttft_s)

    def check_engine(self, scheduler: SchedulerConfig) -> None:
        """ConfigError where the engine's scheduler was built without this file's tightest TTFT: it
        would let a step with no decode run past half that target (build it with `scheduler_config`)."""
        bound_s = scheduler.tightest_ttft_s or scheduler.slo_ttft_s
        if self.tightest_ttft_s < bound_s:
            raise ConfigError(
                f"--slo-classes: a class's TTFT target is {self.tightest_ttft_s:g} s, but the engine was built "
                f"for {bound_s:g} s; build its SchedulerConfig with SloClasses.scheduler_config "
                f"(tightest_ttft_s={self.tightest_ttft_s:g})"
            )

    def _known(self) -> str:
        return "known: " + ", ".join(sorted(self.classes))

    @staticmethod
    def builtin(scheduler: SchedulerConfig) -> SloClasses:
        """`interactive`: --slo-ttft / --slo-tpot; `batch`: 10x and 4x looser; interactive by default."""
        ttft, tpot = scheduler.slo_ttft_s, scheduler.slo_tpot_s
        return SloClasses(
            {
                INTERACTIVE: SloTarget(INTERACTIVE, ttft, tpot),
                BATCH: SloTarget(BATCH, ttft * BATCH_TTFT_FACTOR, tpot * BATCH_TPOT_FACTOR),
            }
        )

    @staticmethod
    def load(path: str | Path, scheduler: SchedulerConfig) -> SloClasses:
        """The file's classes over the built-in ones; ConfigError names what is wrong."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--slo-classes {path}: {exc}") from None
        if not isinstance(data, dict) or set(data) - {"classes", "default", "api_keys", "models"}:
            raise ConfigError(f"--slo-classes {path}: an object with classes, default, api_keys, models")
        classes = dict(SloClasses.builtin(scheduler).classes)
        for name, spec in _mapping(data.get("classes", {}), "classes").items():
            spec = _mapping(spec, f"classes[{name!r}]")
            if set(spec) - {"ttft_ms", "tpot_ms"}:
                raise ConfigError(f"--slo-classes: classes[{name!r}] takes ttft_ms and tpot_ms only")
            base = classes.get(name, classes[INTERACTIVE])
            ttft = _ms(spec.get("ttft_ms"), f"classes[{name!r}].ttft_ms", ConfigError)
            tpot = _ms(spec.get("tpot_ms"), f"classes[{name!r}].tpot_ms", ConfigError)
            classes[name] = SloTarget(name, ttft or base.ttft_s, tpot or base.tpot_s)
        default = data.get("default", INTERACTIVE)
        if not isinstance(default, str):
            raise ConfigError("--slo-classes: default must be a class name")
        return SloClasses(
            classes,
            default,
            {k: _class_name(v) for k, v in _mapping(data.get("api_keys", {}), "api_keys").items()},
            {k: _class_name(v) for k, v in _mapping(data.get("models", {}), "models").items()},
        )

    def for_request(
        self,
        api_key: str | None,
        model: str,
        priority: int | str | None,
        slo: dict[str, Any] | None,
        headers: SloHeaders | None = None,
        *,
        trusted: bool = False,
    ) -> SloTarget:
        """The targets of one request; InvalidRequestError names the field (or header) when a value
        is bad. Unless `trusted` (--trust-request-slo), every client choice is held to the caller's
        class: a target tighter than the class's is raised to it, and a `priority` class tighter than
        it runs (and is counted) as the caller's class. Looser choices apply as asked."""
        caller = self.api_keys.get(api_key or "") or self.models.get(model) or self.default
        own = None if trusted else self.classes[caller]  # otherwise any client could buy priority
        target = self.classes[self._named(priority, caller)]
        if own is not None:
            target = _class_no_tighter(target, own)
        if slo:
            ttft = _request_ms(slo.get("ttft_ms"), "slo.ttft_ms")
            tpot = _request_ms(slo.get("tpot_ms"), "slo.tpot_ms")
            target = _with_targets(target, ttft, tpot, own)
        if headers is not None:
            ttft = _header_ms(headers.ttft_ms, TTFT_HEADER)
            tpot = _header_ms(headers.tpot_ms, TPOT_HEADER)
            target = _with_targets(target, ttft, tpot, own)
        return target

    def _named(self, priority: int | str | None, caller: str) -> str:
        """The class a request's `priority` names (a class name or vLLM's integer); else the caller's."""
        if isinstance(priority, str):
            if priority not in self.classes:
                raise InvalidRequestError(
                    f"unknown SLO class {priority!r} in 'priority' ({self._known()})", "priority"
                )
            return priority
        if priority is None or priority == 0:
            return caller
        # vLLM's integer priority (lower runs earlier): below 0 interactive, above 0 batch, 0 the default.
        return INTERACTIVE if priority < 0 else BATCH


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"--slo-classes: {where} must be an object")
    return value


def _class_name(value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"--slo-classes: a class name must be a string, got {value!r}")
    return value


def _ms(value: Any, param: str, error: type[ConfigError] | type[InvalidRequestError]) -> float | None:
    """Milliseconds -> seconds; None stays None (the class's own value applies)."""
    if value is None:
        return None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        message = f"'{param}' must be a positive number of milliseconds, got {value!r}"
        if error is InvalidRequestError:
            raise InvalidRequestError(message, param)
        raise ConfigError(f"--slo-classes: {message}")
    return float(value) / 1000.0


def _request_ms(value: Any, param: str) -> float | None:
    """A per-request target (body or header): positive, and at most an hour."""
    seconds = _ms(value, param, InvalidRequestError)
    if seconds is not None and seconds * 1000.0 > MAX_REQUEST_TARGET_MS:
        raise InvalidRequestError(
            f"'{param}' must be at most {MAX_REQUEST_TARGET_MS:.0f} milliseconds (an hour), got {value!r}",
            param,
        )
    return seconds


def _header_ms(values: tuple[str, ...], header: str) -> float | None:
    """One header's target in seconds (None: absent); a repeat or a non-decimal value is a 400."""
    if not values:
        return None
    if len(values) > 1:
        raise InvalidRequestError(f"header '{header}' given {len(values)} times; send it once", header)
    text = values[0].strip()
    if not _DECIMAL.fullmatch(text):
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise InvalidRequestError(
            f"header '{header}' must be a positive decimal number of milliseconds, got {shown!r}", header
        )
    return _request_ms(float(text), header)


def _no_tighter(seconds: float | None, class_s: float | None) -> float | None:
    """A client's target, raised to its class's when tighter (None: the client gave none)."""
    if seconds is None or class_s is None:
        return seconds
    return max(seconds, class_s)


def _class_no_tighter(asked: SloTarget, own: SloTarget) -> SloTarget:
    """The class a client's `priority` asked for, held to the caller's own: when tighter in either
    target it is not granted, so the request is scheduled and counted as the caller's class (keeping
    a target the asked class loosens)."""
    ttft, tpot = _no_tighter(asked.ttft_s, own.ttft_s), _no_tighter(asked.tpot_s, own.tpot_s)
    if (ttft, tpot) == (asked.ttft_s, asked.tpot_s):
        return asked
    return SloTarget(own.slo_class, ttft, tpot)


def _with_targets(
    target: SloTarget, ttft_s: float | None, tpot_s: float | None, own: SloTarget | None
) -> SloTarget:
    """`target` with a client's own targets (None: keep its value), each raised to the caller's
    class `own` when tighter (None: trusted, taken as given); the class name stays."""
    if own is not None:
        ttft_s, tpot_s = _no_tighter(ttft_s, own.ttft_s), _no_tighter(tpot_s, own.tpot_s)
    return SloTarget(target.slo_class, ttft_s or target.ttft_s, tpot_s or target.tpot_s)
