"""The Stop presses of one call: the first becomes a request the code answers, when it can.

A call whose code checks ``accelnb.stop_requested()`` (a rank said so with ``ChecksForStop``)
is not killed by the first Stop: the kernel sends every rank a ``StopRequest``, the cell says
"stop requested: ranks will stop at their next check (press Stop again to stop now)", and the
ranks end at the step they agree on, after saving (``worker/stopping/``). A second press, or
``stop_grace`` seconds without every rank answering, stops the ranks the way a Stop always did.
Code that does not check is stopped at once, as before.

A press is any of: the kernel's stop button (SIGINT, turned into a press here, while the call
waits, instead of a ``KeyboardInterrupt``), a panel's Stop, a SIGTERM to the kernel (a
pre-empted machine's; ``kernel/run/sigterm.py``), and ``timeout=`` passing. The signal handler
only records the press: the call's wait loop, which owns the ranks' inboxes, sends the request,
so a press can never land half-way through writing a frame.

    >>> presses = StopPresses(grace=120.0)                                      # doctest: +SKIP
    >>> with presses.catching_interrupts(can_request=lambda: answers.checks_stop):  # doctest: +SKIP
    ...     press = presses.take()                                              # doctest: +SKIP
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from accelnb.kernel.display.output import OutputRouter, notebook_sink
from accelnb.kernel.run import run_state

STOP_BUTTON = "the stop button"
PANEL_STOP = "a panel's Stop"
TIMEOUT_PASSED = "timeout= passed"
# One click can arrive twice: the JupyterLab panel's Stop sends a comm message and interrupts the
# kernel (the comm alone is not read by every kernel while a cell runs). Presses this soon after
# the request are that same press, not the second one.
SAME_PRESS_S = 1.0
REQUEST_MESSAGE = ("accelnb: stop requested ({by}): ranks will stop at their next check "
                   "(press Stop again to stop now)\n")


class StopPresses:
    """What asked one call to stop, and when the ranks were asked."""

    def __init__(self, grace: float | None) -> None:
        self.grace = grace  # seconds the ranks get to answer a request; None: as long as they take
        self.asked_by: str | None = None  # what made the request, once one was sent
        self.asked_at: float | None = None  # monotonic
        self._pressed: str | None = None  # a press the signal handler saw, not yet acted on

    @property
    def requested(self) -> bool:
        return self.asked_at is not None

    def take(self) -> str | None:
        """The press the signal handler saw since the last call, if any."""
        pressed, self._pressed = self._pressed, None
        return pressed

    def request_sent(self, by: str) -> None:
        self.asked_by, self.asked_at = by, time.monotonic()

    def echoes_the_request(self) -> bool:
        """A press now is the request's own press arriving by a second way (see SAME_PRESS_S)."""
        return self.asked_at is not None and time.monotonic() - self.asked_at < SAME_PRESS_S

    def grace_over(self) -> bool:
        """The ranks had ``grace`` seconds to answer the request, and some did not."""
        return self.asked_at is not None and self.grace is not None and time.monotonic() - self.asked_at > self.grace

    def seconds_since_request(self) -> float | None:
        return None if self.asked_at is None else time.monotonic() - self.asked_at

    @contextmanager
    def catching_interrupts(self, can_request: Callable[[], bool]) -> Iterator[None]:
        """While the call waits: the first SIGINT becomes a press when ``can_request()`` (the code
        checks) and nothing asked yet; any other SIGINT interrupts as it always did. Only the main
        thread can set a signal handler: from another thread, SIGINT keeps its meaning."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.getsignal(signal.SIGINT)

        def on_interrupt(signum: int, frame: FrameType | None) -> None:
            if self.asked_at is None and self._pressed is None and can_request():
                self._pressed = STOP_BUTTON
                return
            if self._pressed is not None or self.echoes_the_request():
                return  # the same click, arriving twice
            if previous == signal.SIG_IGN:
                return
            if callable(previous) and previous is not signal.default_int_handler:
                previous(signum, frame)
                return
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, on_interrupt)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


def announce_request(output: OutputRouter, run: run_state.RunState | None, by: str) -> None:
    """Tell the cell that the ranks were asked to stop, and by what, after what they printed;
    the panels then offer the second press. Local and Ray groups alike."""
    output.tick(force=True)
    notebook_sink("stderr", REQUEST_MESSAGE.format(by=by))
    if run is not None:
        run.stop_pending = by
        run_state.publish()
