"""The live view in the running cell: every rank's progress, a chart per metric, latest values,
progress bars.

The launcher makes one per launch and feeds it every :class:`~accelnb.wire.events.MetricBatch` from
the waiting thread (the kernel's main thread, inside the cell)::

    view = LiveMetricsView(all_ranks=False)
    view.add(batch)        # for every batch, as it arrives: cheap, never draws more than needed
    view.close()           # at the end, success or failure: draws the final state

Producers never render: ``add`` only folds points into bounded per-series buffers and marks the
view dirty; a throttled draw (at most a few per second, slower if drawing gets expensive) turns
them into one HTML document, shown with ``display(display_id=True)`` and then updated in place.
A wait hook (:func:`accelnb.kernel.run.run_state.add_wait_hook`) draws what arrived after the last draw
even when no more batches come. So 20,000 reports a second cost the notebook four small
messages a second, well under Jupyter's IOPub rate limits.

Charts are SVG images (:mod:`accelnb.notebook.svg_chart`) inside a ``text/html`` output, plus a
``text/plain`` table; the final update is what the saved notebook keeps, so a notebook run
headless, or opened later, still shows the curves. Each chart thins its series to at most
``2 × points_per_chart`` evenly spaced reports plus the latest; the launch's
:class:`~accelnb.kernel.display.metrics_history.MetricHistory` keeps everything.

Above the charts, once any rank counts a step, the per-rank table of :mod:`accelnb.notebook.rank_table`
(steps, speed, waits, GPU, memory), from the launch's
:class:`~accelnb.kernel.display.rank_activity.RankActivity` (:meth:`LiveMetricsView.follow`); it alone
redraws at most once a second.

Nothing is displayed when nothing was reported and no step was counted. Without an IPython kernel (a script, a terminal)
the view prints a compact text summary at close instead. A surface that raises follows accelnb's
observer policy (:mod:`accelnb.kernel.watched_state.observers`): the view logs the error once, stops drawing,
and the launch goes on.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from html import escape
from typing import Any, Protocol, TextIO

from accelnb.kernel.display.rank_activity import RankActivity
from accelnb.kernel.run import run_state
from accelnb.notebook import rank_table
from accelnb.notebook.svg_chart import PALETTE, Line, data_uri, format_value, line_chart
from accelnb.wire.events import MetricBatch, ProgressBatch, ProgressState

MIN_REDRAW_INTERVAL_S = 0.25
RANK_TABLE_INTERVAL_S = 1.0  # the per-rank table alone (steps, GPU samples) redraws at most this often
RENDER_BUDGET = 0.05  # at most this fraction of the kernel's time goes to drawing
POINTS_PER_CHART = 150
MAX_CHARTS = 12
RATE_SMOOTHING = 0.3  # weight of the newest rate sample in a bar's moving average

_log = logging.getLogger(__name__)


class DisplaySurface(Protocol):
    """Where the view draws: the cell (IPython) or a text stream. Injectable for tests.
    A surface with ``live = False`` shows only the final state, so nothing is drawn before it."""

    def draw(self, bundle: dict[str, str], final: bool) -> None:
        """Show ``bundle`` (a MIME bundle), replacing what the previous call showed."""


class NotebookSurface:
    """One display output in the running cell, updated in place."""

    def __init__(self) -> None:
        self._handle: Any = None

    def draw(self, bundle: dict[str, str], final: bool) -> None:
        from IPython.display import display

        if self._handle is None:
            self._handle = display(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)


class TextSurface:
    """Prints the final state only: a script's terminal has no place to update in."""

    live = False  # the view renders nothing for it until the end

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream

    def draw(self, bundle: dict[str, str], final: bool) -> None:
        if final:
            stream = self._stream or sys.stdout
            stream.write(bundle["text/plain"] + "\n")
            stream.flush()


def default_surface() -> DisplaySurface:
    """The cell when running in a Jupyter kernel, else standard output."""
    shell = sys.modules.get("IPython") and _ipython_shell()
    if shell is not None and getattr(shell, "kernel", None) is not None:
        return NotebookSurface()
    return TextSurface()


def _ipython_shell() -> Any:
    from IPython import get_ipython

    return get_ipython()


