"""The call protocol both groups share (``kernel/run/group/call_protocol.py``), on fake ranks.

The stop policy (what each ending stops, and how patiently) is checked here without forking a
process or starting Ray: the fake ranks answer when pumped, as the test scripted them.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from accelnb.errors import RankFailure
from accelnb.kernel.run.group.call_answers import CallAnswers
from accelnb.kernel.run.group.call_protocol import CallProtocol, CallRanks, StopWhy
from accelnb.kernel.run.group.stop_presses import PANEL_STOP, SAME_PRESS_S
from accelnb.kernel.run.run_state import RunState


@dataclass
class FakeRanks:
    """Two ranks whose answers arrive on the next pump; records what the protocol asked."""

    persistent: bool = False
    alive: list[int] = field(default_factory=lambda: [0, 1])
    answers_on_pump: dict[int, bytes] = field(default_factory=dict)  # rank -> value, delivered once pumped
    answer_when_interrupted: bool = False
    stops: list[StopWhy] = field(default_factory=list)
    interrupted: list[int] = field(default_factory=list)
    stop_raises: bool = False
    prompt_seconds: float = 0.0
    progress_until: float = 0.0  # monotonic time until which every pump counts as progress
    progressed_at: float = 0.0
    stalls_shown: list[float] = field(default_factory=list)
    stop_requests: int = 0  # StopRequests "sent" to the ranks
    requests_shown: list[str] = field(default_factory=list)
    on_pump: list[Callable[[CallAnswers], None]] = field(default_factory=list)  # one scripted act per pump

    def port(self) -> CallRanks:
        return CallRanks(
            persistent=self.persistent, interrupt_grace=0.2, size=lambda: 2, live_ranks=lambda: list(self.alive),
            usable=lambda: self.alive == [0, 1], helper_death=lambda: None, pump=self.pump,
            between_pumps=lambda answers: self.prompt_seconds, interrupt=self.interrupted.append, stop=self.stop,
            stacks_at_timeout=lambda: {0: "stack 0", 1: "stack 1"}, progress_at=lambda: self.progressed_at,
            show_stall=self.stalls_shown.append, request_stop=self.request_stop,
            show_request=self.requests_shown.append)

    def request_stop(self, answers: CallAnswers) -> bool:
        self.stop_requests += 1
        return True

    def pump(self, timeout: float, answers: CallAnswers) -> None:
        time.sleep(timeout)  # as a real pump waits on its channels
        if self.on_pump:
            self.on_pump.pop(0)(answers)
        if time.monotonic() < self.progress_until:
            self.progressed_at = time.monotonic()
        for rank, value in self.answers_on_pump.items():
            if answers.call_id is not None:
                answers.values.setdefault(rank, value)

    def stop(self, why: StopWhy, answers: CallAnswers) -> list[int]:
        self.stops.append(why)
        if self.stop_raises:
            self.stop_raises = False
            raise KeyboardInterrupt
        stopped, self.alive = list(self.alive), []
        return stopped


def a_run() -> RunState:
    """A run a panel, a sweep or SIGTERM presses Stop on, from any thread."""
    return RunState(run_id=1, ranks=[])


def failure(rank: int) -> RankFailure:
    return RankFailure(rank, 100 + rank, "exception", "ValueError: bad")


def test_every_rank_answering_ends_the_call_with_nothing_stopped() -> None:
    ranks = FakeRanks(answers_on_pump={0: b"a", 1: b"b"})
    protocol = CallProtocol(ranks.port())
    answers = protocol.begin(None)
    assert protocol.wait(answers, None, a_run().take_stop_press) == "answered"
    outcome = protocol.conclude(answers.outcome("answered", None), answers)
    assert (outcome.values, ranks.stops, outcome.workers_kept) == ({0: b"a", 1: b"b"}, [], True)


def test_a_failure_stops_every_rank_and_names_those_that_had_not_answered() -> None:
    ranks = FakeRanks(answers_on_pump={1: b"b"})
    protocol = CallProtocol(ranks.port())
    answers = protocol.begin(None)
    answers.failures.append(failure(0))
    assert protocol.wait(answers, None, None) == "failed"
    outcome = protocol.conclude(answers.outcome("failed", None), answers)
    assert ranks.stops == ["failed"]
    assert outcome.stopped == [0]  # rank 1 answered before the stop: it is not named as stopped
    assert not outcome.workers_kept


def test_a_session_keeps_its_ranks_when_every_rank_answers_a_failure() -> None:
    ranks = FakeRanks(persistent=True, answers_on_pump={1: b"b"})
    protocol = CallProtocol(ranks.port())
    answers = protocol.begin(None)
    answers.failures.append(failure(0))
    outcome = protocol.conclude(answers.outcome("failed", None), answers)
    assert (ranks.stops, outcome.stopped, outcome.workers_kept) == ([], [], True)


def test_a_timeout_reads_the_stacks_before_it_stops_the_ranks() -> None:
    ranks = FakeRanks()
    protocol = CallProtocol(ranks.port())
    answers = protocol.begin(None)
    assert protocol.wait(answers, 0.0, None) == "timed_out"
    outcome = protocol.conclude(answers.outcome("timed_out", 0.0), answers)
    assert (outcome.stacks, ranks.stops) == ({0: "stack 0", 1: "stack 1"}, ["timed_out"])


def test_a_session_interrupt_interrupts_only_the_ranks_still_running_the_call() -> None:
    ranks = FakeRanks(persistent=True, answers_on_pump={0: b"a"})
    protocol = CallProtocol(ranks.port())
    answers = protocol.begin(frozenset({0, 1}))
    answers.values[0] = b"a"
    outcome = protocol.conclude(answers.outcome("interrupted", None), answers)
    assert ranks.interrupted == [1]
    assert ranks.stops == ["interrupted"]  # rank 1 never answered within the grace
    assert not outcome.workers_kept


def test_an_interrupt_before_the_call_went_out_stops_nothing_in_a_session() -> None:
    ranks = FakeRanks(persistent=True)
    protocol = CallProtocol(ranks.port())
    answers = protocol.begin(None)
    outcome = protocol.conclude(answers.outcome("interrupted", None, phase="unsent"), answers)
    assert (ranks.interrupted, ranks.stops, outcome.workers_kept) == ([], [], True)


def test_an_interrupt_while_stopping_stops_at_once() -> None:
    ranks = FakeRanks(stop_raises=True)
    protocol = CallProtocol(ranks.port())
    answers = protocol.begin(None)
    answers.failures.append(failure(1))
    protocol.conclude(answers.outcome("failed", None), answers)
    assert ranks.stops == ["failed", "at_once"]


def test_a_stop_request_is_taken_once() -> None:
    protocol = CallProtocol(FakeRanks().port())
    run = a_run()
    run.press_stop(PANEL_STOP)
    assert run.stop_pressed
    assert protocol.wait(protocol.begin(None), None, run.take_stop_press) == "stop_requested"
    assert not run.stop_pressed and run.take_stop_press() is None


def test_a_failure_seen_between_calls_is_the_next_calls_root_cause() -> None:
    protocol = CallProtocol(FakeRanks().port())
    protocol.between_calls.failures.append(failure(1))
    answers = protocol.begin(None)
    assert [f.rank for f in answers.failures] == [1] and protocol.between_calls.failures == []
    assert protocol.begin(None).call_id == answers.call_id + 1  # type: ignore[operator]


def test_a_stall_is_shown_once_and_the_wait_goes_on() -> None:
    ranks = FakeRanks()  # never answer, never progress
    protocol = CallProtocol(ranks.port())
    assert protocol.wait(protocol.begin(None), 1.0, None, stall_timeout=0.2) == "timed_out"
    assert len(ranks.stalls_shown) == 1 and 0.2 <= ranks.stalls_shown[0] < 0.5


def test_progress_then_a_stall_shows_it_after_the_progress_stopped() -> None:
    ranks = FakeRanks(progress_until=time.monotonic() + 0.5)
    protocol = CallProtocol(ranks.port())
    started = time.monotonic()
    assert protocol.wait(protocol.begin(None), 1.2, None, stall_timeout=0.3) == "timed_out"
    assert len(ranks.stalls_shown) == 1  # not during the first 0.5 s of progress; once after it
    assert ranks.stalls_shown[0] < time.monotonic() - started - 0.3


def test_without_stall_timeout_nothing_is_shown() -> None:
    ranks = FakeRanks()
    protocol = CallProtocol(ranks.port())
    assert protocol.wait(protocol.begin(None), 0.3, None) == "timed_out"
    assert ranks.stalls_shown == []


# ── a Stop the code answers (stop_requested()) ─────────────────────────────────────────────
def _checks(answers: CallAnswers) -> None:
    answers.checks_stop = True  # as a rank's ChecksForStop event sets it


def _nothing(answers: CallAnswers) -> None:
    pass


def _answer(answers: CallAnswers) -> None:
    answers.values.update({0: b"saved", 1: b"saved"})


def _a_person_waits(answers: CallAnswers) -> None:
    time.sleep(SAME_PRESS_S)  # a second press is a person's, later than one click arriving two ways


def _press_stop_button(answers: CallAnswers) -> None:
    os.kill(os.getpid(), signal.SIGINT)  # the kernel's stop button; the handler runs before the next line


def test_a_panel_stop_while_the_code_checks_is_a_request_the_ranks_answer() -> None:
    run = a_run()
    ranks = FakeRanks(on_pump=[_checks, lambda answers: run.press_stop(PANEL_STOP), _nothing, _answer])
    protocol = CallProtocol(ranks.port())
    answers = protocol.begin(None)
    assert protocol.wait(answers, None, run.take_stop_press, stop_grace=30.0) == "answered"
    outcome = protocol.conclude(answers.outcome("answered", None), answers)
    assert (ranks.stop_requests, ranks.requests_shown, ranks.stops) == (1, ["a panel's Stop"], [])
    assert outcome.stop_asked_by == "a panel's Stop" and outcome.stop_seconds is not None
    assert outcome.values == {0: b"saved", 1: b"saved"}


def test_a_stop_for_code_that_does_not_check_stops_at_once() -> None:
    run = a_run()
    ranks = FakeRanks(on_pump=[lambda answers: run.press_stop(PANEL_STOP)])
    protocol = CallProtocol(ranks.port())
    answers = protocol.begin(None)
    assert protocol.wait(answers, None, run.take_stop_press, stop_grace=30.0) == "stop_requested"
    assert ranks.stop_requests == 0 and answers.outcome("interrupted", None).stop_asked_by is None


def test_a_second_press_stops_now() -> None:
    run = a_run()
    def press(answers: CallAnswers) -> None:
        run.press_stop(PANEL_STOP)

    ranks = FakeRanks(on_pump=[_checks, press, _a_person_waits, press])
    protocol = CallProtocol(ranks.port())
    assert protocol.wait(protocol.begin(None), None, run.take_stop_press, stop_grace=30.0) == "stop_requested"
    assert ranks.stop_requests == 1


def test_ranks_that_do_not_answer_within_the_grace_are_stopped() -> None:
    run = a_run()
    ranks = FakeRanks(on_pump=[_checks, lambda answers: run.press_stop(PANEL_STOP)])
    protocol = CallProtocol(ranks.port())
    started = time.monotonic()
    assert protocol.wait(protocol.begin(None), None, run.take_stop_press, stop_grace=0.3) == "stop_requested"
    assert 0.3 <= time.monotonic() - started < 20  # the grace, not forever (these ranks never answer)
    assert ranks.stop_requests == 1


def test_the_stop_button_is_a_request_first_and_a_keyboard_interrupt_second() -> None:
    ranks = FakeRanks(on_pump=[_checks, _press_stop_button, _a_person_waits, _press_stop_button])
    protocol = CallProtocol(ranks.port())
    answers = protocol.begin(None)
    before = signal.getsignal(signal.SIGINT)
    try:
        protocol.wait(answers, None, a_run().take_stop_press, stop_grace=30.0)
        raise AssertionError("the second press did not interrupt")
    except KeyboardInterrupt:
        pass
    assert (ranks.stop_requests, ranks.requests_shown) == (1, ["the stop button"])
    assert signal.getsignal(signal.SIGINT) is before  # the kernel's handler is back


def test_one_click_arriving_as_a_comm_message_and_an_interrupt_is_one_press() -> None:
    run = a_run()

    def both_ways(answers: CallAnswers) -> None:  # the JupyterLab panel's Stop
        run.press_stop(PANEL_STOP)
        os.kill(os.getpid(), signal.SIGINT)

    ranks = FakeRanks(on_pump=[_checks, both_ways, _nothing, _nothing, _answer])
    protocol = CallProtocol(ranks.port())
    answers = protocol.begin(None)
    assert protocol.wait(answers, None, run.take_stop_press, stop_grace=30.0) == "answered"
    assert ranks.stop_requests == 1


def test_the_stop_button_for_code_that_does_not_check_interrupts_at_once() -> None:
    ranks = FakeRanks(on_pump=[_press_stop_button])
    protocol = CallProtocol(ranks.port())
    try:
        protocol.wait(protocol.begin(None), None, a_run().take_stop_press, stop_grace=30.0)
        raise AssertionError("the press did not interrupt")
    except KeyboardInterrupt:
        pass
    assert ranks.stop_requests == 0


def test_timeout_while_the_code_checks_is_a_request_and_a_timeout_after_the_grace() -> None:
    ranks = FakeRanks(on_pump=[_checks])
    protocol = CallProtocol(ranks.port())
    answers = protocol.begin(None)
    assert protocol.wait(answers, 0.1, None, stop_grace=0.2) == "timed_out"
    assert ranks.requests_shown == ["timeout= passed"]
    ranks = FakeRanks(on_pump=[_checks, *[_nothing] * 3, _answer])
    protocol = CallProtocol(ranks.port())
    answers = protocol.begin(None)
    assert protocol.wait(answers, 0.1, None, stop_grace=30.0) == "answered"
    assert answers.outcome("answered", 0.1).stop_asked_by == "timeout= passed"
