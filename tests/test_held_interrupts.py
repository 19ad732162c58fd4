"""A Ctrl-C that lands while a fresh fd has no owner yet is held until it has one.

The same inside a route (``routed_interrupts``, the kernel's whole call), where one handler of
ours stays in place and holds and changes of SIGINT's meaning set no handler; a subprocess shows
that a route leaves SIGINT's default (death by the signal) as it was.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import weakref
from contextlib import nullcontext
from types import FrameType
from typing import Any

import pytest

from accelnb.kernel.run.sigterm import sigterm_as_stop
from accelnb.wire.held_interrupts import held_interrupts, routed_interrupts, sigint_goes_to
from accelnb.wire.signal_handlers import handler_of, set_handler


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


def test_inside_a_route_a_hold_sets_no_handler_and_raises_at_its_end() -> None:
    with routed_interrupts():
        route = signal.getsignal(signal.SIGINT)
        assert route is not signal.default_int_handler  # the route's one handler
        reached = []
        with pytest.raises(KeyboardInterrupt), held_interrupts():
            assert signal.getsignal(signal.SIGINT) is route  # no handler of its own
            signal.raise_signal(signal.SIGINT)
            reached.append("held")
            with held_interrupts():  # nested: still held, delivered once, at the outer end
                signal.raise_signal(signal.SIGINT)
            reached.append("after the inner block")
        assert reached == ["held", "after the inner block"]
        with pytest.raises(KeyboardInterrupt):  # outside a hold, it raises at once
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_inside_a_route_a_second_interrupt_goes_through_once() -> None:
    reached: list[str] = []
    with routed_interrupts():
        with pytest.raises(KeyboardInterrupt), held_interrupts(second_one_goes_through=True):
            signal.raise_signal(signal.SIGINT)
            reached.append("after the first")
            signal.raise_signal(signal.SIGINT)
            reached.append("after the second")
        with held_interrupts():  # the first was delivered with the second: none is left over
            reached.append("next hold")
    assert reached == ["after the first", "next hold"]


def test_sigint_goes_to_changes_its_meaning_with_or_without_a_route() -> None:
    heard: list[str] = []

    def counting(previous: Any) -> Any:
        def on_interrupt(signum: int, frame: FrameType | None) -> None:
            heard.append("press" if previous is signal.default_int_handler else "other")
        return on_interrupt

    with sigint_goes_to(counting):  # no route: a handler of its own
        signal.raise_signal(signal.SIGINT)
    with routed_interrupts():
        route = signal.getsignal(signal.SIGINT)
        with sigint_goes_to(counting):
            assert signal.getsignal(signal.SIGINT) is route  # only the route's target changed
            signal.raise_signal(signal.SIGINT)
            with held_interrupts():  # held, then given to the handler of the moment
                signal.raise_signal(signal.SIGINT)
                assert heard == ["press", "press"]
        assert heard == ["press", "press", "press"]
        with pytest.raises(KeyboardInterrupt):  # its meaning before, once the block ended
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_route_leaves_an_ignored_or_default_sigint_as_it_was() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with routed_interrupts(), held_interrupts():
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    code = ("import signal\n"
            "from accelnb.wire.held_interrupts import held_interrupts, routed_interrupts\n"
            "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
            "with routed_interrupts(), held_interrupts():\n"
            "    signal.raise_signal(signal.SIGINT)\n"
            "    print('held', flush=True)\n"
            "print('not reached', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGINT, done.stderr
    assert done.stdout == "held\n"


def test_a_calls_handler_changes_skip_the_enum_conversions() -> None:
    # What comes back is unconverted (an int for SIG_DFL, where signal.signal gives a Handlers
    # member): a Python where these fall back to the wrappers fails here (accelnb would still
    # work, 90 µs a session cell slower).
    def handler(signum: int, frame: FrameType | None) -> None:
        pass

    previous = set_handler(signal.SIGUSR1, signal.SIG_IGN)
    try:
        assert type(previous) is int and previous == signal.SIG_DFL  # unconverted: 0, not Handlers.SIG_DFL
        assert type(handler_of(signal.SIGUSR1)) is int and handler_of(signal.SIGUSR1) == signal.SIG_IGN
        assert set_handler(signal.SIGUSR1, handler) == signal.SIG_IGN
        assert handler_of(signal.SIGUSR1) is handler is signal.getsignal(signal.SIGUSR1)
        assert set_handler(signal.SIGUSR1, previous) is handler
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # an int put back is the default again
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_sigterm_as_stop_puts_back_the_handler_it_found() -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with sigterm_as_stop():
            assert signal.getsignal(signal.SIGTERM) is not handler
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    code = ("import os, signal\n"
            "from accelnb.kernel.run.sigterm import sigterm_as_stop\n"
            "with sigterm_as_stop():\n"
            "    pass\n"
            "print('after', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "print('not reached', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM, done.stderr  # the default put back: death by the signal
    assert done.stdout == "after\n"


def test_a_route_in_another_thread_changes_nothing() -> None:
    seen: list[Any] = []

    def body() -> None:
        with routed_interrupts(), held_interrupts():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]


class _Local:
    """A local of the frame a SIGINT lands in, whose end the test watches."""


def _work_that_is_interrupted(freed: list[bool]) -> None:
    local = _Local()
    weakref.finalize(local, freed.append, True)
    signal.raise_signal(signal.SIGINT)  # heard here: the handler is given this frame


@pytest.mark.parametrize("inside_a_route", [False, True])
def test_a_held_interrupt_keeps_nothing_of_the_frame_it_landed_in(inside_a_route: bool) -> None:
    """Its locals go when it returns, while the interrupt is still held. A kept frame had kept
    the kernel's view of a channel's buffer alive, the buffer could not be resized, and a rank's
    answer was lost (tests/test_session_failures.py)."""
    freed: list[bool] = []
    freed_while_held: list[bool] = []
    route = routed_interrupts() if inside_a_route else nullcontext()
    with pytest.raises(KeyboardInterrupt), route, held_interrupts():
        _work_that_is_interrupted(freed)
        freed_while_held.extend(freed)  # an assert here would be replaced by the interrupt
    assert freed_while_held == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