class _ThinnedSeries:
    """At most ``2 × capacity`` evenly spaced points of one series, plus the latest.

    Keeps every ``stride``-th report; when full, drops every other kept point and doubles the
    stride: O(1) per report, bounded memory, and the kept points stay evenly spaced.
    """

    __slots__ = ("capacity", "count", "high", "last", "low", "stride", "xs", "ys")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.xs: list[float] = []
        self.ys: list[float] = []
        self.stride = 1
        self.count = 0
        self.last: tuple[float, float] = (math.nan, math.nan)
        self.low = math.inf
        self.high = -math.inf

    def append(self, x: float, y: float) -> None:
        if self.count % self.stride == 0:
            self.xs.append(x)
            self.ys.append(y)
            if len(self.xs) >= 2 * self.capacity:
                del self.xs[1::2], self.ys[1::2]
                self.stride *= 2
        self.count += 1
        self.last = (x, y)
        if y < self.low:  # NaN compares false: extremes are of the finite-or-infinite values
            self.low = y
        if y > self.high:
            self.high = y

    def points(self) -> tuple[list[float], list[float]]:
        if (self.count - 1) % self.stride == 0:  # the latest report is among the kept ones
            return self.xs, self.ys
        return [*self.xs, self.last[0]], [*self.ys, self.last[1]]


@dataclass
class _Bar:
    state: ProgressState
    rate: float | None = None  # items per second, smoothed

    def __post_init__(self) -> None:
        self._average_if_unknown()

    def advance(self, state: ProgressState) -> None:
        elapsed = state.time - self.state.time
        if state.closed:
            total_time = state.time - state.started
            self.rate = state.n / total_time if total_time > 0 else self.rate  # the average, as tqdm
        elif elapsed > 0 and state.n >= self.state.n and state.bar_id == self.state.bar_id:
            sample = (state.n - self.state.n) / elapsed
            self.rate = sample if self.rate is None else (
                RATE_SMOOTHING * sample + (1 - RATE_SMOOTHING) * self.rate)
        elif state.bar_id != self.state.bar_id:
            self.rate = None
        self.state = state
        self._average_if_unknown()

    def _average_if_unknown(self) -> None:
        state = self.state
        if self.rate is None and state.time > state.started and state.n:
            self.rate = state.n / (state.time - state.started)


