"""Rank 0's library progress bars (tqdm, rich), mirrored as the cell's progress bar: the fraction
done and the ETA, on unchanged code.

The HF Trainer (``ProgressCallback``: ``tqdm(total=max_steps)``), Lightning's progress bar
(``RichProgressBar`` where rich is installed, else ``TQDMProgressBar``) and most training loops
already draw a bar on rank 0 that knows the total. The cell shows that bar's text too, but as a
line in the output; mirrored, it becomes the live view's bar (``accelnb.progress``'s,
:mod:`accelnb.worker.progress`) with its fraction and ETA, kept when the cell ends.

- **tqdm**: every bar is a ``tqdm.std.tqdm`` (``tqdm.auto``, ``tqdm.notebook`` and ``tqdm.rich``
  subclass it), so its ``__init__`` and ``close`` are wrapped once tqdm is imported. ``close`` reads
  the bar once more: a loop's bar writes its final count back only then.
- **rich**: every task added to a ``rich.progress.Progress`` (``add_task``) is read through the
  public ``Progress.tasks``; it is done once ``finished``, removed, or its ``Progress`` is gone.

Both are patched when the code imports the library
(:func:`~accelnb.worker.other_launchers.import_hooks.when_imported`), only on rank 0, and a
disabled or invisible bar is left alone. The mirror is read by the flusher thread every 50 ms and
holds the bar weakly: a bar dropped without being closed counts as closed.

Module-level state, one per rank process: ``_installed`` (the patches go in once) and ``_bar_ids``
(ids of mirrored bars, unique in the rank, far from :mod:`accelnb.worker.progress`'s own).
"""

from __future__ import annotations

import functools
import itertools
import time
import weakref
from typing import Any

from accelnb.wire.events import ProgressState
from accelnb.worker import report
from accelnb.worker.other_launchers.import_hooks import when_imported

# Far from accelnb.progress's ids (which count up from 1): both kinds share the bar registry.
_bar_ids = itertools.count(1 << 40)
_installed = False

Reading = tuple[int, "int | None", "str | None", bool]  # n, total, description, done


class _Mirror:
    """A :class:`~accelnb.worker.report.ProgressSource` over one library bar, read by ``read``
    (which returns None once the bar is gone)."""

    def __init__(self, first: Reading, read: Any) -> None:
        self._read = read
        self._bar_id = next(_bar_ids)
        self._started = time.time()
        self._reading = first
        self._sent: tuple[int, int | None, bool] | None = None
        self.closed = False
        self._position = report.open_bar(self._bar_id, self)

    def final(self, reading: Reading) -> None:
        """The library closes the bar: its last reading."""
        self._reading = reading
        self.closed = True

    def snapshot(self) -> ProgressState | None:
        if not self.closed:
            reading = self._read()
            if reading is None:  # dropped without closing: nothing more will come
                self.closed = True
            else:
                self._reading = reading
                self.closed = reading[3]
        n, total, desc, _ = self._reading
        if (n, total, self.closed) == self._sent:
            return None
        self._sent = (n, total, self.closed)
        return ProgressState(self._bar_id, self._position, desc, n, total, self._started, time.time(), self.closed)


def install() -> None:
    """Mirror rank 0's library bars from now on (once per process; the other ranks do nothing)."""
    global _installed
    if _installed or not report.drives_progress():
        return
    _installed = True
    when_imported("tqdm.std", _wrap_tqdm)
    when_imported("rich.progress", _wrap_rich)


# ── tqdm ──────────────────────────────────────────────────────────────────────────────────────
def _tqdm_reading(bar: Any) -> Reading:
    return int(bar.n), _whole(bar.total), (bar.desc or "").strip() or None, False


def _wrap_tqdm(module: Any) -> None:
    tqdm_class = module.tqdm
    original_init, original_close = tqdm_class.__init__, tqdm_class.close

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if not getattr(self, "disable", True) and report.drives_progress():
            bar = weakref.ref(self)
            self._accelnb_mirror = _Mirror(_tqdm_reading(self), lambda: _if_alive(bar, _tqdm_reading))

    @functools.wraps(original_close)
    def close(self: Any) -> None:
        mirror = self.__dict__.pop("_accelnb_mirror", None)
        if mirror is not None:
            mirror.final(_tqdm_reading(self))
        original_close(self)

    tqdm_class.__init__ = __init__
    tqdm_class.close = close


# ── rich ──────────────────────────────────────────────────────────────────────────────────────
def _rich_reading(progress: Any, task_id: Any) -> Reading | None:
    task = next((task for task in progress.tasks if task.id == task_id), None)
    if task is None:  # removed
        return None
    return int(task.completed), _whole(task.total), _plain(task.description), bool(task.finished)


def _wrap_rich(module: Any) -> None:
    progress_class = module.Progress
    original_add_task = progress_class.add_task

    @functools.wraps(original_add_task)
    def add_task(self: Any, *args: Any, **kwargs: Any) -> Any:
        task_id = original_add_task(self, *args, **kwargs)
        reading = _rich_reading(self, task_id)
        visible = next((task.visible for task in self.tasks if task.id == task_id), False)
        if reading is not None and visible and report.drives_progress():
            progress = weakref.ref(self)
            _Mirror(reading, lambda: _if_alive(progress, lambda p: _rich_reading(p, task_id)))
        return task_id

    progress_class.add_task = add_task


# ── reading ───────────────────────────────────────────────────────────────────────────────────
def _if_alive(ref: weakref.ref[Any], read: Any) -> Reading | None:
    target = ref()
    return None if target is None else read(target)


def _whole(total: Any) -> int | None:
    try:
        return int(total) if total else None
    except (TypeError, ValueError, OverflowError):  # float("inf") totals exist
        return None


def _plain(description: Any) -> str | None:
    """A rich description without its markup (``[bold]Epoch 1[/]`` → ``Epoch 1``)."""
    if not description:
        return None
    from rich.text import Text

    return Text.from_markup(str(description)).plain.strip() or None
