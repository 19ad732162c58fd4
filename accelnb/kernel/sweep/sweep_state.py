"""Which trial each GPU runs, for displays that show the machine (JupyterLab's side panel).

A sweep runs several launches at once, and the run state (:mod:`accelnb.kernel.run.run_state`)
keeps one run, the latest to start. This keeps the sweep's view of the machine: one row per
trial with its slot's GPUs and state, published when a trial starts or ends. Only the latest
sweep is kept; it stays (``finished``) until the next one begins.

    >>> unsubscribe = on_sweep_change(lambda sweep: print(sweep.running_on() if sweep else None))

Module-level state, as for the run state: one latest sweep per kernel (``_current``, numbered by
``_ids``) and the displays that watch it (``_listeners``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from accelnb.kernel.sweep.trials import Trial, TrialState
from accelnb.kernel.watched_state.observers import Listeners


@dataclass(frozen=True)
class TrialRow:
    index: int
    label: str  # the config, short
    gpus: tuple[int, ...]
    state: TrialState


@dataclass(frozen=True)
class SweepState:
    sweep_id: int
    trials: tuple[TrialRow, ...]
    finished: bool = False

    def running_on(self) -> dict[int, TrialRow]:
        """GPU → the trial running on it now."""
        return {gpu: row for row in self.trials if row.state == "running" for gpu in row.gpus}


_ids = itertools.count(1)
_current: SweepState | None = None
_listeners = Listeners[[SweepState | None]]("sweep-state listener")


def current_sweep() -> SweepState | None:
    return _current


def on_sweep_change(listener: Callable[[SweepState | None], object]) -> Callable[[], None]:
    """Call ``listener`` after every change of the sweep's trials; returns its unsubscribe."""
    return _listeners.add(listener)


class SweepPublisher:
    """Publishes one sweep's trials: :meth:`publish` after a trial starts or ends, :meth:`finish` at the end."""

    def __init__(self, trials: Sequence[Trial], label: Callable[[Trial], str]) -> None:
        self._trials = trials
        self._label = label
        self._id = next(_ids)

    def publish(self, finished: bool = False) -> None:
        global _current
        rows = tuple(TrialRow(t.index, self._label(t), t.gpus, t.state) for t in self._trials)
        _current = SweepState(self._id, rows, finished)
        _listeners.notify(_current)

    def finish(self) -> None:
        self.publish(finished=True)
