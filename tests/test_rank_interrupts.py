"""What a SIGINT does in a local rank at each point of a call (``worker/interactive/rank_interrupts.py``), in
this process's main thread, which stands for a rank's."""

from __future__ import annotations

import signal
import weakref
from collections.abc import Iterator

import pytest

from accelnb.worker.interactive.rank_interrupts import RankInterrupts


@pytest.fixture
def interrupts() -> Iterator[RankInterrupts]:
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield RankInterrupts()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_rank_set_up_is_interrupted_as_before(interrupts: RankInterrupts) -> None:
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)


def test_held_around_the_code_raised_once_the_code_runs(interrupts: RankInterrupts) -> None:
    interrupts.hold()
    signal.raise_signal(signal.SIGINT)  # accelnb's own set-up goes on
    with pytest.raises(KeyboardInterrupt):
        interrupts.allow()
    interrupts.drop()
    interrupts.hold()
    interrupts.allow()  # held once, raised once: the next call starts clean


def test_dropped_from_the_answer_to_the_next_call(interrupts: RankInterrupts) -> None:
    interrupts.drop()
    signal.raise_signal(signal.SIGINT)
    interrupts.hold()
    interrupts.allow()  # nothing was kept for the next call


def test_a_handler_the_code_set_is_kept_for_the_next_calls(interrupts: RankInterrupts) -> None:
    heard: list[int] = []
    interrupts.hold()
    interrupts.allow()
    signal.signal(signal.SIGINT, lambda signum, frame: heard.append(signum))  # the code's own
    interrupts.drop()  # the answer: ours is back, theirs kept
    signal.raise_signal(signal.SIGINT)
    assert heard == []  # too late for the call that ended
    interrupts.hold()
    interrupts.allow()
    signal.raise_signal(signal.SIGINT)
    assert heard == [signal.SIGINT]


class _Local:
    """A local of the frame a SIGINT lands in, whose end the test watches."""


def _set_up_that_is_interrupted(freed: list[bool]) -> None:
    local = _Local()
    weakref.finalize(local, freed.append, True)
    signal.raise_signal(signal.SIGINT)  # heard here: the handler is given this frame


def test_a_held_interrupt_keeps_nothing_of_the_frame_it_landed_in(interrupts: RankInterrupts) -> None:
    """The call's set-up frame (its arguments, a view of the inbox's buffer) goes when it returns,
    although the interrupt waits for the code."""
    freed: list[bool] = []
    interrupts.hold()
    _set_up_that_is_interrupted(freed)
    assert freed == [True]
    with pytest.raises(KeyboardInterrupt):
        interrupts.allow()
