"""A progress bar for launched functions, drawn in the notebook cell from rank 0's loop.

    for batch in accelnb.progress(loader, desc="epoch 1"):      # inside the launched function
        ...

    with accelnb.progress(total=num_steps, desc="train") as bar:    # or updated by hand
        while ...:
            bar.update()

Every rank may run the same code; only rank 0's bars are shown (one bar per nesting level: an
inner loop's new bar takes over the line of the previous one). The cell shows description,
percentage, count, elapsed time, rate and ETA, in the same live display as the metrics. In the
worker a bar is a counter: the flusher thread reads it every 50 ms, so iterating costs about
what a bare generator costs, and ranks other than 0 iterate the wrapped iterable directly.

Outside a launch (a plain script, the notebook itself) ``progress`` just iterates.
tqdm keeps working in workers too, as text: the output router collapses its ``\\r`` updates.

Module-level state: ``_bar_ids``, ids of the rank's bars, unique within the rank process.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Generic, TypeVar

from accelnb.wire.events import ProgressState
from accelnb.worker import report

T = TypeVar("T")

_bar_ids = itertools.count(1)


class Progress(Generic[T]):
    """One bar; make it with :func:`progress`."""

    def __init__(self, iterable: Iterable[T] | None, total: int | None, desc: str | None) -> None:
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:  # __len__ that refuses (a generator-backed sized view)
                total = None
        if total is not None:
            total = int(total)
        self.iterable = iterable
        self.total = total
        self.desc = desc
        self.n = 0
        self.closed = False
        self._shown = report.drives_progress()
        self._bar_id = next(_bar_ids)
        self._started = time.time()
        self._sent: tuple[int, bool] | None = None  # (n, closed) at the last snapshot
        self._position = report.open_bar(self._bar_id, self) if self._shown else 0

    def __iter__(self) -> Iterator[T]:
        if self.iterable is None:
            raise TypeError("accelnb.progress(total=…) without an iterable is updated with .update(n), "
                            "not iterated.")
        if not self._shown:
            return iter(self.iterable)
        return self._counting()

    def _counting(self) -> Iterator[T]:
        assert self.iterable is not None
        try:
            for item in self.iterable:
                yield item
                self.n += 1
        finally:  # the loop ended, broke out, or raised
            self.close()

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("this progress bar has no total")
        return self.total

    def update(self, n: int = 1) -> None:
        """Advance the bar by ``n``."""
        self.n += n

    def close(self) -> None:
        """Mark the bar finished (iteration does it for you)."""
        self.closed = True

    def __enter__(self) -> Progress[T]:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def snapshot(self) -> ProgressState | None:
        """Read by the worker's flusher thread; None when nothing changed since last time."""
        n, closed = self.n, self.closed
        if self._sent == (n, closed):
            return None
        self._sent = (n, closed)
        return ProgressState(self._bar_id, self._position, self.desc, n, self.total, self._started,
                             time.time(), closed)

    def __repr__(self) -> str:
        of = f"/{self.total}" if self.total is not None else ""
        return f"<accelnb.progress {self.desc or ''!s} {self.n}{of}{' closed' if self.closed else ''}>"


def progress(iterable: Iterable[T] | None = None, total: int | None = None,
             desc: str | None = None) -> Progress[T]:
    """Wrap ``iterable`` (or count to ``total`` with ``.update()``) and show a bar in the cell.

    Args:
        iterable: what to iterate; its ``len()`` is the total when it has one.
        total: the number of items, when ``iterable`` has no ``len()`` (or there is no iterable).
        desc: a short label shown before the bar.

    Shown only for rank 0 of a launch; elsewhere it iterates without drawing anything.
    """
    return Progress(iterable, total, desc)
