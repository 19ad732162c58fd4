"""The kernel's Stop, for one call: presses, the request the code answers, its grace, the second press.

This module is the one home of that state machine; the call's wait loop
(``kernel/run/group/call_protocol.py``) asks :meth:`StopPresses.decide` on every wake-up and does
what it answers, and the rank's side is ``worker/stopping/``.

A call whose code checks ``accelnb.stop_requested()`` (a rank said so with ``ChecksForStop``)
is not killed by the first Stop: the kernel sends every rank a ``StopRequest``, the cell says
"stop requested: ranks will stop at their next check (press Stop again to stop now)", and the
ranks end at the step they agree on, after saving. A second press, or ``stop_grace`` seconds
without every rank answering, stops the ranks the way a Stop always did. Code that does not
check is stopped at once, as before.

A press comes from one of these sources, each named in the cell's message:

- the kernel's stop button (SIGINT, turned into a press here while the call waits, instead of a
  ``KeyboardInterrupt``): :data:`STOP_BUTTON`;
- a panel's Stop, a sweep's stop and a SIGTERM to the kernel (``kernel/run/sigterm.py``), which
  press from another thread or a signal handler through the run's
  :meth:`~accelnb.kernel.run.run_state.RunState.press_stop`: :data:`PANEL_STOP`, :data:`SIGTERM_PRESS`
  (a sweep names the press that stopped it);
- ``timeout=`` passing: :data:`TIMEOUT_PASSED`.

A signal handler or another thread only records the press: the wait loop, which owns the ranks'
inboxes, sends the request, so a press can never land half-way through writing a frame.

    >>> presses = StopPresses(grace=120.0, timeout=None, pressed_elsewhere=run.take_stop_press)  # doctest: +SKIP
    >>> with presses.catching_interrupts(can_request=lambda: answers.checks_stop):  # doctest: +SKIP
    ...     ending = presses.decide(answers.checks_stop, request=ask_the_ranks)    # doctest: +SKIP
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Literal

from accelnb.kernel.display.output import OutputRouter, notebook_sink
from accelnb.kernel.run import run_state
from accelnb.wire.held_interrupts import sigint_goes_to
from accelnb.wire.signal_handlers import Handler

STOP_BUTTON = "the stop button"
PANEL_STOP = "a panel's Stop"
TIMEOUT_PASSED = "timeout= passed"
SIGTERM_PRESS = "SIGTERM"  # a pre-empted machine, a scheduler, Jupyter's shutdown (kernel/run/sigterm.py)
# One click can arrive twice: the JupyterLab panel's Stop sends a comm message and interrupts the
# kernel (the comm alone is not read by every kernel while a cell runs). Presses this soon after
# the request are that same press, not the second one.
SAME_PRESS_S = 1.0
REQUEST_MESSAGE = ("accelnb: stop requested ({by}): ranks will stop at their next check "
                   "(press Stop again to stop now)\n")


# How a call's Stop ends it, when it does: the ranks are stopped now.
StopEnding = Literal["stop_requested", "timed_out"]


class StopPresses:
    """What asked one call to stop, and when the ranks were asked.

    ``grace``: seconds the ranks get to answer a request (None: as long as they take);
    ``timeout``: the call's ``timeout=`` (None: none), which passing is a press;
    ``pressed_elsewhere``: takes a press made from another thread since the last look (the run's
    :meth:`~accelnb.kernel.run.run_state.RunState.take_stop_press`).
    """

    def __init__(self, grace: float | None, timeout: float | None = None,
                 pressed_elsewhere: Callable[[], str | None] = lambda: None) -> None:
        self.grace = grace
        self.asked_by: str | None = None  # what made the request, once one was sent
        self.asked_at: float | None = None  # monotonic
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._pressed_elsewhere = pressed_elsewhere
        self._pressed: str | None = None  # a press the signal handler saw, not yet acted on

    @property
    def requested(self) -> bool:
        return self.asked_at is not None

    def decide(self, checks_stop: bool, request: Callable[[str], bool]) -> StopEnding | None:
        """One look from the wait loop: None while the call goes on, else how it ends now.

        The first press while the code checks (``checks_stop``) becomes a request:
        ``request(by)`` asks the ranks and tells the cell, and returns False when they cannot be
        asked (the call then stops now). A later press, the grace running out, or ``timeout=``
        passing for code that does not check, end the call. One click arriving two ways is one
        press (:data:`SAME_PRESS_S`).
        """
        by_signal = self._take_signal_press()  # one look takes both: a click arriving two ways
        press = self._pressed_elsewhere() or by_signal
        if self._deadline is not None and time.monotonic() > self._deadline:
            if self.requested or not checks_stop:
                return "timed_out"
            press, self._deadline = TIMEOUT_PASSED, None
        if press is not None and not self._echoes_the_request():
            if self.requested or not (checks_stop and request(press)):
                return "stop_requested"
            self.asked_by, self.asked_at = press, time.monotonic()
        if self._grace_over():
            return "timed_out" if self.asked_by == TIMEOUT_PASSED else "stop_requested"
        return None

    def not_counting(self, seconds: float) -> None:
        """``seconds`` were the user's (a rank's prompt waited for them): not the run's time."""
        if self._deadline is not None:
            self._deadline += seconds

    def seconds_since_request(self) -> float | None:
        return None if self.asked_at is None else time.monotonic() - self.asked_at

    def _take_signal_press(self) -> str | None:
        pressed, self._pressed = self._pressed, None
        return pressed

    def _echoes_the_request(self) -> bool:
        """A press now is the request's own press arriving by a second way (see SAME_PRESS_S)."""
        return self.asked_at is not None and time.monotonic() - self.asked_at < SAME_PRESS_S

    def _grace_over(self) -> bool:
        """The ranks had ``grace`` seconds to answer the request, and some did not."""
        return self.asked_at is not None and self.grace is not None and time.monotonic() - self.asked_at > self.grace

    @contextmanager
    def catching_interrupts(self, can_request: Callable[[], bool]) -> Iterator[None]:
        """While the call waits: the first SIGINT becomes a press when ``can_request()`` (the code
        checks) and nothing asked yet; any other SIGINT interrupts as it always did. Only the main
        thread can set a signal handler: from another thread, SIGINT keeps its meaning."""

        def handler_for(previous: Handler) -> Handler:
            def on_interrupt(signum: int, frame: FrameType | None) -> None:
                if self.asked_at is None and self._pressed is None and can_request():
                    self._pressed = STOP_BUTTON
                    return
                if self._pressed is not None or self._echoes_the_request():
                    return  # the same click, arriving twice
                if previous == signal.SIG_IGN:
                    return
                if callable(previous) and previous is not signal.default_int_handler:
                    previous(signum, frame)
                    return
                raise KeyboardInterrupt

            return on_interrupt

        with sigint_goes_to(handler_for):
            yield


def announce_request(output: OutputRouter, run: run_state.RunState | None, by: str) -> None:
    """Tell the cell that the ranks were asked to stop, and by what, after what they printed;
    the panels then offer the second press. Local and Ray groups alike."""
    output.tick(force=True)
    notebook_sink("stderr", REQUEST_MESSAGE.format(by=by))
    if run is not None:
        run.stop_pending = by
        run_state.publish()
