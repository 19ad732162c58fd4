"""The sweep's live table in the running cell: one row per trial, one display updated in place.

    table = SweepTable(trials)      # nothing is drawn yet
    table.refresh()                 # from the sweep's waiting loop: draws at most once a second
    table.close()                   # the final state, what the saved notebook keeps

Rows: the trial, its config, its GPUs, its state, its time, the last metrics it ``report()``ed,
the value it returned once it ended (or, for a failed trial, its root cause), and a ★ on the best
so far by the sweep's ``best=`` metric. Trials' output is not in the cell: it is kept per trial
(``trial.output()``).

Drawn like the launch's live view (:mod:`accelnb.notebook.metrics_view`): an HTML table and a
``text/plain`` one in one ``display(display_id=True)``, then updated in place; without an IPython
kernel (a script) only the final table is printed. The block is between ``<!-- accelnb-sweep -->``
markers (HTML) and starts with ``accelnb sweep`` (text). A surface that raises follows the
observer policy: logged once, no more drawing, the sweep goes on.
"""

from __future__ import annotations

import logging
import time
from html import escape
from typing import Any

from accelnb.kernel.sweep.trials import Trial, Trials, describe_config
from accelnb.notebook.metrics_view import DisplaySurface, default_surface
from accelnb.notebook.svg_chart import format_value

REDRAW_INTERVAL_S = 1.0
MAX_METRICS_SHOWN = 4
VALUE_WIDTH = 40

_log = logging.getLogger(__name__)


class SweepTable:
    """The live table of one sweep's trials."""

    def __init__(self, trials: Trials, *, surface: DisplaySurface | None = None,
                 interval: float = REDRAW_INTERVAL_S) -> None:
        self._trials = trials
        self._surface = surface or default_surface()
        self._interval = interval
        self._drawn_at = -float("inf")
        self._broken = False

    def refresh(self) -> None:
        """Draw the current state, unless the last draw is less than the interval ago."""
        now = time.monotonic()
        if now - self._drawn_at < self._interval or not getattr(self._surface, "live", True):
            return
        self._drawn_at = now
        self._draw(final=False)

    def close(self) -> None:
        self._draw(final=True)

    def _draw(self, final: bool) -> None:
        if self._broken:
            return
        try:
            self._surface.draw({"text/plain": render_text(self._trials, final),
                                "text/html": render_html(self._trials, final)}, final)
        except Exception:  # accelnb's observer policy: a broken display never breaks the sweep
            self._broken = True
            _log.warning("accelnb: the sweep's table failed and stops drawing; the sweep goes on.", exc_info=True)


def _cells(trial: Trial, leader: Trial | None) -> list[str]:
    elapsed = trial.elapsed
    if trial.state == "failed":
        outcome = trial.error_summary
    elif trial.ok:
        outcome = _short(trial.value)
    elif trial.state == "stopped":
        outcome = "stopped"
    else:
        outcome = ""
    shown = list(trial.latest.items())[:MAX_METRICS_SHOWN]
    metrics = ", ".join(f"{name} {format_value(value)}" for name, value in shown)
    return [str(trial.index), describe_config(trial.config), ",".join(map(str, trial.gpus)) or
            ("cpu" if trial.state != "queued" else ""), trial.state,
            "" if elapsed is None else f"{elapsed:.1f} s", metrics, outcome, "★" if trial is leader else ""]


_TITLES = ["trial", "config", "GPUs", "state", "time", "last metrics", "value", "best"]


def render_text(trials: Trials, final: bool) -> str:
    leader = trials.best if final else trials.leader()
    rows = [_TITLES] + [_cells(trial, leader) for trial in trials]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_TITLES))]
    lines = [f"accelnb sweep ({'final' if final else 'live'}): {_summary(trials)}"]
    lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
              for row in rows]
    return "\n".join(lines)


def render_html(trials: Trials, final: bool) -> str:
    leader = trials.best if final else trials.leader()
    cell = 'style="padding: 1px 8px; text-align: left; vertical-align: top"'
    lines = ["<tr>" + "".join(f"<th {cell}>{escape(t)}</th>" for t in _TITLES) + "</tr>"]
    for trial in trials:
        style = ' style="background: #d627281a"' if trial.state == "failed" else \
            ' style="background: #2ca02c1a"' if trial is leader else ""
        lines.append(f"<tr{style}>" + "".join(f"<td {cell}>{escape(c)}</td>" for c in _cells(trial, leader)) + "</tr>")
    return (f'<!-- accelnb-sweep --><div style="margin-bottom: 4px">accelnb sweep: {escape(_summary(trials))}</div>'
            '<table class="accelnb-sweep" style="border-collapse: collapse; font-variant-numeric: tabular-nums">'
            f'{"".join(lines)}</table><!-- /accelnb-sweep -->')


def _summary(trials: Trials) -> str:
    counts: dict[str, int] = {}
    for trial in trials:
        counts[trial.state] = counts.get(trial.state, 0) + 1
    parts = [f"{counts[state]} {state}" for state in ("running", "queued", "done", "failed", "stopped", "skipped")
             if counts.get(state)]
    best = f"; best by {trials.metric} ({'lowest' if trials.mode == 'min' else 'highest'})" if trials.metric else ""
    return f"{len(trials)} trials: " + ", ".join(parts) + best


def _short(value: Any) -> str:
    if isinstance(value, float):
        return format_value(value)
    text = repr(value)
    return text if len(text) <= VALUE_WIDTH else text[:VALUE_WIDTH - 1] + "…"
