"""Rank 0's ``report()`` scalars as TensorBoard event files: ``notebook_launcher(fn, log_dir="runs/exp1")``.

    >>> log = TensorBoardLog("runs/exp1")        # before anything starts: raises LaunchConfigError
    >>> log.add(batch, attempt=0)                # the launch's metric route calls this per batch
    >>> log.close()                              # flushed and closed when the launch ends

Then ``tensorboard --logdir runs`` shows ``exp1``. The metrics already arrive in the kernel (as
:class:`~accelnb.wire.events.MetricBatch` events), so the writer lives here, as one more metric
sink, and the ranks carry no TensorBoard code. It is TensorBoard's own writer
(``EventFileWriter``, the one ``torch.utils.tensorboard.SummaryWriter`` wraps), used directly so
that the kernel never imports torch for it (0.2 s to import, against 1.5 s for SummaryWriter).

What is written:

- rank 0's reports only (the other ranks' are in ``LaunchResult.metrics``); one scalar per
  metric, under its own name (``"val/acc"`` is grouped under ``val`` in TensorBoard);
- every value ``report()`` takes is a scalar by the time it gets here: Python ints, floats and
  bools, numpy scalars and one-element tensors, which the rank turned into a float; TensorBoard
  stores it as a 32-bit float. ``report()`` refuses anything else (tensors of several elements,
  strings) with a TypeError on the rank, and ``AccelerateTracker`` leaves out non-scalars
  (strings, images, tables) before they reach ``report()``; so nothing non-scalar is written;
- the step is the reported step; a report without one gets its position among rank 0's reports
  of the launch (0, 1, 2, …); the wall time is when the rank reported it.

The directory: ``log_dir`` is one TensorBoard run, as with ``SummaryWriter(log_dir=…)``. It is
created if missing, and each launch adds its own event file (and so appends to the run): a cell
run again continues the same curve. Use one directory per experiment (``runs/exp2``) to compare
experiments side by side.

Restarts: each attempt, the first included, begins with TensorBoard's restart marker
(``SessionLog.START``) at its first reported step. TensorBoard then drops what an earlier attempt
(or launch) logged from that step on, which the restart rewound to its checkpoint, so the curve
continues instead of folding back. Nothing is lost: ``LaunchResult.metrics`` keeps every point,
with its attempt.
"""

from __future__ import annotations

import os
from typing import Any

from accelnb.errors import LaunchConfigError
from accelnb.wire.events import MetricBatch

INSTALL_HINT = "pip install 'accelnb[tensorboard]'"
FLUSH_INTERVAL_S = 5.0  # how stale a running TensorBoard may be (SummaryWriter's default is 120 s)


def require_tensorboard() -> Any:
    """TensorBoard's writer module, or a :class:`LaunchConfigError` saying how to install it."""
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer import event_file_writer
    except ImportError as missing:
        raise LaunchConfigError(
            f"log_dir= writes TensorBoard event files, which needs the tensorboard package, and it "
            f"cannot be imported here ({missing}). Install it with {INSTALL_HINT} (or pip install "
            "tensorboard), then restart the kernel; or leave log_dir unset.") from None
    return event_file_writer, event_pb2, summary_pb2


class TensorBoardLog:
    """An open event file in ``log_dir`` that rank 0's metric batches are written to."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        event_file_writer, self._events, self._summaries = require_tensorboard()
        self.log_dir = os.fspath(log_dir)
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            self._writer = event_file_writer.EventFileWriter(self.log_dir, flush_secs=FLUSH_INTERVAL_S)
        except OSError as error:
            raise LaunchConfigError(f"log_dir={self.log_dir!r} cannot be written: {error.strerror or error}. "
                                    "Choose a directory you can write to.") from None
        self._marked_attempts: set[int] = set()
        self._reports = 0  # rank 0's reports so far: the step of a report without one

    def add(self, batch: MetricBatch, attempt: int) -> None:
        """Write ``batch`` if it is rank 0's (a progress-bar update is a batch too: its records only)."""
        if batch.rank != 0 or not batch.records:
            return
        Summary, Event = self._summaries.Summary, self._events.Event
        for step, when, values in batch.records:
            position, self._reports = self._reports, self._reports + 1
            shown_step = position if step is None else step
            if attempt not in self._marked_attempts:  # this attempt's first report: where it (re)started
                self._marked_attempts.add(attempt)
                self._writer.add_event(Event(wall_time=when, step=shown_step, session_log=self._events.SessionLog(
                    status=self._events.SessionLog.START)))
            summary = Summary(value=[Summary.Value(tag=name, simple_value=value) for name, value in values.items()])
            self._writer.add_event(Event(wall_time=when, step=shown_step, summary=summary))

    def close(self) -> None:
        """Flush what is pending and close the file (and the writer's thread)."""
        self._writer.close()
