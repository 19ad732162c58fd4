"""Waiting for a call's answers and ending the call, whatever runs the ranks.

Each group sends a call its own way (a frame into every local worker's inbox, a ``run`` remote
call per Ray actor) and hands the rest to its :class:`CallProtocol`: number the call
(:meth:`~CallProtocol.begin`), wait until it is decided (:meth:`~CallProtocol.wait`), and end it
(:meth:`~CallProtocol.conclude`), which is where the stop policy lives:

- a rank failed: a session's other ranks get :data:`ANSWER_WAIT_S` to answer (every rank raising
  the same exception keeps the session); otherwise every rank is stopped, and those that had not
  failed are named as stopped;
- ``timeout=`` expired: every rank's stack is read, then every rank is stopped;
- interrupted: a session first interrupts just the call on the ranks still running it (when the
  call reached them whole) and keeps them if all answer in time; otherwise every rank is stopped;
- interrupted again while stopping: no more patience, stop at once;
- a Stop pressed while the call's code checks ``stop_requested()``: the ranks are asked to stop
  at their next check, and the call ends as answered, if they do within ``stop_grace``
  (``kernel/run/group/stop_presses.py``).

What a stop is for each backend (SIGTERM, a grace, SIGKILL; ``ray.kill``) stays in the group: the
protocol sees the ranks only through :class:`CallRanks`, a port each group fills with its own
functions. It raises nothing for what the ranks did: the :class:`~accelnb.kernel.run.call_outcome.CallOutcome`
says it, and :mod:`accelnb.kernel.run.engine` decides what the user sees.

    >>> protocol = CallProtocol(ranks)                                   # doctest: +SKIP
    >>> answers = protocol.begin(None)                                   # doctest: +SKIP
    >>> waited = protocol.wait(answers, timeout, run.take_stop_press)   # doctest: +SKIP
    >>> outcome = protocol.conclude(answers.outcome(waited, timeout), answers)  # doctest: +SKIP

(A port of functions, not a base class: each group keeps its ranks private, and the protocol can
be read, and tested, without either backend.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from accelnb.kernel.display.straggler_watch import StragglerWatch
from accelnb.kernel.run.call_outcome import CallOutcome, HelperExit
from accelnb.kernel.run.group.call_answers import CallAnswers
from accelnb.kernel.run.group.stop_presses import StopPresses

ANSWER_WAIT_S = 1.0  # sessions: how long the other ranks get to answer after a failure
WAIT_SLICE_S = 0.05  # the wait loop wakes this often (a Stop request, a deadline, display hooks)
ALL_ANSWER_SLICE_S = 0.02

# How a call's ending wants its ranks stopped; each group says what that is for its ranks.
StopWhy = Literal["failed", "timed_out", "interrupted", "at_once"]
WaitEnding = Literal["answered", "failed", "timed_out", "stop_requested", "helper_died"]


@dataclass(frozen=True)
class CallRanks:
    """A group's ranks as the call protocol drives them: the group's own functions, by job."""

    persistent: bool  # a session: ranks may be kept after a failure or an interrupt
    interrupt_grace: float  # how long ranks get to stop an interrupted call and answer
    size: Callable[[], int]  # how many ranks the group has
    live_ranks: Callable[[], list[int]]  # the ranks still running
    usable: Callable[[], bool]  # whether the ranks can take another call
    helper_death: Callable[[], HelperExit | None]  # the process that ran the ranks died (local only)
    pump: Callable[[float, CallAnswers], None]  # read what the ranks sent, for up to that many s
    between_pumps: Callable[[CallAnswers], float]  # idle work (a prompt, display hooks); seconds at a prompt
    interrupt: Callable[[int], None]  # interrupt the running call on one rank
    stop: Callable[[StopWhy, CallAnswers], list[int]]  # stop every live rank; the ranks it stopped
    stacks_at_timeout: Callable[[], dict[int, str]]  # every rank's Python stack, before stopping it
    progress_at: Callable[[], float]  # when a rank last made progress (monotonic): a step, a report, a line
    show_stall: Callable[[float], None]  # show every rank's stack in the cell, nothing stopped: s without progress
    request_stop: Callable[[CallAnswers], bool]  # ask the call's ranks to stop at their next check; False: cannot
    show_request: Callable[[str], None]  # tell the cell that a stop was requested, and by what


class CallProtocol:
    """Numbers one group's calls, waits for their answers and ends them."""

    def __init__(self, ranks: CallRanks) -> None:
        self._ranks = ranks
        self._call_ids = 0
        # What was seen between calls (a live stack request pumps then): a rank that died
        # meanwhile is the next call's root cause.
        self.between_calls = CallAnswers(None)

    def begin(self, ranks: frozenset[int] | None) -> CallAnswers:
        """The answers of a new call on ``ranks`` (None: every rank)."""
        self._call_ids += 1
        answers = CallAnswers(self._call_ids, ranks,
                              stragglers=StragglerWatch(len(ranks) if ranks is not None else self._ranks.size()))
        answers.failures.extend(self.between_calls.failures)
        self.between_calls.failures.clear()
        return answers

    def wait(self, answers: CallAnswers, timeout: float | None,
             pressed_elsewhere: Callable[[], str | None] | None = None,
             stall_timeout: float | None = None, stop_grace: float | None = None) -> WaitEnding:
        """Pump until the call is decided: every rank answered, one failed, the deadline passed,
        a Stop was pressed, or the helper died. A ``KeyboardInterrupt`` propagates.

        What a Stop press means (the stop button, ``pressed_elsewhere()``'s press from another
        thread, ``timeout=`` passing) is decided by the call's
        :class:`~accelnb.kernel.run.group.stop_presses.StopPresses`, kept in ``answers.presses``;
        this loop asks it on every wake-up and asks the ranks when it says so.

        ``stall_timeout``: once no rank made progress for that long, every rank's stack is shown
        (once per stall: progress again, and a later stall is shown too); the wait goes on.
        """
        presses = answers.presses = StopPresses(stop_grace, timeout, pressed_elsewhere or (lambda: None))
        with presses.catching_interrupts(can_request=lambda: answers.checks_stop):
            return self._wait(answers, stall_timeout)

    def _wait(self, answers: CallAnswers, stall_timeout: float | None) -> WaitEnding:
        started = time.monotonic()
        stall_shown = False
        while True:
            self._ranks.pump(WAIT_SLICE_S, answers)
            if self._ranks.helper_death() is not None:
                return "helper_died"
            if answers.failures:
                return "failed"
            if len(answers.values) == answers.expected(self._ranks.size()):
                return "answered"
            stop_ending = answers.presses.decide(answers.checks_stop,
                                                 request=lambda by: self._request_stop(answers, by))
            if stop_ending is not None:
                return stop_ending
            if stall_timeout is not None:
                quiet_for = time.monotonic() - max(started, self._ranks.progress_at())
                if quiet_for < stall_timeout:
                    stall_shown = False
                elif not stall_shown:
                    stall_shown = True
                    self._ranks.show_stall(quiet_for)
            at_prompt = self._ranks.between_pumps(answers)
            if at_prompt:
                started = time.monotonic()  # time at a prompt is the user's: no stall
                answers.presses.not_counting(at_prompt)  # nor the run's, for timeout=

    def _request_stop(self, answers: CallAnswers, by: str) -> bool:
        """Ask the call's ranks to stop at their next check, and tell the cell; False: they cannot be asked."""
        if not self._ranks.request_stop(answers):
            return False
        self._ranks.show_request(by)
        return True

    def conclude(self, outcome: CallOutcome, answers: CallAnswers) -> CallOutcome:
        """Stop what has to stop for ``outcome``; never ends with a rank that should be gone."""
        ranks = self._ranks
        try:
            if outcome.ending == "failed":
                if not (ranks.persistent and self._all_answer(answers, ANSWER_WAIT_S)):
                    outcome.stopped = [r for r in ranks.stop("failed", answers) if r not in answers.values]
            elif outcome.ending == "timed_out":
                outcome.stacks = ranks.stacks_at_timeout()
                ranks.stop("timed_out", answers)
            elif outcome.ending == "interrupted":
                keep = ranks.persistent and (outcome.phase == "unsent" or (
                    outcome.phase == "running" and self._interrupt_call(answers)))
                if not keep:
                    ranks.stop("interrupted", answers)
        except KeyboardInterrupt:  # interrupted while stopping: no more patience
            outcome.interrupted_while_stopping = True
            ranks.stop("at_once", answers)
        death = ranks.helper_death()
        if death is not None:
            outcome.ending = "helper_died"
            outcome.helper_exit = death
        outcome.workers_kept = ranks.usable()
        return outcome

    def _all_answer(self, answers: CallAnswers, wait: float) -> bool:
        """Wait up to ``wait`` s for every rank to answer the current call."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and self._ranks.helper_death() is None:
            if len(answers.answered()) == answers.expected(self._ranks.size()):
                return len(self._ranks.live_ranks()) == self._ranks.size()
            self._ranks.pump(ALL_ANSWER_SLICE_S, answers)
        return False

    def _interrupt_call(self, answers: CallAnswers) -> bool:
        """Interrupt the ranks still working; True when all stopped their code and live on."""
        for rank in self._ranks.live_ranks():
            if rank not in answers.values and answers.runs_on(rank):
                self._ranks.interrupt(rank)  # an idle rank would take it as a fatal interrupt
        try:
            return self._all_answer(answers, self._ranks.interrupt_grace)
        except KeyboardInterrupt:
            return False
