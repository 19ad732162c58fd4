"""The per-rank table of the live view: each rank's step, speed, waits, GPU and host memory.

Drawn by :class:`~accelnb.notebook.metrics_view.LiveMetricsView` above its charts, from the rows of
:class:`~accelnb.kernel.display.rank_activity.RankActivity`. HTML for the cell, and a few plain
text lines for a front end without HTML (and the saved notebook's ``text/plain``). The block is
between ``<!-- accelnb-ranks -->`` markers (HTML) and starts with ``accelnb ranks`` (text), so a
notebook test can mask figures that differ from run to run and keep the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from accelnb.kernel.display.byte_sizes import gpu_memory, human_bytes
from accelnb.kernel.display.rank_activity import GpuSample, RankRow

# A rank whose last step is this many of its step times ago (and at least STALL_MIN_S) is shown
# as not moving: the stall watch (stall_timeout=) shows its stack later, this says it at once.
STALL_STEPS = 5.0
STALL_MIN_S = 5.0


def render_html(rows: Sequence[RankRow], final: bool) -> str:
    cell = 'style="padding: 1px 8px; text-align: right"'
    head = 'style="padding: 1px 8px; text-align: left"'
    with_gpu = any(row.gpu is not None for row in rows)
    titles = ["step", "steps/s", "s/step", "before collective", "waiting", "host memory"]
    if with_gpu:
        titles += ["GPU", "util", "GPU memory", "power"]
    lines = [f"<tr><th {head}>rank</th>" + "".join(f"<th {cell}>{t}</th>" for t in titles) + f"<th {head}></th></tr>"]
    for row in rows:
        figures = [f"{row.steps:,}", _rate(row.steps_per_s), _seconds(row.step_s), _seconds(row.before_collective_s),
                   _share(row.waiting_share), _bytes(row.host_memory)]
        if with_gpu:
            figures += _gpu_figures(row.gpu)
        note = _note(row, final)
        style = ' style="background: #d627281a"' if row.slowest else ""
        lines.append(f"<tr{style}><td {head}>{row.rank}</td>" + "".join(f"<td {cell}>{f}</td>" for f in figures)
                     + f"<td {head}>{escape(note)}</td></tr>")
    return ('<!-- accelnb-ranks --><table class="accelnb-ranks" style="border-collapse: collapse; '
            f'margin-bottom: 6px; font-variant-numeric: tabular-nums">{"".join(lines)}</table><!-- /accelnb-ranks -->')


def render_text(rows: Sequence[RankRow], final: bool) -> str:
    lines = [f"accelnb ranks ({'final' if final else 'live'}):"]
    for row in rows:
        parts = [f"step {row.steps:,}"]
        if row.steps_per_s is not None:
            parts.append(f"{_rate(row.steps_per_s)} steps/s")
        if row.step_s is not None:
            parts.append(f"{_seconds(row.step_s)} s/step")
        if row.waiting_share is not None:
            parts.append(f"waiting {_share(row.waiting_share)}")
        if row.gpu is not None:
            parts.append("GPU " + " ".join(f for f in _gpu_figures(row.gpu) if f))
        if row.host_memory is not None:
            parts.append(f"host {_bytes(row.host_memory)}")
        note = _note(row, final)
        lines.append(f"  rank {row.rank}: " + ", ".join(parts) + (f"  ({note})" if note else ""))
    return "\n".join(lines)


def _note(row: RankRow, final: bool) -> str:
    if row.slowest:
        return "slowest to reach the collective"
    quiet = row.seconds_since_step
    if not final and quiet is not None and row.step_s and quiet >= max(STALL_MIN_S, STALL_STEPS * row.step_s):
        return f"no step for {quiet:.0f} s"
    return ""


def _gpu_figures(gpu: GpuSample | None) -> list[str]:
    if gpu is None:
        return ["", "", "", ""]
    label = f"{gpu.gpu}{' (synthetic)' if gpu.synthetic else ''}"
    util = "" if gpu.utilization is None else f"{gpu.utilization}%"
    memory = gpu_memory(gpu.memory_used, gpu.memory_total)
    power = "" if gpu.power_w is None else f"{gpu.power_w:.0f} W"
    return [label, util, memory, power]


def _rate(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:,.1f}" if value >= 1 else f"{value:.2f}"


def _seconds(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.3f}" if value < 10 else f"{value:,.1f}"


def _share(value: float | None) -> str:
    return "" if value is None else f"{value:.0%}"


def _bytes(value: int | None) -> str:
    return "" if value is None else human_bytes(value)
