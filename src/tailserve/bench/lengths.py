"""Token-length distributions for prompts and outputs: parse a spec string, draw integer lengths.

Specs: `fixed:N`, `uniform:LO,HI`, `normal:MEAN,STD`, `lognormal:MEDIAN,SIGMA` and
`longtail:MEDIAN,LONG,FRACTION[,SIGMA]` (most requests lognormal around MEDIAN, FRACTION near LONG).
Draws are seeded by the caller's generator and never below 1 token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tailserve.bench.errors import BenchConfigError

_ARITY: dict[str, tuple[int, int]] = {
    "fixed": (1, 1),
    "uniform": (2, 2),
    "normal": (2, 2),
    "lognormal": (2, 2),
    "longtail": (3, 4),
}
# Spread of the long tail itself, as a fraction of LONG: "5% at 8000" means 8000 +- a little.
_LONG_TAIL_REL_STD = 0.05
_DEFAULT_LONGTAIL_SIGMA = 0.3


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts; `params` meaning depends on `kind` (see module docstring)."""

    kind: str
    params: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.kind not in _ARITY:
            raise BenchConfigError(f"unknown length distribution {self.kind!r}; use one of {sorted(_ARITY)}")
        lo, hi = _ARITY[self.kind]
        if not lo <= len(self.params) <= hi:
            raise BenchConfigError(f"{self.kind} takes {lo}..{hi} numbers, got {len(self.params)}")
        if any(not math.isfinite(p) or p < 0 for p in self.params):
            raise BenchConfigError(f"{self.spec()}: parameters must be finite and >= 0")
        if self.kind == "uniform" and self.params[0] > self.params[1]:
            raise BenchConfigError(f"{self.spec()}: LO must be <= HI")
        if self.kind == "longtail" and not 0.0 <= self.params[2] <= 1.0:
            raise BenchConfigError(f"{self.spec()}: FRACTION must be in [0, 1]")

    def spec(self) -> str:
        """The string form this distribution parses from."""
        return f"{self.kind}:" + ",".join(f"{p:g}" for p in self.params)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        """Draw `n` integer lengths (each >= 1)."""
        p = self.params
        if self.kind == "fixed":
            values = np.full(n, p[0])
        elif self.kind == "uniform":
            values = rng.integers(int(p[0]), int(p[1]) + 1, size=n).astype(float)
        elif self.kind == "normal":
            values = rng.normal(p[0], p[1], size=n)
        elif self.kind == "lognormal":
            values = rng.lognormal(math.log(max(p[0], 1.0)), p[1], size=n)
        else:
            values = _sample_longtail(rng, n, p)
        return [max(1, int(round(v))) for v in values]

    def mean(self) -> float:
        """Expected value before rounding and clipping (for sizing runs and docs)."""
        p = self.params
        if self.kind == "fixed":
            return p[0]
        if self.kind in ("uniform",):
            return (p[0] + p[1]) / 2
        if self.kind == "normal":
            return p[0]
        if self.kind == "lognormal":
            return p[0] * math.exp(p[1] ** 2 / 2)
        sigma = p[3] if len(p) > 3 else _DEFAULT_LONGTAIL_SIGMA
        return (1 - p[2]) * p[0] * math.exp(sigma**2 / 2) + p[2] * p[1]


def _sample_longtail(rng: np.random.Generator, n: int, p: tuple[float, ...]) -> np.ndarray:
    """Mixture: (1 - FRACTION) lognormal around MEDIAN, FRACTION normal around LONG."""
    median, long_len, fraction = p[0], p[1], p[2]
    sigma = p[3] if len(p) > 3 else _DEFAULT_LONGTAIL_SIGMA
    body = rng.lognormal(math.log(max(median, 1.0)), sigma, size=n)
    tail = rng.normal(long_len, _LONG_TAIL_REL_STD * long_len, size=n)
    in_tail = rng.random(n) < fraction
    return np.where(in_tail, tail, body)


def parse_length_dist(spec: str) -> LengthDist:
    """Parse `kind:a,b,...`; a bare integer means `fixed:N`."""
    text = spec.strip()
    if ":" not in text:
        try:
            return LengthDist("fixed", (float(int(text)),))
        except ValueError:
            raise BenchConfigError(f"bad length spec {spec!r}; e.g. fixed:128 or uniform:32,128") from None
    kind, _, rest = text.partition(":")
    try:
        params = tuple(float(x) for x in rest.split(",") if x.strip())
    except ValueError:
        raise BenchConfigError(f"bad numbers in length spec {spec!r}") from None
    return LengthDist(kind.strip().lower(), params)
