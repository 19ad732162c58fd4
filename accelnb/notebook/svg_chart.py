"""A small, dependency-free SVG line chart: one metric against step, one line per rank.

    svg = line_chart([Line("rank 0", xs=[0, 1, 2], ys=[2.3, 1.1, 0.7], color=PALETTE[0])],
                     title="loss")
    html = f'<img src="{data_uri(svg)}">'

The SVG is a standalone document (it carries its ``xmlns``) so it can travel as an
``<img src="data:image/svg+xml;base64,…">``: JupyterLab strips inline ``<svg>`` from the HTML of
untrusted notebooks (a headless run opened later is untrusted) but keeps data-URI images, so the
curves survive in saved notebooks everywhere. Since an image cannot inherit the page's colours,
text and grid use a mid grey that reads on light and dark themes.

Each line's ``<path>`` carries ``data-series``, ``data-points`` (points drawn) and
``data-reported`` (points the series had before thinning) for tests and tools.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

# matplotlib's tab10: distinguishable, and familiar to anyone who has plotted a loss curve
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
TEXT_COLOR = "#888888"
GRID_COLOR = "#8888883a"

_Placer = Callable[[float, float], tuple[float, float]]  # (x, y) in data units → pixels


@dataclass(frozen=True)
class Line:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: str = PALETTE[0]
    reported: int | None = None  # the series' length before thinning; default len(xs)


def line_chart(lines: Sequence[Line], *, title: str = "", width: int = 320, height: int = 180) -> str:
    """An SVG document drawing ``lines`` on shared axes. Non-finite values break the line."""
    left, right, top, bottom = 46, 10, 20 if title else 8, 20
    plot_w, plot_h = width - left - right, height - top - bottom
    xs = [x for line in lines for x in line.xs if math.isfinite(x)]
    ys = [y for line in lines for y in line.ys if math.isfinite(y)]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10" '
             f'data-metric="{escape(title)}">']
    if title:
        parts.append(f'<title>{escape(title)}</title>')
        parts.append(f'<text x="{left}" y="13" font-size="11" font-weight="bold" '
                     f'fill="{TEXT_COLOR}">{escape(title)}</text>')
    if not xs or not ys:
        parts.append(f'<text x="{left + plot_w / 2:.0f}" y="{top + plot_h / 2:.0f}" text-anchor="middle" '
                     f'fill="{TEXT_COLOR}">no finite values yet</text>')
        parts.extend(_paths(lines, lambda x, y: (0.0, 0.0), draw=False))
        parts.append("</svg>")
        return "".join(parts)

    x_lo, x_hi = _span(min(xs), max(xs), pad=0.0)
    y_lo, y_hi = _span(min(ys), max(ys), pad=0.05)

    def place(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x_lo) / (x_hi - x_lo) * plot_w,
                top + (1.0 - (y - y_lo) / (y_hi - y_lo)) * plot_h)

    y_ticks, y_step = nice_ticks(y_lo, y_hi, 4)
    for tick in y_ticks:
        _, py = place(x_lo, tick)
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{py:.1f}" y2="{py:.1f}" '
                     f'stroke="{GRID_COLOR}"/>')
        parts.append(f'<text x="{left - 4}" y="{py + 3.5:.1f}" text-anchor="end" '
                     f'fill="{TEXT_COLOR}">{format_tick(tick, y_step)}</text>')
    x_ticks, x_step = nice_ticks(x_lo, x_hi, 4)
    for tick in x_ticks:
        px, _ = place(tick, y_lo)
        parts.append(f'<text x="{px:.1f}" y="{height - 6}" text-anchor="middle" '
                     f'fill="{TEXT_COLOR}">{format_tick(tick, x_step)}</text>')
    parts.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" '
                 f'stroke="{GRID_COLOR}"/>')
    parts.extend(_paths(lines, place, draw=True))
    if len(lines) > 1:
        parts.extend(_legend(lines, left + plot_w - 4, top + 4))
    parts.append("</svg>")
    return "".join(parts)


def data_uri(svg: str) -> str:
    """``data:image/svg+xml;base64,…`` for an ``<img src>``."""
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode("ascii")


def nice_ticks(lo: float, hi: float, count: int) -> tuple[list[float], float]:
    """About ``count`` round tick values within [lo, hi] (steps of 1, 2, 2.5 or 5 × 10^k), and
    the step."""
    span = hi - lo
    if not span > 0 or not math.isfinite(span):
        return [lo], 1.0
    raw = span / max(1, count)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * magnitude >= raw * 0.999)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = []
    k = 0
    while first + k * step <= hi + step * 1e-9 and k <= 2 * count + 2:
        ticks.append(first + k * step)
        k += 1
    return ticks, step


def format_tick(value: float, step: float) -> str:
    """A tick label with just the decimals the step needs; k/M/G for large round numbers."""
    if value == 0 or abs(value) < step * 1e-6:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1e4 and step >= 1:
        for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if magnitude >= factor:
                return f"{value / factor:.3g}{suffix}"
    if magnitude < 1e-3 or magnitude >= 1e9:
        return f"{value:.2g}"
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    if round(step / 10.0 ** -decimals, 6) % 1:  # 2.5 × 10^k needs one more decimal
        decimals += 1
    return f"{value:.{decimals}f}"


def format_value(value: float) -> str:
    """A latest-value label: 4 significant digits, no noise."""
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    if 1e-3 <= abs(value) < 1e6:
        return f"{value:.4g}"
    return f"{value:.3e}"


def _span(lo: float, hi: float, pad: float) -> tuple[float, float]:
    if hi > lo:
        margin = (hi - lo) * pad
        return lo - margin, hi + margin
    delta = abs(lo) * 0.1 or 1.0  # a flat line: centre it
    return lo - delta, hi + delta


def _paths(lines: Sequence[Line], place: _Placer, draw: bool) -> list[str]:
    parts = []
    for line in lines:
        commands: list[str] = []
        pen_down = False
        last: tuple[float, float] | None = None
        if draw:
            for x, y in zip(line.xs, line.ys, strict=True):
                if not (math.isfinite(x) and math.isfinite(y)):
                    pen_down = False
                    continue
                px, py = place(x, y)
                commands.append(f"{'L' if pen_down else 'M'}{px:.1f} {py:.1f}")
                pen_down, last = True, (px, py)
        reported = len(line.xs) if line.reported is None else line.reported
        parts.append(f'<path d="{"".join(commands)}" fill="none" stroke="{line.color}" stroke-width="1.5" '
                     f'stroke-linejoin="round" stroke-linecap="round" data-series="{escape(line.label)}" '
                     f'data-points="{len(line.xs)}" data-reported="{reported}"/>')
        if last is not None:  # mark the latest point: where the run is now
            parts.append(f'<circle cx="{last[0]:.1f}" cy="{last[1]:.1f}" r="2.5" fill="{line.color}"/>')
    return parts


def _legend(lines: Sequence[Line], right_x: float, top_y: float) -> list[str]:
    parts = []
    for i, line in enumerate(lines[:10]):
        y = top_y + 9 + i * 12
        parts.append(f'<text x="{right_x - 12:.0f}" y="{y + 3.5:.0f}" text-anchor="end" '
                     f'fill="{TEXT_COLOR}">{escape(line.label)}</text>')
        parts.append(f'<line x1="{right_x - 9:.0f}" x2="{right_x:.0f}" y1="{y:.0f}" y2="{y:.0f}" '
                     f'stroke="{line.color}" stroke-width="2"/>')
    return parts

