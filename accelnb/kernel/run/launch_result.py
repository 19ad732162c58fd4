"""What a finished launch hands back: every rank's value, the metric history, the output, and
the record of each attempt (a launch with ``max_restarts=`` may take several)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from accelnb.errors import RankFailure
from accelnb.kernel.display.metrics_history import MetricHistory
from accelnb.kernel.display.rank_activity import RankSummary
from accelnb.kernel.planning.rank_plan import LaunchPlan

# stopped: a Stop press the code answered (stop_requested()): every rank returned, where it chose.
AttemptEnding = Literal["succeeded", "stopped", "failed", "timed_out", "interrupted"]


@dataclass(frozen=True)
class Attempt:
    """One start of every rank, run, and stop: the unit a launch with restarts repeats.

    ``index`` is what ``accelnb.restart_count()`` returned in it (0 for the first). Times are
    wall-clock (``time.time()``). ``failures`` is the failed ranks, root cause first; it is
    empty for a succeeded or interrupted attempt.
    """

    index: int
    started: float
    ended: float
    ending: AttemptEnding
    failures: Sequence[RankFailure] = ()

    @classmethod
    def ended_by(cls, index: int, started: float, error: BaseException | None, *, stopped: bool = False) -> Attempt:
        """The record of an attempt that began at ``started`` and ended now, by ``error`` (None:
        every rank answered; ``stopped``: on a Stop the code answered)."""
        failures: Sequence[RankFailure] = tuple(getattr(error, "failures", ()))
        ending: AttemptEnding = ("stopped" if error is None and stopped else
                                 "succeeded" if error is None else "interrupted" if isinstance(error, KeyboardInterrupt)
                                 else "timed_out" if isinstance(error, TimeoutError) else "failed")
        return cls(index, started, time.time(), ending, failures)

    @property
    def ok(self) -> bool:
        return self.ending in ("succeeded", "stopped")

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    @property
    def root_cause(self) -> RankFailure | None:
        return self.failures[0] if self.failures else None


@dataclass
class LaunchResult:
    """The outcome of :func:`accelnb.launch`.

    ``value`` is rank 0's return value (the first chosen rank's, for a session call with
    ``ranks=``); ``values[r]`` is rank r's (collected for every rank by
    ``launch``, for rank 0 only by ``notebook_launcher``). With restarts, the values and outputs
    are the last attempt's, ``metrics`` spans every attempt (each record says which), ``seconds``
    is the whole launch, and ``attempts`` records each attempt in order. A run stopped on a Stop
    that the code answered (``stop_requested()``) has the values the ranks returned and
    ``stopped_by``.
    """

    values: dict[int, Any]
    plan: LaunchPlan
    seconds: float
    metrics: MetricHistory = field(default_factory=lambda: MetricHistory())
    outputs: dict[int, str] = field(default_factory=dict, repr=False)
    attempts: list[Attempt] = field(default_factory=list)
    value_rank: int = 0  # whose value ``value`` is
    # Each rank's progress as the live view showed it: steps, every window's step, data and forward
    # times, GPU samples, peak host memory (``kernel/display/rank_activity.py``).
    ranks: dict[int, RankSummary] = field(default_factory=dict, repr=False)
    # What asked the run to stop, when the code answered a Stop (``stop_requested()``) by returning:
    # "the stop button", "a panel's Stop", "SIGTERM", "timeout= passed". None: it ran to its end.
    stopped_by: str | None = None

    @property
    def stopped(self) -> bool:
        """Whether the ranks returned because a Stop asked them to (``stop_requested()``)."""
        return self.stopped_by is not None

    @property
    def value(self) -> Any:
        return self.values.get(self.value_rank)

    def output(self, rank: int = 0) -> str:
        """Everything rank ``rank`` printed (the last few MB), stdout and stderr interleaved."""
        return self.outputs.get(rank, "")
