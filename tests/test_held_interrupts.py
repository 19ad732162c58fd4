"""A Ctrl-C that lands while a fresh fd has no owner yet is held until it has one."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from accelnb.wire.held_interrupts import held_interrupts


def test_an_interrupt_inside_the_block_is_raised_when_the_block_ends() -> None:
    owned: list[int] = []
    with pytest.raises(KeyboardInterrupt), held_interrupts():
        signal.raise_signal(signal.SIGINT)  # the handler runs here, right after this call
        owned.extend(os.pipe())  # still reached: the interrupt waits for the block's end
    assert len(owned) == 2
    for fd in owned:
        os.close(fd)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_without_an_interrupt_nothing_happens() -> None:
    with held_interrupts():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_interrupt_stays_ignored() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with held_interrupts():
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_other_threads_run_the_block_as_it_is() -> None:
    ran: list[bool] = []

    def body() -> None:
        with held_interrupts():  # signal.signal would raise ValueError outside the main thread
            ran.append(True)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert ran == [True]


def test_a_second_interrupt_goes_through_where_the_block_allows_it() -> None:
    """Writing a call to the ranks holds the first Ctrl-C; a second is raised at once, so a user
    can always get out of a write to a rank too frozen to read it."""
    reached: list[str] = []
    with pytest.raises(KeyboardInterrupt), held_interrupts(second_one_goes_through=True):
        signal.raise_signal(signal.SIGINT)
        reached.append("after the first")
        signal.raise_signal(signal.SIGINT)
        reached.append("after the second")
    assert reached == ["after the first"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back, raised once
