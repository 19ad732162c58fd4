"""The worker half of live metrics: ``accelnb.report()`` buffers scalars, a thread ships them.

    accelnb.report(step=step, loss=loss, lr=lr)      # in the launched function, on any rank
    accelnb.report({"val/acc": acc}, step=step)      # the dict form, for names that are not identifiers

Reports are appended to an in-process queue (well under a microsecond for float values) and sent to
the kernel as one :class:`~accelnb.wire.events.MetricBatch` per flush: the worker's flusher thread
calls :func:`flush` every 50 ms, and the worker once more after the call returns or raises, so
what was reported before a failure still reaches the kernel. Reporting every step of a fast loop
therefore costs the loop nothing measurable (``benchmarks/bench_metrics.py``).

Progress bars (:mod:`accelnb.worker.progress`) register here on rank 0; a flush that finds one changed
sends a :class:`~accelnb.wire.events.ProgressBatch` (a ``MetricBatch`` subclass, so the kernel routes
it like any metric batch) carrying their states.

Outside a launch, ``report`` is a no-op that warns once.

Module-level state, one per rank process (a process is one rank, with one channel to the
kernel): ``_writer`` and ``_rank`` (set when the rank attaches), the records not yet sent
(``_pending``, under ``_flush_lock``), ``_sealed`` (the rank is dying of SIGTERM), ``_warned``
(a report outside a launch warns once), the live bars (``_bars``, under ``_bars_lock``) and
``_reported_steps`` (the step numbers of the current call).
"""

from __future__ import annotations

import operator
import threading
import time
import warnings
from collections import deque
from collections.abc import Mapping
from typing import Any, Protocol

from accelnb.wire.channel import MessageWriter
from accelnb.wire.events import MetricBatch, ProgressBatch, ProgressState
from accelnb.worker import step_timing

Record = tuple[int | None, float, dict[str, float]]

RESERVED_NAMES = ("rank", "attempt", "step", "time")  # the other columns of MetricHistory.records
_STEP_LIMIT = 2**63  # steps are kept as 64-bit integers in the kernel

_now = time.time
_writer: MessageWriter | None = None
_rank = 0
# deque.append and deque.popleft are atomic, so report() needs no lock against the flusher.
_pending: deque[Record] = deque()
_flush_lock = threading.Lock()
_warned = False
# Set by seal() when the rank is about to die of SIGTERM: a report made after the last flush
# drained the queue would be lost, so report() then waits for the end instead of returning.
_sealed = False


class ProgressSource(Protocol):
    """What :mod:`accelnb.worker.progress` registers: a bar the flusher can read."""

    closed: bool

    def snapshot(self) -> ProgressState | None:
        """The bar's state if it changed since the last snapshot, else None."""


_bars: dict[int, ProgressSource] = {}
_bars_lock = threading.Lock()


def attach(writer: MessageWriter, rank: int) -> None:
    """Called by the worker at start: from now on reports go to the kernel."""
    global _writer, _rank
    _writer, _rank = writer, rank


def report(metrics: Mapping[str, Any] | None = None, /, *, step: int | None = None, total: int | None = None,
           **scalars: Any) -> None:
    """Record scalar metrics of this rank, shown live in the notebook and returned by the launch.

    ``report(step=10, loss=0.5, lr=1e-3)`` or ``report({"loss": 0.5}, step=10)``. Values may be
    Python numbers, numpy scalars or one-element tensors (on any device; ``.item()`` moves them
    to the CPU). ``step`` is an integer (the chart's x axis); without it, the chart uses the
    report's position in the series. ``total``: how many steps the run takes; on rank 0 it makes
    the cell's progress bar (fraction done, ETA), at ``step`` (counted from 1, or from 0 when the
    first step reported is 0) or else at the number of reports. A metric named ``total`` goes in
    the dict: ``report({"total": x})``. Outside a launch, nothing happens (one warning).

    Raises:
        TypeError: a value is not a number or one-element tensor, or ``step`` is not an integer.
        ValueError: a metric is called ``rank``, ``attempt``, ``step`` or ``time`` (those name the history's
            other columns), or ``step`` does not fit 64 bits.
    """
    if _writer is None:
        _warn_outside_launch()
        return
    if metrics:
        scalars = {**{_name(key): value for key, value in metrics.items()}, **scalars}
        if "step" in scalars:
            _reject_reserved(scalars)
    if "rank" in scalars or "time" in scalars or "attempt" in scalars:  # ("step" is the step keyword)
        _reject_reserved(scalars)
    for name, value in scalars.items():
        if type(value) is not float:  # the common case costs one type check
            scalars[name] = _to_float(name, value)
    if step is not None and (type(step) is not int or not -_STEP_LIMIT <= step < _STEP_LIMIT):
        step = _to_step(step)
    if total is not None and _rank == 0:
        _advance_reported_steps(step, total)
    _pending.append((step, _now(), scalars))
    if _sealed:  # read after the append: a report that returns is one the last flush sends
        threading.Event().wait()  # the process dies of SIGTERM within a second


def seal() -> None:
    """Called once the rank is to die of SIGTERM, before its last flush: from now on a report
    never returns. Code that reported a step and then wrote it down (to a file, a log) would
    otherwise show a step the kernel never got: reported after the last flush drained the queue,
    in the moment before the process died."""
    global _sealed
    _sealed = True


