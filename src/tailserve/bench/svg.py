"""Minimal inline-SVG charts for the HTML report: lines, steps, scatter, interval bars, shaded bands, axes.

Self-contained on purpose (no plotting library, no script, no CDN): the report must open offline and
render the same in any browser. Only what the report needs; not a general plotting library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#7f7f7f")
_MARGIN_LEFT, _MARGIN_RIGHT, _MARGIN_TOP, _MARGIN_BOTTOM = 64, 16, 44, 44
_MARKED_POINTS = 30


@dataclass(frozen=True)
class Series:
    """One plotted series; `style` is `line`, `step` (post-step, for CDFs and windows) or `scatter`.

    `intervals`, when given, holds one (lo, hi) per point, drawn as a vertical bar with caps; a None
    end is unbounded and the bar runs dashed to the chart's edge.
    """

    name: str
    points: list[tuple[float, float]]
    style: str = "line"
    color: str | None = None
    dashed: bool = False
    intervals: list[tuple[float | None, float | None]] = field(default_factory=list)


@dataclass(frozen=True)
class Band:
    """A shaded x-range (e.g. the warm-up period) with a label."""

    x0: float
    x1: float
    label: str


@dataclass(frozen=True)
class Chart:
    """A chart definition; `render()` returns an <svg> element as a string."""

    title: str
    x_label: str
    y_label: str
    series: list[Series]
    bands: list[Band] = field(default_factory=list)
    vlines: list[tuple[float, str]] = field(default_factory=list)
    hlines: list[tuple[float, str]] = field(default_factory=list)
    width: int = 640
    height: int = 300
    y_min: float | None = 0.0

    def render(self) -> str:
        xs = (
            [x for s in self.series for x, _ in s.points]
            + [b.x0 for b in self.bands]
            + [v for v, _ in self.vlines]
        )
        ys = [y for s in self.series for _, y in s.points] + [h for h, _ in self.hlines]
        ys += [v for s in self.series for ci in s.intervals for v in ci if v is not None]
        x_lo, x_hi = _span(xs)
        y_lo, y_hi = _span(ys + ([self.y_min] if self.y_min is not None else []))
        box = _Box(self.width, self.height, x_lo, x_hi, y_lo, y_hi * 1.05 if y_hi > 0 else y_hi)
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{self.width}" height="{self.height}" '
            f'viewBox="0 0 {self.width} {self.height}" role="img" aria-label="{escape(self.title)}">',
            f"<title>{escape(self.title)}</title>",
            f'<rect x="0" y="0" width="{self.width}" height="{self.height}" fill="#fff"/>',
            f'<text x="{self.width / 2:.0f}" y="18" text-anchor="middle" font-size="14" font-weight="bold">'
            f"{escape(self.title)}</text>",
        ]
        parts += [_band(box, b) for b in self.bands]
        parts += _axes(box, self.x_label, self.y_label)
        parts += [_rule(box, x, label, vertical=True) for x, label in self.vlines]
        parts += [_rule(box, y, label, vertical=False) for y, label in self.hlines]
        for i, s in enumerate(self.series):
            parts.append(_series(box, s, s.color or PALETTE[i % len(PALETTE)]))
            parts.append(_interval_bars(box, s, s.color or PALETTE[i % len(PALETTE)]))
        if not any(s.points for s in self.series):
            parts.append(
                f'<text x="{self.width / 2:.0f}" y="{self.height / 2:.0f}" text-anchor="middle" '
                'fill="#888">no data</text>'
            )
        parts.append(_legend(box, self.series))
        parts.append("</svg>")
        return "\n".join(parts)


@dataclass(frozen=True)
class _Box:
    width: int
    height: int
    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float

    def px(self, x: float) -> float:
        inner = self.width - _MARGIN_LEFT - _MARGIN_RIGHT
        return _MARGIN_LEFT + (x - self.x_lo) / (self.x_hi - self.x_lo) * inner

    def py(self, y: float) -> float:
        inner = self.height - _MARGIN_TOP - _MARGIN_BOTTOM
        return self.height - _MARGIN_BOTTOM - (y - self.y_lo) / (self.y_hi - self.y_lo) * inner


def _span(values: list[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    lo, hi = min(finite), max(finite)
    if hi - lo < 1e-12:
        pad = abs(hi) * 0.1 or 1.0
        return lo - pad if lo != 0 else 0.0, hi + pad
    return lo, hi


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Round tick values (1, 2, 5 x 10^k steps) covering [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / target
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = []
    value = first
    while value <= hi + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    return ticks


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000 or abs(value) < 0.01:
        return f"{value:.2g}"
    return f"{value:.3g}"


def _axes(box: _Box, x_label: str, y_label: str) -> list[str]:
    left, right = _MARGIN_LEFT, box.width - _MARGIN_RIGHT
    top, bottom = _MARGIN_TOP, box.height - _MARGIN_BOTTOM
    out = [
        f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" stroke="#999"/>'
    ]
    for t in nice_ticks(box.x_lo, box.x_hi):
        x = box.px(t)
        out.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" stroke="#666"/>')
        out.append(
            f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle" font-size="11">{_fmt(t)}</text>'
        )
    for t in nice_ticks(box.y_lo, box.y_hi):
        y = box.py(t)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">{_fmt(t)}</text>')
    out.append(
        f'<text x="{(left + right) / 2:.0f}" y="{box.height - 8}" text-anchor="middle" font-size="12">'
        f"{escape(x_label)}</text>"
    )
    out.append(
        f'<text x="14" y="{(top + bottom) / 2:.0f}" text-anchor="middle" font-size="12" '
        f'transform="rotate(-90 14 {(top + bottom) / 2:.0f})">{escape(y_label)}</text>'
    )
    return out


def _series(box: _Box, s: Series, color: str) -> str:
    pts = [(box.px(x), box.py(y)) for x, y in s.points if math.isfinite(x) and math.isfinite(y)]
    if not pts:
        return ""
    if s.style == "scatter":
        dots = "".join(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="1.8"/>' for x, y in pts)
        return f'<g class="series" fill="{color}" fill-opacity="0.55">{dots}</g>'
    if s.style == "step":
        # Post-step: each value holds until the next x, then jumps to the next value.
        d = f"M{pts[0][0]:.1f},{pts[0][1]:.1f}" + "".join(f"H{x:.1f}V{y:.1f}" for x, y in pts[1:])
    else:
        d = "M" + "L".join(f"{x:.1f},{y:.1f}" for x, y in pts)
    dash = ' stroke-dasharray="5,3"' if s.dashed else ""
    svg = f'<path class="series" d="{d}" fill="none" stroke="{color}" stroke-width="1.6"{dash}/>'
    if s.style == "line" and len(pts) <= _MARKED_POINTS:
        # Few points (a capacity curve): mark each measured one, the lines between are not data.
        svg += "".join(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in pts)
    return svg


def _interval_bars(box: _Box, s: Series, color: str) -> str:
    """Vertical interval bars with caps; an unbounded end runs dashed to the plot's edge."""
    bars = []
    for (x, _), (lo, hi) in zip(s.points, s.intervals, strict=False):
        px = box.px(x)
        top = box.py(hi) if hi is not None else float(_MARGIN_TOP)
        bottom = box.py(lo) if lo is not None else float(box.height - _MARGIN_BOTTOM)
        dash = ' stroke-dasharray="3,2"' if hi is None or lo is None else ""
        bars.append(
            f'<line x1="{px:.1f}" y1="{top:.1f}" x2="{px:.1f}" y2="{bottom:.1f}" stroke="{color}"{dash}/>'
        )
        for y, end in ((top, hi), (bottom, lo)):
            if end is not None:
                bars.append(
                    f'<line x1="{px - 4:.1f}" y1="{y:.1f}" x2="{px + 4:.1f}" y2="{y:.1f}" stroke="{color}"/>'
                )
    return f'<g class="intervals">{"".join(bars)}</g>' if bars else ""


