"""The worker half of live metrics: ``accelnb.report()`` buffers scalars, a thread ships them.

Reports are appended to an in-process list (a few hundred nanoseconds) and sent to the kernel as
one :class:`~accelnb.events.MetricBatch` per flush, so reporting every step of a fast loop costs
the loop nothing measurable. Outside a launch, ``report`` is a no-op that warns once.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any

from accelnb.channel import MessageWriter
from accelnb.events import MetricBatch

_writer: MessageWriter | None = None
_rank = 0
_pending: list[tuple[int | None, float, dict[str, float]]] = []
_lock = threading.Lock()
_warned = False


def attach(writer: MessageWriter, rank: int) -> None:
    """Called by the worker at start: from now on reports go to the kernel."""
    global _writer, _rank
    _writer, _rank = writer, rank


def report(metrics: Mapping[str, Any] | None = None, /, *, step: int | None = None,
           **scalars: Any) -> None:
    """Record scalar metrics of this rank, shown live in the notebook and returned by the launch.

    ``report(step=10, loss=0.5, lr=1e-3)`` or ``report({"loss": 0.5}, step=10)``. Values may be
    Python numbers or one-element tensors (on any device).
    """
    global _warned
    if _writer is None:
        if not _warned:
            warnings.warn("accelnb.report() called outside a distributed launch; ignored.", stacklevel=2)
            _warned = True
        return
    values = {**(metrics or {}), **scalars}
    record = {name: _to_float(name, value) for name, value in values.items()}
    with _lock:
        _pending.append((step, time.time(), record))


def flush() -> None:
    """Send what was reported since the last flush (the worker's flusher thread calls this)."""
    global _pending
    if _writer is None or not _pending:
        return
    with _lock:
        batch, _pending = _pending, []
    _writer.send(MetricBatch(_rank, batch))


def _to_float(name: str, value: Any) -> float:
    if hasattr(value, "item"):  # tensors and numpy scalars, on any device
        value = value.item()
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"accelnb.report: metric {name!r} must be a number or a one-element tensor, "
            f"got {type(value).__name__}.") from None
