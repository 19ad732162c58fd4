"""What a sweep hands back: one :class:`Trial` per configuration, in the order of the configs.

    >>> trials = accelnb.sweep(train, [{"lr": 1e-3}, {"lr": 1e-2}], best="loss")   # doctest: +SKIP
    >>> trials[1].value, trials[1].metrics.series("loss"), trials[1].gpus, trials[1].seconds  # doctest: +SKIP
    >>> trials.best.config                                                         # doctest: +SKIP
    {'lr': 0.001}
    >>> trials.to_pandas()                     # one row per trial             # doctest: +SKIP

A trial is filled by the thread that runs it (its state, what it reports, its output as it comes)
and read by the thread that draws the table; every field is replaced whole, never mutated in
place, so a reader sees either the old or the new value. The output of a running trial is read
from its ranks' output as the launch keeps it (:meth:`Trial.output`).

A trial's ``error`` is the exception its launch raised, as a launch raises it: ``RankFailed``
(also an instance of the rank's own exception type) with ``root_cause``, ``RankCrashed``,
``LaunchTimeout``, ``HelperDied``, or ``RunInterrupted`` for a trial that Stop ended.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from accelnb.errors import LaunchFailed, RankFailure
from accelnb.kernel.display.metrics_history import MetricHistory
from accelnb.kernel.display.output import OutputRouter
from accelnb.kernel.run.launch_result import LaunchResult
from accelnb.wire.events import MetricBatch

TrialState = Literal["queued", "running", "done", "failed", "stopped", "skipped"]
Mode = Literal["min", "max"]
MODES: tuple[Mode, ...] = ("min", "max")
_READ_TRIES = 5  # a deque read while the trial's thread appends to it may have to be retried


@dataclass(eq=False)
class Trial:
    """One configuration's run: ``fn(config)`` launched on the GPUs of one slot.

    ``value`` is what the function returned on rank 0; ``metrics`` every ``report()`` of the
    trial's ranks (a :class:`~accelnb.kernel.display.metrics_history.MetricHistory`); ``latest`` the
    last value of each reported metric (rank 0's where it reported it); ``gpus`` the physical GPUs
    it ran on (``()`` on CPU); ``seconds`` how long its launch took; ``error`` the exception its
    launch raised (None when it succeeded); ``notes`` lines a launch would have printed in the
    cell (a restart after a failed attempt).
    """

    index: int
    config: Any
    state: TrialState = "queued"
    value: Any = None
    error: BaseException | None = None
    metrics: MetricHistory = field(default_factory=MetricHistory, repr=False)
    latest: dict[str, float] = field(default_factory=dict)
    gpus: tuple[int, ...] = ()
    seconds: float | None = None
    ended_at: float | None = None  # time.monotonic() when it ended
    result: LaunchResult | None = field(default=None, repr=False)
    notes: tuple[str, ...] = field(default=(), repr=False)
    _started: float | None = field(default=None, init=False, repr=False)
    _output: OutputRouter | None = field(default=None, init=False, repr=False)
    _latest_rank: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    # ── written by the trial's thread ──────────────────────────────────────────────────────────
    def begin(self, gpus: tuple[int, ...]) -> None:
        self.gpus = gpus
        self._started = time.monotonic()
        self.state = "running"

    def follow(self, output: OutputRouter) -> None:
        """The output of the trial's ranks, kept by the launch (each attempt's group has its own)."""
        self._output = output

    def add_metrics(self, batch: MetricBatch, attempt: int = 0) -> None:
        """A batch of ``report()`` records from one rank (the launch's metric sink)."""
        self.metrics.add(batch, attempt)
        latest = dict(self.latest)
        ranks = dict(self._latest_rank)
        for _step, _when, values in batch.records:
            for name, value in values.items():
                if batch.rank == 0 or ranks.get(name, batch.rank) == batch.rank or name not in latest:
                    latest[name] = value
                    ranks[name] = batch.rank
        self._latest_rank = ranks
        self.latest = latest

    def note(self, line: str) -> None:
        self.notes = (*self.notes, line)

    def succeed(self, result: LaunchResult, value: Any) -> None:
        self.result = result
        self.value = value
        self._end("done")

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._end("stopped" if isinstance(error, KeyboardInterrupt) else "failed")

    def skip(self) -> None:
        """Never started: the sweep was stopped first (Stop, or ``fail_fast=True``)."""
        self.state = "skipped"

    def _end(self, state: TrialState) -> None:
        self.ended_at = time.monotonic()
        if self._started is not None:
            self.seconds = self.ended_at - self._started
        self.state = state

    # ── read by anyone ─────────────────────────────────────────────────────────────────────────
    @property
    def ok(self) -> bool:
        return self.state == "done"

    @property
    def elapsed(self) -> float | None:
        """Seconds it ran so far (its whole time once it ended); None before it started."""
        if self.seconds is not None:
            return self.seconds
        return None if self._started is None else time.monotonic() - self._started

    @property
    def root_cause(self) -> RankFailure | None:
        """The first failure of its ranks, as its launch reported it (None unless it failed)."""
        return self.error.root_cause if isinstance(self.error, LaunchFailed) else None

    @property
    def error_summary(self) -> str:
        """One line: the root cause (rank and exception), or what ended the trial."""
        if self.error is None:
            return ""
        cause = self.root_cause
        if cause is not None:
            return f"rank {cause.rank}: {cause.summary}"
        return f"{type(self.error).__name__}: {str(self.error).splitlines()[0] if str(self.error) else ''}".rstrip(": ")

    def output(self, rank: int = 0) -> str:
        """What rank ``rank`` of this trial printed so far (the last few MB), stdout and stderr
        interleaved; while the trial runs, what it printed until now."""
        if self.result is not None:
            return self.result.output(rank)
        router = self._output
        if router is None:
            return ""
        for _ in range(_READ_TRIES):
            try:
                kept = router.retained.get(rank)
                return "" if kept is None else kept.text()
            except RuntimeError:  # the trial's thread appended while we read: read again
                continue
        return ""

    def score(self, metric: str) -> float | None:
        """The trial's figure for ``best=metric``: the last ``report()``ed value of that metric,
        else the returned value's entry of that name (a dict), else None."""
        if metric in self.latest:
            return _number(self.latest[metric])
        if isinstance(self.value, Mapping) and metric in self.value:
            return _number(self.value[metric])
        return None


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number


class Trials(list[Trial]):
    """The trials of a sweep in the order of its configs; ``best`` is the trial that did best by
    the sweep's ``best=`` metric (None without one), ``to_pandas()`` one row per trial."""

    def __init__(self, trials: Iterable[Trial] = (), *, metric: str | None = None, mode: Mode = "min") -> None:
        super().__init__(trials)
        self.metric = metric
        self.mode: Mode = mode

    @property
    def best(self) -> Trial | None:
        """The successful trial with the best ``metric`` (lowest, or highest with ``mode="max"``)."""
        return self.leader(finished_only=True)

    def leader(self, finished_only: bool = False) -> Trial | None:
        """The best trial so far; running trials count by their last report unless ``finished_only``."""
        if self.metric is None:
            return None
        scored = [(score, trial) for trial in self
                  if (trial.ok or (not finished_only and trial.state == "running"))
                  and (score := trial.score(self.metric)) is not None]
        if not scored:
            return None
        pick = min if self.mode == "min" else max
        return pick(scored, key=lambda pair: pair[0])[1]

    def to_pandas(self) -> Any:
        """One row per trial: ``trial``, the config (a column per key of a dict config, else
        ``config``), ``state``, ``gpus``, ``seconds``, ``value``, the last value of each reported
        metric, and ``error`` (the root cause). Needs pandas."""
        try:
            import pandas
        except ImportError:
            raise ImportError("Trials.to_pandas() needs pandas: pip install pandas (or read the trials "
                              "themselves: trial.config, trial.value, trial.latest, trial.error)") from None
        return pandas.DataFrame([_row(trial) for trial in self])

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for trial in self:
            counts[trial.state] = counts.get(trial.state, 0) + 1
        states = ", ".join(f"{n} {state}" for state, n in counts.items())
        best = self.best
        shown = "" if best is None or self.metric is None else \
            f"; best: trial {best.index} ({self.metric}={best.score(self.metric):g})"
        return f"Trials({len(self)} trial{'s' if len(self) != 1 else ''}: {states}{shown})"


def _row(trial: Trial) -> dict[str, Any]:
    row: dict[str, Any] = {"trial": trial.index}
    if isinstance(trial.config, Mapping) and all(isinstance(key, str) for key in trial.config):
        row.update({key: value for key, value in trial.config.items() if key not in _ROW_COLUMNS})
    else:
        row["config"] = trial.config
    row.update(state=trial.state, gpus=",".join(map(str, trial.gpus)), seconds=trial.seconds, value=trial.value)
    row.update({name: value for name, value in trial.latest.items() if name not in row})
    row["error"] = trial.error_summary or None
    return row


_ROW_COLUMNS = {"trial", "state", "gpus", "seconds", "value", "error"}


def describe_config(config: Any, width: int = 60) -> str:
    """A config in one short line: ``lr=0.001, batch=32`` for a dict, else its repr, cut to ``width``."""
    if isinstance(config, Mapping):
        text = ", ".join(f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"
                         for key, value in config.items())
    else:
        text = repr(config)
    return text if len(text) <= width else text[:width - 1] + "…"