class LiveMetricsView:
    """Draws rank 0's metrics (every rank's with ``all_ranks``) and rank 0's progress bars."""

    def __init__(self, all_ranks: bool, *, surface: DisplaySurface | None = None,
                 min_interval: float = MIN_REDRAW_INTERVAL_S,
                 points_per_chart: int = POINTS_PER_CHART,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.all_ranks = all_ranks
        self._surface = surface
        self._min_interval = min_interval
        self._points = points_per_chart
        self._clock = clock
        self._series: dict[str, dict[int, _ThinnedSeries]] = {}
        self._steps: dict[str, dict[int, int | None]] = {}  # latest step per metric and rank
        self._bars: dict[int, _Bar] = {}  # by nesting position
        self.reports = 0  # records folded in (of the ranks shown)
        self.draws = 0
        self._dirty = False
        self._last_draw = -math.inf
        self._interval = min_interval
        self._unhook: Callable[[], None] | None = None
        self._closed = False
        self._broken = False
        self._activity: RankActivity | None = None
        self._activity_due = False  # the ranks' figures changed since the last draw

    def follow(self, activity: RankActivity) -> None:
        """Show ``activity``'s per-rank table above the charts once any rank counts a step."""
        self._activity = activity

    def activity_changed(self) -> None:
        """A rank's steps changed (a step window arrived): redraw within a second."""
        if self._closed or self._broken or self._activity is None or not self._activity.counting:
            return
        # Sampled whether or not anything draws: the launch's result keeps the GPU samples.
        self._activity.sample()
        self._activity_due = True
        if self._unhook is None:
            self._unhook = run_state.add_wait_hook(self._on_wait)
        self._on_wait()

    # ── feeding ─────────────────────────────────────────────────────────────────────────────
    def add(self, batch: MetricBatch) -> None:
        if self._closed or self._broken:
            return
        changed = False
        if batch.records and (self.all_ranks or batch.rank == 0):
            self._fold(batch.rank, batch.records)
            changed = True
        if isinstance(batch, ProgressBatch) and batch.bars and batch.rank == 0:
            for state in batch.bars:
                bar = self._bars.get(state.position)
                if bar is None:
                    self._bars[state.position] = _Bar(state)
                else:
                    bar.advance(state)
            changed = True
        if changed:
            self._dirty = True
            if self._unhook is None:
                self._unhook = run_state.add_wait_hook(self._on_wait)
            self._on_wait()

    def _fold(self, rank: int, records: list[tuple[int | None, float, dict[str, float]]]) -> None:
        series, steps, capacity = self._series, self._steps, self._points
        for step, _, values in records:
            for name, value in values.items():
                by_rank = series.get(name)
                if by_rank is None:
                    by_rank = series[name] = {}
                    steps[name] = {}
                line = by_rank.get(rank)
                if line is None:
                    line = by_rank[rank] = _ThinnedSeries(capacity)
                line.append(line.count if step is None else step, value)
                steps[name][rank] = step
        self.reports += len(records)

    def _on_wait(self) -> None:
        """Draw if something changed and the last draw is old enough (also the wait hook)."""
        if self._surface is None:
            self._surface = default_surface()
        if not getattr(self._surface, "live", True):  # a script: only the final state is shown
            return
        since = self._clock() - self._last_draw
        ranks_due = self._activity_due and since >= max(self._interval, RANK_TABLE_INTERVAL_S)
        if (self._dirty and since >= self._interval) or ranks_due:
            self._draw(final=False)

    def close(self) -> None:
        """Draw the final state (kept by the saved notebook) and stop listening."""
        if self._closed:
            return
        self._closed = True
        if self._unhook is not None:
            self._unhook()
            self._unhook = None
        if (self._series or self._bars or self._shows_ranks()) and not self._broken:
            self._draw(final=True)

    def _shows_ranks(self) -> bool:
        return self._activity is not None and self._activity.counting

    # ── drawing ─────────────────────────────────────────────────────────────────────────────
    def _draw(self, final: bool) -> None:
        started = self._clock()
        try:
            if self._shows_ranks():
                assert self._activity is not None
                self._activity.sample(force=final)  # NVML and /proc, at most once a second
            if self._surface is None:
                self._surface = default_surface()
            self._surface.draw({"text/html": self.render_html(final), "text/plain": self.render_text(final)},
                               final)
        except Exception:  # accelnb's observer policy: a broken display never breaks the launch
            self._broken = True
            if self._unhook is not None:
                self._unhook()
                self._unhook = None
            _log.warning("accelnb: the live metrics display failed and stops drawing; the launch goes "
                         "on, and its metric history still has everything.", exc_info=True)
            return
        self.draws += 1
        self._dirty = self._activity_due = False
        self._last_draw = self._clock()
        # Expensive drawings (many metrics, many ranks) are drawn less often.
        self._interval = max(self._min_interval, (self._last_draw - started) / RENDER_BUDGET)

    def render_html(self, final: bool) -> str:
        parts = ['<div class="accelnb-metrics" style="font-family: sans-serif; font-size: 12px; '
                 'line-height: 1.4; margin: 4px 0">']
        if self._shows_ranks():
            assert self._activity is not None
            parts.append(rank_table.render_html(self._activity.rows(), final))
        if self._bars:
            parts.append('<div class="accelnb-progress" style="margin-bottom: 6px">')
            parts.extend(self._bar_html(bar, final) for _, bar in sorted(self._bars.items()))
            parts.append("</div>")
        if self._series:
            parts.append('<div style="display: flex; flex-wrap: wrap; gap: 8px">')
            for name in list(self._series)[:MAX_CHARTS]:
                parts.append(self._chart_html(name))
            parts.append("</div>")
            parts.append(self._table_html())
            hidden = len(self._series) - MAX_CHARTS
            status = [self._ranks_label(), _count(self.reports, "report")]
            if hidden > 0:
                status.append(f"{hidden} more metric{'s' if hidden > 1 else ''} in the table only")
            status.append("final" if final else "live")
            parts.append(f'<div style="opacity: 0.6; margin-top: 2px">{escape(" · ".join(status))}</div>')
        parts.append("</div>")
        return "".join(parts)

    def render_text(self, final: bool) -> str:
        lines = []
        if self._shows_ranks():
            assert self._activity is not None
            lines.append(rank_table.render_text(self._activity.rows(), final))
        if self._series:
            lines.append(f"accelnb metrics ({self._ranks_label()}, {_count(self.reports, 'report')}"
                         f"{'' if final else ', live'}):")
            width = max(len(name) for name in self._series)
            for name, by_rank in self._series.items():
                for rank, line in sorted(by_rank.items()):
                    who = f" [rank {rank}]" if self.all_ranks else ""
                    step = self._steps[name][rank]
                    at = f" at step {step}" if step is not None else ""
                    lines.append(f"  {name:<{width}}{who}  last {format_value(line.last[1])}{at}  "
                                 f"min {format_value(line.low)}  max {format_value(line.high)}  "
                                 f"({_count(line.count, 'report')})")
        for _, bar in sorted(self._bars.items()):
            lines.append("  " + _bar_text(bar, final))
        return "\n".join(lines)

    def _chart_html(self, name: str) -> str:
        lines = []
        for rank, series in sorted(self._series[name].items()):
            xs, ys = series.points()
            lines.append(Line(f"rank {rank}", xs, ys, PALETTE[rank % len(PALETTE)], series.count))
        svg = line_chart(lines, title=name)
        drawn = sum(len(line.xs) for line in lines)
        reported = sum(line.reported or 0 for line in lines)
        alt = f"chart of {name}, {reported:,} reports"
        return (f'<div class="accelnb-chart" data-metric="{escape(name)}" data-points="{drawn}" '
                f'data-reported="{reported}"><img src="{data_uri(svg)}" width="320" height="180" '
                f'alt="{escape(alt)}"></div>')

    def _table_html(self) -> str:
        cell = 'style="padding: 1px 8px; text-align: right"'
        head = 'style="padding: 1px 8px; text-align: left"'
        rows = []
        if self.all_ranks:
            ranks = sorted({rank for by_rank in self._series.values() for rank in by_rank})
            rows.append(f"<tr><th {head}>metric</th><th {cell}>step</th>"
                        + "".join(f"<th {cell}>rank {rank}</th>" for rank in ranks) + "</tr>")
            for name, by_rank in self._series.items():
                step = max((s for s in self._steps[name].values() if s is not None), default=None)
                values = "".join(
                    f"<td {cell}>{format_value(by_rank[rank].last[1]) if rank in by_rank else ''}</td>"
                    for rank in ranks)
                rows.append(f"<tr><td {head}>{escape(name)}</td><td {cell}>{_step_text(step)}</td>"
                            f"{values}</tr>")
        else:
            rows.append(f"<tr><th {head}>metric</th><th {cell}>step</th><th {cell}>last</th>"
                        f"<th {cell}>min</th><th {cell}>max</th><th {cell}>reports</th></tr>")
            for name, by_rank in self._series.items():
                line = by_rank[0]
                numbers = (_step_text(self._steps[name][0]), format_value(line.last[1]),
                           format_value(line.low), format_value(line.high), f"{line.count:,}")
                rows.append(f"<tr><td {head}>{escape(name)}</td>"
                            + "".join(f"<td {cell}>{number}</td>" for number in numbers) + "</tr>")
        return ('<table class="accelnb-latest" style="border-collapse: collapse; margin-top: 4px; '
                f'font-variant-numeric: tabular-nums">{"".join(rows)}</table>')

    def _bar_html(self, bar: _Bar, final: bool) -> str:
        state = bar.state
        complete = state.n >= state.total if state.total is not None else state.closed
        if complete:
            colour = "#2ca02c"
        elif state.closed:  # the loop broke out early
            colour = "#7f7f7f"
        else:  # still running, or stopped with the run
            colour = "#d62728" if final else "#1f77b4"
        fraction = min(1.0, state.n / state.total) if state.total else (1.0 if complete else 0.0)
        track = ("display: inline-block; vertical-align: middle; width: 240px; height: 10px; "
                 "background: #8884; border-radius: 3px; overflow: hidden; margin: 0 6px")
        fill = f"display: block; width: {fraction * 100:.1f}%; height: 100%; background: {colour}"
        return (f'<div class="accelnb-bar" data-n="{state.n}" data-total="{state.total or ""}">'
                f'<span style="display: inline-block; min-width: 6em">{escape(state.desc or "")}</span>'
                f'<span style="{track}"><span style="{fill}"></span></span>'
                f'<span style="font-family: monospace">{escape(_bar_text(bar, final, with_desc=False))}'
                "</span></div>")

    def _ranks_label(self) -> str:
        if not self.all_ranks:
            return "rank 0"
        ranks = sorted({rank for by_rank in self._series.values() for rank in by_rank})
        return "ranks " + ", ".join(map(str, ranks))


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def _step_text(step: int | None) -> str:
    return "" if step is None else f"{step:,}"


def _bar_text(bar: _Bar, final: bool, with_desc: bool = True) -> str:
    """tqdm's layout: ``desc  45% 450/1000 [00:12<00:15, 37.2 it/s]``."""
    state = bar.state
    elapsed = _clock_text(max(0.0, state.time - state.started))
    rate = bar.rate
    if rate is None or rate <= 0:
        rate_text = "? it/s"
    elif rate >= 1:
        rate_text = f"{rate:,.1f} it/s" if rate < 100 else f"{rate:,.0f} it/s"
    else:
        rate_text = f"{1 / rate:,.2f} s/it"
    if state.total:
        percent = f"{min(100.0, 100 * state.n / state.total):3.0f}%"
        left = (_clock_text((state.total - state.n) / rate) if rate and state.n < state.total
                else ("00:00" if state.n >= state.total else "?"))
        text = f"{percent} {state.n:,}/{state.total:,} [{elapsed}<{left}, {rate_text}]"
    else:
        text = f"{state.n:,} it [{elapsed}, {rate_text}]"
    if final and not state.closed and not (state.total is not None and state.n >= state.total):
        text += " stopped"
    return f"{state.desc}: {text}" if with_desc and state.desc else text


def _clock_text(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"