def _band(box: _Box, band: Band) -> str:
    x0, x1 = box.px(max(band.x0, box.x_lo)), box.px(min(band.x1, box.x_hi))
    if x1 <= x0:
        return ""
    top, bottom = _MARGIN_TOP, box.height - _MARGIN_BOTTOM
    return (
        f'<rect x="{x0:.1f}" y="{top}" width="{x1 - x0:.1f}" height="{bottom - top}" fill="#ddd" opacity="0.5"/>'
        f'<text x="{(x0 + x1) / 2:.1f}" y="{top + 12}" text-anchor="middle" font-size="10" fill="#666">'
        f"{escape(band.label)}</text>"
    )


def _rule(box: _Box, value: float, label: str, vertical: bool) -> str:
    if vertical:
        x = box.px(value)
        # Labels near the right edge go on the left of their line so they are not cut off.
        anchor, dx = ("end", -3) if x > box.width * 0.8 else ("start", 3)
        return (
            f'<line x1="{x:.1f}" y1="{_MARGIN_TOP}" x2="{x:.1f}" y2="{box.height - _MARGIN_BOTTOM}" '
            f'stroke="#555" stroke-dasharray="3,3"/><text x="{x + dx:.1f}" y="{_MARGIN_TOP + 24}" '
            f'text-anchor="{anchor}" font-size="10" fill="#555">{escape(label)}</text>'
        )
    y = box.py(value)
    return (
        f'<line x1="{_MARGIN_LEFT}" y1="{y:.1f}" x2="{box.width - _MARGIN_RIGHT}" y2="{y:.1f}" stroke="#b00" '
        f'stroke-dasharray="6,3"/><text x="{box.width - _MARGIN_RIGHT - 4}" y="{y - 4:.1f}" text-anchor="end" '
        f'font-size="10" fill="#b00">{escape(label)}</text>'
    )


def _legend(box: _Box, series: list[Series]) -> str:
    items = []
    x = _MARGIN_LEFT + 8
    for i, s in enumerate(series):
        color = s.color or PALETTE[i % len(PALETTE)]
        items.append(
            f'<rect x="{x}" y="{_MARGIN_TOP - 16}" width="10" height="10" fill="{color}"/>'
            f'<text x="{x + 14}" y="{_MARGIN_TOP - 7}" font-size="11">{escape(s.name)}</text>'
        )
        x += 24 + 7 * len(s.name)
    return '<g class="legend">' + "".join(items) + "</g>"