def flush(periodic: bool = False) -> None:
    """Send what was reported since the last flush; returns once it is sent, including what
    another thread's flush had already taken (the worker's flusher thread calls this too, with
    ``periodic``: then the steps' window goes only every ``step_timing.WINDOW_INTERVAL_S``)."""
    if _writer is None:
        return
    # The flusher thread and the worker's end-of-call (or SIGTERM) flush may race: one drains at
    # a time, and batches leave in the order they were drained. The check for "nothing pending"
    # is made under the lock: made before it, a flush finding the queue emptied by the flusher
    # thread would return while that thread's batch is still being sent, and the worker, thinking
    # everything went, would send its result and exit with the batch unsent (a failed attempt's
    # metrics came back empty, once in a full test run).
    with _flush_lock:
        steps = step_timing.take_window(_rank, step_timing.WINDOW_INTERVAL_S if periodic else 0.0)
        if steps is not None:
            _writer.send(steps)
        bars = _changed_bars() if _bars else []
        if not _pending and not bars:
            return
        records = [_pending.popleft() for _ in range(len(_pending))]
        _writer.send(ProgressBatch(_rank, records, bars) if bars else MetricBatch(_rank, records))


# ── progress bars (accelnb.worker.progress) ────────────────────────────────────────────────────────
def drives_progress() -> bool:
    """True in rank 0 of a launch: the one rank whose progress bars are shown."""
    return _writer is not None and _rank == 0


def open_bar(bar_id: int, bar: ProgressSource) -> int:
    """Register a bar until its closed state is sent; returns its nesting position."""
    with _bars_lock:
        position = sum(1 for bar in _bars.values() if not bar.closed)
        _bars[bar_id] = bar
    return position


def _changed_bars() -> list[ProgressState]:
    with _bars_lock:
        bars = list(_bars.items())
    states = []
    for bar_id, bar in bars:
        state = bar.snapshot()
        if state is None:
            continue
        states.append(state)
        if state.closed:
            with _bars_lock:
                _bars.pop(bar_id, None)
    return states


class _ReportedSteps:
    """The progress bar of ``report(total=…)`` on rank 0: a :class:`ProgressSource` like
    ``accelnb.progress``'s, moved by the reports instead of a loop."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.n = 0
        self.closed = False
        self._offset: int | None = None  # 1 when the steps count from 0
        self._started = time.time()
        self._sent: tuple[int, int] | None = None
        self._bar_id = -1  # apart from accelnb.progress's ids, which count up from 1
        self._position = open_bar(self._bar_id, self)

    def advance(self, step: int | None, total: int) -> None:
        self.total = total
        if step is None:
            self.n += 1
        else:
            if self._offset is None:
                self._offset = 1 if step == 0 else 0
            self.n = step + self._offset

    def snapshot(self) -> ProgressState | None:
        n, total = self.n, self.total
        if (n, total) == self._sent:
            return None
        self._sent = (n, total)
        return ProgressState(self._bar_id, self._position, "steps", n, total, self._started, time.time(),
                             closed=n >= total)


_reported_steps: _ReportedSteps | None = None


def _advance_reported_steps(step: int | None, total: Any) -> None:
    global _reported_steps
    try:
        total = operator.index(total)  # ints, numpy integers, integer tensors
    except TypeError:
        raise TypeError(f"accelnb.report: total= is how many steps the run takes, an integer; got "
                        f"{type(total).__name__} {total!r}. A metric named total goes in the dict: "
                        f"report({{'total': value}}).") from None
    if total <= 0:
        raise ValueError(f"accelnb.report: total={total}: the number of steps must be positive.")
    if _reported_steps is None or _reported_steps.closed:
        _reported_steps = _ReportedSteps(total)
    _reported_steps.advance(step, total)


# ── conversions, off the fast path ─────────────────────────────────────────────────────────
def _warn_outside_launch() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "accelnb.report() was called outside a distributed launch, so the metrics go nowhere; "
            "call it inside the function you pass to accelnb.launch / notebook_launcher or run "
            "with %%distributed.", stacklevel=3)


def _name(key: Any) -> str:
    return key if type(key) is str else str(key)


def _reject_reserved(scalars: Mapping[str, Any]) -> None:
    taken = [name for name in RESERVED_NAMES if name in scalars]
    raise ValueError(
        f"accelnb.report: metric name(s) {', '.join(map(repr, taken))} are reserved: every record "
        "already has 'rank', 'attempt', 'step' and 'time' columns. Pass the step as report(step=…) and give "
        "other metrics a different name (e.g. 'epoch_time').")


def _to_float(name: str, value: Any) -> float:
    if hasattr(value, "item"):  # tensors and numpy scalars, on any device
        try:
            value = value.item()
        except (RuntimeError, ValueError):  # a tensor with more than one element
            shape = tuple(getattr(value, "shape", ()))
            raise TypeError(
                f"accelnb.report: metric {name!r} must be a single number, got a tensor of shape "
                f"{shape}; reduce it first (e.g. {name}=t.mean()).") from None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"accelnb.report: metric {name!r} must be a number or a one-element tensor, "
            f"got {type(value).__name__}.") from None


def _to_step(step: Any) -> int:
    try:
        step = operator.index(step)  # ints, numpy integers, integer tensors
    except TypeError:
        raise TypeError(
            f"accelnb.report: step must be an integer, got {type(step).__name__} {step!r}.") from None
    if not -_STEP_LIMIT <= step < _STEP_LIMIT:
        raise ValueError(f"accelnb.report: step={step} does not fit in 64 bits.")
    return int(step)
