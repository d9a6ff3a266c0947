"""Self-contained SVG charts for the comparison report: lines with interval bars (a P99 or goodput
against offered load, a P99 over time) and empirical CDFs, one series per server. No script, no
external font or stylesheet: the files open offline and paste into markdown as images.
"""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Sequence

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf")
W, H, LEFT, RIGHT, TOP, BOTTOM = 720, 380, 70, 190, 36, 50


@dataclasses.dataclass(frozen=True)
class Series:
    """One server's points: (x, y, low, high); low / high None where the interval is open."""

    label: str
    points: Sequence[tuple[float, float, float | None, float | None]]
    step: bool = False  # a CDF: draw as a staircase, no markers


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step) + 1)]


def chart(
    title: str,
    x_label: str,
    y_label: str,
    series: Sequence[Series],
    hline: tuple[float, str] | None = None,
) -> str:
    """A line chart; open interval ends are drawn up to the plot's edge with an arrow."""
    xs = [p[0] for s in series for p in s.points]
    ys = [v for s in series for p in s.points for v in (p[1], p[2], p[3]) if v is not None]
    if hline:
        ys.append(hline[0])
    if not xs or not ys:
        return _frame(title, ['<text x="50%" y="50%" text-anchor="middle">no data</text>'])
    x0, x1 = min(0.0, min(xs)), max(xs) * 1.05 or 1.0
    y0, y1 = min(0.0, min(ys)), max(ys) * 1.1 or 1.0
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return TOP + ph - (y - y0) / (y1 - y0) * ph

    parts = [f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    for t in _ticks(x0, x1):
        parts.append(
            f'<text x="{px(t):.1f}" y="{TOP + ph + 16}" text-anchor="middle" font-size="11">{t:g}</text>'
        )
    for t in _ticks(y0, y1):
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#eee"/>')
        parts.append(
            f'<text x="{LEFT - 6}" y="{py(t) + 4:.1f}" text-anchor="end" font-size="11">{t:g}</text>'
        )
    parts.append(
        f'<text x="{LEFT + pw / 2}" y="{H - 10}" text-anchor="middle" font-size="12">{html.escape(x_label)}</text>'
    )
    parts.append(
        f'<text x="14" y="{TOP + ph / 2}" text-anchor="middle" font-size="12" '
        f'transform="rotate(-90 14 {TOP + ph / 2})">{html.escape(y_label)}</text>'
    )
    if hline:
        y = py(hline[0])
        parts.append(
            f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#000" stroke-dasharray="6 4"/>'
        )
        parts.append(
            f'<text x="{LEFT + pw - 4}" y="{y - 4:.1f}" text-anchor="end" font-size="11">{html.escape(hline[1])}</text>'
        )
    for i, s in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        pts = sorted(s.points)
        if s.step:
            path = []
            for j, (x, y, _, _) in enumerate(pts):
                prev = pts[j - 1][1] if j else y0
                path += [f"{px(x):.1f},{py(prev):.1f}", f"{px(x):.1f},{py(y):.1f}"]
            parts.append(
                f'<polyline points="{" ".join(path)}" fill="none" stroke="{colour}" stroke-width="1.5"/>'
            )
        else:
            line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y, _, _ in pts)
            parts.append(f'<polyline points="{line}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
            for x, y, lo, hi in pts:
                top = py(hi) if hi is not None else TOP
                bottom = py(lo) if lo is not None else TOP + ph
                parts.append(
                    f'<line x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{top:.1f}" y2="{bottom:.1f}" stroke="{colour}"/>'
                )
                parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>')
                if hi is None:  # open upper end: the interval runs off the chart
                    parts.append(
                        f'<text x="{px(x):.1f}" y="{TOP + 10}" text-anchor="middle" font-size="10" fill="{colour}">^</text>'
                    )
        ly = TOP + 14 + 18 * i
        parts.append(
            f'<line x1="{W - RIGHT + 12}" x2="{W - RIGHT + 32}" y1="{ly - 4}" y2="{ly - 4}" stroke="{colour}" stroke-width="2"/>'
        )
        parts.append(f'<text x="{W - RIGHT + 36}" y="{ly}" font-size="11">{html.escape(s.label)}</text>')
    return _frame(title, parts)


def cdf_series(label: str, values: Sequence[float]) -> Series:
    ordered = sorted(values)
    n = len(ordered)
    return Series(label, [(v, (i + 1) / n, None, None) for i, v in enumerate(ordered)], step=True)


def _frame(title: str, parts: list[str]) -> str:
    head = f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif">'
    caption = f'<text x="{LEFT}" y="20" font-size="14" font-weight="bold">{html.escape(title)}</text>'
    return (
        "\n".join([head, '<rect width="100%" height="100%" fill="#fff"/>', caption, *parts, "</svg>"]) + "\n"
    )
