"""Restarts: ``max_restarts=N`` starts every rank afresh when one fails, up to N times.

Real launches (2 CPU ranks, gloo). A rank learns its attempt from ``accelnb.restart_count()`` and
``TORCHELASTIC_RESTART_COUNT``; the tests make failure depend on it, so nothing depends on timing.
Interrupts are pressed from a display's wait hook, the moment every rank of the attempt runs.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

import accelnb
from accelnb import LaunchConfigError, RankCrashed, RankFailed, RunInterrupted, Session, launch, notebook_launcher
from accelnb.kernel.run import run_state
from accelnb.wire.events import MetricBatch
from tests.conftest import worker_processes
from tests.restart_targets import always_fails, rank_1_dies_on_the_first_attempt, sleeps_on_the_second_attempt

pytestmark = pytest.mark.usefixtures("no_leftovers")


def test_a_rank_that_dies_on_attempt_0_succeeds_on_attempt_1(capfd: pytest.CaptureFixture[str]) -> None:
    seen: list[tuple[int, int]] = []
    result = launch(rank_1_dies_on_the_first_attempt, num_processes=2, cpu=True, quiet=True, max_restarts=2,
                    metric_sink=lambda batch: seen.append((batch.rank, len(batch.records))))
    assert result.values == {0: (1, "1", 2), 1: (1, "1", 2)}  # the successful attempt's values
    assert [(a.index, a.ending) for a in result.attempts] == [(0, "failed"), (1, "succeeded")]
    failed = result.attempts[0]
    assert failed.root_cause is not None and failed.root_cause.rank == 1
    assert "exited with code 1" in failed.root_cause.summary
    assert failed.started <= failed.ended <= result.attempts[1].started <= result.attempts[1].ended
    assert result.seconds >= result.attempts[1].seconds
    # One line in the cell for the failed attempt, then the next attempt carries on.
    shown = capfd.readouterr().out
    assert shown.count("accelnb: attempt ") == 1
    assert ("accelnb: attempt 1 of 3 ended after " in shown and " s, rank 1 failed: exited with code 1" in shown
            and "Restarting every rank (restart_count() = 1)." in shown)
    # The history spans both attempts and says where each began.
    history = result.metrics
    assert history.series("loss", 0, attempt=0) == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert history.series("loss", 0, attempt=1) == [(0, 10.0), (1, 11.0), (2, 12.0)]
    assert [r["attempt"] for r in history.records if r["rank"] == 0 and "loss" in r] == [0, 0, 0, 1, 1, 1]
    pids = {r["attempt"]: r["last_pid"] for r in history.records if r["rank"] == 0 and "last_pid" in r}
    assert set(pids) == {0, 1} and pids[0] != pids[1]  # a fresh process, not the same one resumed
    assert sum(n for rank, n in seen if rank == 0) == 8  # the caller's sink saw both attempts
    assert accelnb.last_result() is result
    print("attempts took", [round(a.seconds, 2) for a in result.attempts], "s; the launch", round(result.seconds, 2))


def test_every_attempt_failing_raises_the_last_root_cause_with_the_earlier_ones_listed() -> None:
    started = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        launch(always_fails, args=("the same place",), num_processes=2, cpu=True, quiet=True, max_restarts=2)
    took = time.monotonic() - started
    message = str(failed.value)
    assert isinstance(failed.value, ValueError)  # the remote type, as without restarts
    assert message.startswith("Rank 1 failed: ValueError: attempt 2 fails at the same place")
    assert "Earlier attempts of this launch:" in message
    assert "attempt 1, after " in message and "rank 1: ValueError: attempt 0 fails at the same place" in message
    assert "attempt 2, after " in message and "rank 1: ValueError: attempt 1 fails at the same place" in message
    latest = accelnb.last_result()
    assert latest is not None and [a.ending for a in latest.attempts] == ["failed"] * 3
    assert [a.root_cause.summary for a in latest.attempts if a.root_cause] == [
        f"ValueError: attempt {n} fails at the same place" for n in range(3)]
    print(f"3 failing attempts took {took:.2f} s")


def test_without_max_restarts_a_failure_ends_the_launch_with_one_attempt_recorded() -> None:
    with pytest.raises(RankFailed) as failed:
        launch(always_fails, args=("once",), num_processes=2, cpu=True, quiet=True)
    assert "Earlier attempts" not in str(failed.value)
    latest = accelnb.last_result()
    assert latest is not None and [(a.index, a.ending) for a in latest.attempts] == [(0, "failed")]
    assert notebook_launcher(os.getpid, num_processes=1, cpu=True, quiet=True) > 0
    latest = accelnb.last_result()
    assert latest is not None and [(a.index, a.ending) for a in latest.attempts] == [(0, "succeeded")]


def test_an_interrupt_during_attempt_1_makes_no_attempt_2_and_leaves_nothing() -> None:
    runs_begun: list[int] = []  # run ids in the order their groups started: one per attempt
    pressed: list[float] = []

    def note_run(run: run_state.RunState | None) -> None:
        if run is not None and run.run_id not in runs_begun:
            runs_begun.append(run.run_id)

    def ctrl_c_once_attempt_1_runs() -> None:  # a display's wait hook: runs inside the wait for answers
        run = run_state.current_run()
        if (not pressed and run is not None and runs_begun.index(run.run_id) == 1
                and all(r.phase == "running" for r in run.ranks)):
            pressed.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)  # what the kernel's stop button sends

    unsubscribe = run_state.on_run_change(note_run)
    remove_hook = run_state.add_wait_hook(ctrl_c_once_attempt_1_runs)
    try:
        with pytest.raises(RunInterrupted, match="accelnb stopped the run: every worker was ended"):
            launch(sleeps_on_the_second_attempt, num_processes=2, cpu=True, quiet=True, max_restarts=5)
    finally:
        remove_hook()
        unsubscribe()
    assert len(pressed) == 1 and len(runs_begun) == 2  # no attempt 2 was started
    assert time.monotonic() - pressed[0] < 20  # at once: not attempt 2's 60 s sleep, on a loaded machine too
    assert worker_processes() == []  # gone when the interrupt reached the caller
    latest = accelnb.last_result()
    assert latest is not None
    assert [(a.index, a.ending) for a in latest.attempts] == [(0, "failed"), (1, "interrupted")]


def test_timeout_covers_every_attempt() -> None:
    started = time.monotonic()
    with pytest.raises(accelnb.LaunchTimeout) as timed_out:
        launch(sleeps_on_the_second_attempt, num_processes=2, cpu=True, quiet=True, max_restarts=5, timeout=3)
    took = time.monotonic() - started
    message = str(timed_out.value)
    assert "did not finish within timeout=3 s" in message
    assert "attempt 1, after " in message and "RuntimeError: first attempt fails" in message
    assert took < 3 + 20  # the stack dump and the stop ladder on a loaded machine, not attempt 2's 60 s sleep
    latest = accelnb.last_result()
    assert latest is not None and [a.ending for a in latest.attempts] == ["failed", "timed_out"]


def test_restart_delay_waits_between_attempts_and_timeout_stops_restarts_it_cannot_fit() -> None:
    started = time.monotonic()
    result = launch(rank_1_dies_on_the_first_attempt, num_processes=2, cpu=True, quiet=True, max_restarts=1,
                    restart_delay=0.5)
    assert result.attempts[1].started - result.attempts[0].ended >= 0.5
    assert time.monotonic() - started >= 0.5
    with pytest.raises(RankCrashed, match=r"No restart: timeout=30 s, which covers every attempt"):
        launch(rank_1_dies_on_the_first_attempt, num_processes=2, cpu=True, quiet=True, max_restarts=1,
               restart_delay=60, timeout=30)


def test_stop_during_the_restart_delay_makes_no_further_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelnb.kernel.run import attempts

    class StopPressedAtTheWait:  # attempts' clock: the stop button is pressed as the wait begins
        monotonic, time = staticmethod(time.monotonic), staticmethod(time.time)

        @staticmethod
        def sleep(seconds: float) -> None:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(seconds)

    monkeypatch.setattr(attempts, "time", StopPressedAtTheWait)
    started = time.monotonic()
    with pytest.raises(RunInterrupted, match="while it waited to restart it \\(after attempt 1 failed\\); no worker "
                                             "is left, and no further attempt is made"):
        launch(rank_1_dies_on_the_first_attempt, num_processes=2, cpu=True, quiet=True, max_restarts=3,
               restart_delay=60)
    assert time.monotonic() - started < 30  # the 60 s wait was cut short
    assert worker_processes() == []
    latest = accelnb.last_result()
    assert latest is not None and [(a.index, a.ending) for a in latest.attempts] == [(0, "failed")]


@pytest.mark.parametrize(("given", "message"), [
    ({"max_restarts": -1}, "max_restarts must be 0 or more, got -1."),
    ({"max_restarts": 1.5}, "max_restarts must be an integer, got 1.5."),
    ({"restart_delay": -1}, "restart_delay must be a number of seconds, 0 or more, got -1."),
    ({"restart_delay": float("nan")}, "restart_delay must be a number of seconds, 0 or more, got nan."),
])
def test_bad_restart_options_are_refused_before_anything_starts(given: dict[str, Any], message: str) -> None:
    with pytest.raises(LaunchConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        launch(print, num_processes=2, cpu=True, **given)
    assert worker_processes() == []


def test_a_session_refuses_max_restarts_and_says_why() -> None:
    with Session.start(num_processes=2, cpu=True, quiet=True) as session:
        with pytest.raises(LaunchConfigError, match=r"^Session.run\(\) does not take max_restarts=: a restart "
                                                    r"starts a fresh group of workers, and a session's workers "
                                                    r"hold your variables"):
            session.run(os.getpid, max_restarts=2)  # type: ignore[call-arg]
        assert session.alive
        assert session.run(accelnb.restart_count).values == {0: 0, 1: 0}


def test_restart_count_is_0_outside_a_launch() -> None:
    assert accelnb.restart_count() == 0


def test_the_route_keeps_batches_of_each_attempt_apart() -> None:
    from accelnb.kernel.run.engine import MetricRoute

    got: list[tuple[int, int]] = []
    route = MetricRoute(sinks=[lambda batch, attempt: got.append((batch.rank, attempt))])
    route(MetricBatch(0, [(0, 1.0, {"loss": 1.0})]))
    route.attempt = 1
    route(MetricBatch(0, [(0, 2.0, {"loss": 2.0})]))
    assert got == [(0, 0), (0, 1)]
    assert [r["attempt"] for r in route.history.records] == [0, 1]


def test_a_failure_keeps_whether_an_interrupt_hurried_it_through_pickling() -> None:
    import pickle

    failure = accelnb.RankFailure(1, 4321, "exception", "ValueError: rank 1 fails")
    error = RankFailed.like(ValueError, "rank 1 failed", [failure])
    error.interrupted_while_stopping = True
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, RankFailed) and isinstance(copy, ValueError)
    assert copy.interrupted_while_stopping and copy.failures == (failure,)
    assert not pickle.loads(pickle.dumps(RankFailed.like(ValueError, "x"))).interrupted_while_stopping
