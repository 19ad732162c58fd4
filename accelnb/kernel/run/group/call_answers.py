"""What came back for one call, and the rank events that both backends turn into it.

A group opens a :class:`CallAnswers` per call (``call_id`` None: while stopping ranks, or between
calls) and feeds it the events its ranks send, whatever carried them (a local worker's events
socket, a Ray actor's events poll). :func:`record_event` handles the events every backend has:

- ``Joined``: the rank is in the process group (phase ``running``);
- ``CallResult`` of this call: its value (phase ``done``, or ``running`` for a session's rank);
- ``CallError`` of this call (or of the set-up, ``call_id`` None): a failure record;
- ``MetricBatch``: to the group's metric sink;
- ``ChecksForStop``: the call's code checks ``stop_requested()`` (a Stop press becomes a request);
- ``StepWindow``: to the call's straggler watch, which names a rank holding the others back, in
  the cell, once (``kernel/display/straggler_watch.py``), and to the metric sink, whose live
  view shows every rank's progress.

    >>> answers = CallAnswers(call_id=3, ranks=None)                                      # doctest: +SKIP
    >>> record_event(answers, rank, pid, event, phases, output, sink, persistent=False)   # doctest: +SKIP
    >>> outcome = answers.outcome("answered", timeout=None)                                # doctest: +SKIP

The group decides what a rank's end means (a local exit, a lost actor), and which failures seen
while it stopped ranks are real (:meth:`CallAnswers.keep_failures`); the answers only record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from accelnb.errors import RankFailure
from accelnb.kernel.display.output import OutputRouter, notebook_sink
from accelnb.kernel.display.straggler_watch import StragglerWatch
from accelnb.kernel.run.call_outcome import CallOutcome, CallPhase, Ending, StopSource
from accelnb.kernel.run.failure_report import exception_failure
from accelnb.kernel.run.group.rank_phases import RankPhases
from accelnb.kernel.run.group.stop_presses import StopPresses
from accelnb.wire.buffers import Packed
from accelnb.wire.events import CallError, CallResult, ChecksForStop, Joined, MetricBatch, StepWindow

MetricSink = Callable[[MetricBatch | StepWindow], None]


@dataclass
class CallAnswers:
    """What came back for one call (``call_id`` None: while stopping, between calls) from the
    ranks it runs on (``ranks``; None: every rank)."""

    call_id: int | None
    ranks: frozenset[int] | None = None
    values: dict[int, Packed | None] = field(default_factory=dict)
    failures: list[RankFailure] = field(default_factory=list)
    stragglers: StragglerWatch = field(default_factory=lambda: StragglerWatch(world_size=2))
    checks_stop: bool = False  # the call's code checks stop_requested(): a Stop press is a request
    presses: StopPresses = field(default_factory=lambda: StopPresses(grace=None))

    def has_failed(self, rank: int) -> bool:
        return any(f.rank == rank for f in self.failures)

    def answered(self) -> set[int]:
        return set(self.values) | {f.rank for f in self.failures}

    def runs_on(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    def expected(self, group_size: int) -> int:
        """How many ranks the call runs on: how many answers end it."""
        return group_size if self.ranks is None else len(self.ranks)

    def keep_failures(self, seen_while_stopping: CallAnswers,
                      real: Callable[[RankFailure], bool] | None = None) -> None:
        """Add the failures seen while ranks were being stopped (those ``real`` accepts, where it is
        given), one per rank (a rank that failed already keeps its first failure: the root cause)."""
        self.failures.extend(f for f in seen_while_stopping.failures
                             if not self.has_failed(f.rank) and (real is None or real(f)))

    def outcome(self, ending: Ending, timeout: float | None, phase: CallPhase = "running",
                stop_source: StopSource = "interrupt") -> CallOutcome:
        """The call's outcome so far; ending it (:mod:`~accelnb.kernel.run.group.call_protocol`)
        fills in what was stopped."""
        return CallOutcome(ending, self.values, self.failures, timeout=timeout, phase=phase,
                           stop_source=stop_source, ranks=None if self.ranks is None else sorted(self.ranks),
                           stop_asked_by=self.presses.asked_by,
                           stop_seconds=self.presses.seconds_since_request())


def record_event(answers: CallAnswers, rank: int, pid: int, event: Any, phases: RankPhases, output: OutputRouter,
                 metric_sink: MetricSink | None, *, persistent: bool) -> bool:
    """Note an event every backend's ranks send; False for any other (the caller's own to handle)."""
    if isinstance(event, Joined):
        phases.set(rank, "running")
    elif isinstance(event, CallResult) and event.call_id == answers.call_id:
        output.mark_progress()
        answers.values[rank] = event.value
        phases.set(rank, "running" if persistent else "done")
    elif isinstance(event, CallError) and (answers.call_id is None or event.call_id in (None, answers.call_id)):
        answers.failures.append(exception_failure(rank, pid, event, output.tail(rank)))
        phases.set(rank, "failed", event.type_name)
    elif isinstance(event, ChecksForStop):
        answers.checks_stop = answers.checks_stop or event.call_id == answers.call_id
    elif isinstance(event, StepWindow):
        output.mark_progress()
        answers.stragglers.add(event)
        straggler = answers.stragglers.verdict()
        if straggler is not None:
            output.tick(force=True)  # what the ranks printed before comes first
            notebook_sink("stderr", straggler.describe() + "\n")
        if metric_sink is not None:  # the live per-rank view
            metric_sink(event)
    elif isinstance(event, MetricBatch):  # a report() or a step (ProgressBatch)
        output.mark_progress()
        if metric_sink is not None:
            metric_sink(event)
    else:
        return False
    return True
