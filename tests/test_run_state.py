"""The kernel-side state that displays follow: wait hooks at a bounded rate, and one observer
policy (a display that raises is logged and skipped; the launch or the selection goes on).

Clocks are injected: no test sleeps.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator

import pytest

from accelnb.kernel.run import run_state
from accelnb.kernel.run.run_state import WAIT_HOOK_RATE_HZ, RankState, RunState, WaitHooks
from accelnb.kernel.watched_state import selection


class SteppingClock:
    """A monotonic clock that the test moves (binary fractions, so sums stay exact)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def no_selection() -> Iterator[None]:
    selection.clear_selection()
    yield
    selection.clear_selection()


# ── wait hooks ──────────────────────────────────────────────────────────────────────────────
def test_a_tight_wait_loop_runs_hooks_at_the_documented_rate() -> None:
    clock = SteppingClock()
    hooks = WaitHooks(rate=16, clock=clock)
    calls: list[float] = []
    hooks.add(lambda: calls.append(clock.now))

    for _ in range(16 * 1024):  # a selector waking every ~1 ms for 16 s
        hooks.run()
        clock.now += 2**-10

    assert len(calls) == 16 * 16
    gaps = {b - a for a, b in itertools.pairwise(calls)}
    assert gaps == {1 / 16}


def test_a_loop_that_wakes_a_little_early_still_gets_the_full_rate() -> None:
    clock = SteppingClock()
    hooks = WaitHooks(rate=16, clock=clock)
    calls: list[float] = []
    hooks.add(lambda: calls.append(clock.now))

    for _ in range(160):  # wake-ups every 1/16 s minus a little, as select() may return
        hooks.run()
        clock.now += 1 / 16 - 2**-12
    assert len(calls) >= 150  # not every other wake-up (which would halve the rate)


def test_a_round_that_ran_late_is_never_followed_at_once() -> None:
    """On schedule, a round late by nearly an interval used to leave the next one due a moment
    later: two rounds within a millisecond."""
    clock = SteppingClock()
    hooks = WaitHooks(rate=16, clock=clock)
    calls: list[float] = []
    hooks.add(lambda: calls.append(clock.now))

    assert hooks.run()
    clock.now += 1 / 16 + 1 / 16 * 0.95  # the next round, late by 95 % of an interval
    assert hooks.run()
    for _ in range(800):  # a flood of wake-ups from then on (0.2 s)
        clock.now += 2**-12
        hooks.run()
    assert len(calls) > 3
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert min(gaps) >= 1 / 16 * WaitHooks.SPACING - 2**-12


def test_after_a_pause_hooks_run_at_once_and_never_in_a_burst() -> None:
    clock = SteppingClock()
    hooks = WaitHooks(rate=16, clock=clock)
    calls: list[float] = []
    hooks.add(lambda: calls.append(clock.now))

    assert hooks.run()
    clock.now += 10.0  # a long round, or no wake-ups for a while
    assert hooks.run()
    for _ in range(100):  # then a burst of wake-ups within one interval
        clock.now += 2**-12
        hooks.run()
    assert len(calls) == 2


def test_the_module_wait_hooks_are_rate_limited_under_a_flood_of_wake_ups() -> None:
    """What the supervisor calls on every select() wake-up: a tight loop is the worst flood."""
    calls = 0

    def count() -> None:
        nonlocal calls
        calls += 1

    remove = run_state.add_wait_hook(count)
    try:
        start = time.monotonic()
        wake_ups = 0
        while time.monotonic() - start < 0.3:
            run_state.run_wait_hooks()
            wake_ups += 1
        elapsed = time.monotonic() - start
    finally:
        remove()
    assert wake_ups > 1000, "the loop is meant to outrun the rate"
    assert 1 <= calls <= elapsed * WAIT_HOOK_RATE_HZ + 1


def test_a_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rate must be a positive number"):
        WaitHooks(rate=0)


# ── one observer policy ─────────────────────────────────────────────────────────────────────
def broken_display(_value: object = None) -> None:
    raise RuntimeError("the display broke")


def test_a_raising_selection_listener_breaks_neither_the_selection_nor_other_listeners(
        caplog: pytest.LogCaptureFixture) -> None:
    seen: list[selection.Selection | None] = []
    remove_broken = selection.on_selection_change(broken_display)
    remove_good = selection.on_selection_change(seen.append)
    try:
        with caplog.at_level(logging.DEBUG, logger="accelnb"):
            chosen = selection.set_selection(gpus=[1, 0])
            selection.set_selection(num_processes=2)
    finally:
        remove_broken()
        remove_good()

    assert chosen == selection.Selection(gpus=(1, 0))
    assert selection.current_selection() == selection.Selection(num_processes=2)
    assert seen == [chosen, selection.Selection(num_processes=2)]
    assert _logged_failures(caplog) == [(logging.WARNING, "the display broke"), (logging.DEBUG, "the display broke")]


def test_a_raising_run_listener_or_wait_hook_is_logged_and_the_others_still_run(
        caplog: pytest.LogCaptureFixture) -> None:
    runs: list[RunState | None] = []
    hook_calls = 0

    def good_hook() -> None:
        nonlocal hook_calls
        hook_calls += 1

    hooks = WaitHooks(clock=SteppingClock())
    hooks.add(broken_display)
    hooks.add(good_hook)
    removers = [run_state.on_run_change(broken_display), run_state.on_run_change(runs.append)]
    run = RunState(run_id=run_state.next_run_id(), ranks=[RankState(0, "cpu")])
    try:
        with caplog.at_level(logging.WARNING, logger="accelnb"):
            run_state.begin_run(run)
            hooks.run()
    finally:
        for remove in removers:
            remove()

    assert runs == [run] and hook_calls == 1
    assert _logged_failures(caplog) == [(logging.WARNING, "the display broke")] * 2
    assert "run-state listener" in caplog.records[0].getMessage()
    assert "wait hook" in caplog.records[1].getMessage()


def test_unsubscribing_leaves_no_listener_behind() -> None:
    before = (selection.listener_count(), run_state.run_listener_count(), run_state.wait_hook_count())
    removers = [selection.on_selection_change(print), run_state.on_run_change(print),
                run_state.add_wait_hook(lambda: None)]
    assert (selection.listener_count(), run_state.run_listener_count(),
            run_state.wait_hook_count()) == tuple(n + 1 for n in before)
    for remove in removers:
        remove()
        remove()  # twice is harmless
    assert (selection.listener_count(), run_state.run_listener_count(), run_state.wait_hook_count()) == before


@pytest.mark.parametrize(("keywords", "says"), [
    ({"gpus": [0], "num_processes": 2}, "not both"),
    ({"num_processes": 0}, "at least 1"),
    ({"num_processes": True}, "whole number"),
    ({"gpus": [True]}, "GPU indices"),
    ({"gpus": "0,1"}, "GPU indices"),
])
def test_a_bad_selection_is_refused_and_changes_nothing(keywords: dict[str, object], says: str) -> None:
    selection.set_selection(gpus=[3])
    with pytest.raises(ValueError, match=says):
        selection.set_selection(**keywords)  # type: ignore[arg-type]
    assert selection.current_selection() == selection.Selection(gpus=(3,))


def _logged_failures(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, str(r.exc_info[1])) for r in caplog.records if r.exc_info]
