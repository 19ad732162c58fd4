"""What a SIGINT does in a local rank, at each point of a call: interrupt the code, wait, or nothing.

The kernel interrupts the call it waits for (Ctrl-C, the stop button) with SIGINT to every rank
that runs it. Raised anywhere but in the code and the pickling of its value, the
``KeyboardInterrupt`` did harm:

- after the rank answered (the kernel had not yet read the answer when it sent the signal), it
  ended the rank on its way back to waiting (a session then lost it: "exited with code 70"), or
  interrupted the next call;
- in accelnb's own work around the code, it could leave a lock of ours taken (between a lock's
  acquire and its ``with``): the next call's ``rank_stop.begin_call`` then waited forever.

So the rank's SIGINT handler is ours (:class:`RankInterrupts`), set once, and what it does is a
mode, switched by plain assignments (no system call on a call's path):

- ``held`` while accelnb sets a call up and tears it down: remembered, raised once the code runs
  (or, after it, while its value is pickled: an interrupt of the call either way);
- ``raised`` while the code and the pickling run: what the rank's own handler does (Python's
  ``KeyboardInterrupt``, or a handler the code set, which is kept for the next calls);
- ``dropped`` from the moment the answer starts out until the next call: too late, ignored.

A Ray rank runs its call outside the main thread, where no signal handler runs: the kernel's
interrupt is an asynchronous ``KeyboardInterrupt`` set in the call's thread
(:class:`ThreadInterrupts`), under the same modes. One set while the code ran but not raised by
the time the code ended is taken back: it came too late. Raised as the answer went out (an
asynchronous exception cannot be held, only taken back before it lands), it once reached Ray,
which reported a cancelled task and ended the session: the actor answers it instead.

    >>> interrupts = RankInterrupts()      # doctest: +SKIP  (the rank's main thread)
    >>> interrupts.hold(); interrupts.allow(); interrupts.drop()      # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, Literal, Protocol

from accelnb.wire.held_interrupts import deliver_sigint
from accelnb.wire.signal_handlers import handler_of, set_handler

Mode = Literal["held", "raised", "dropped"]


class CallInterrupts(Protocol):
    """How ``run_call`` tells the rank's SIGINT where the call is."""

    def hold(self) -> None: ...

    def allow(self) -> None: ...

    def drop(self) -> None: ...


class ThreadInterrupts:
    """A call's interrupt as an asynchronous ``KeyboardInterrupt`` in the thread that runs it (a
    Ray actor's call thread, ``worker/ray_rank.py``); :meth:`interrupt` comes from another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: int | None = None  # the call's, while one runs
        self._mode: Mode = "dropped"
        self._held = False  # one came while held: raised once the code runs
        self._set = False  # an exception set in the thread, perhaps not raised yet

    def begin(self) -> None:
        """In the call's thread, before the call."""
        with self._lock:
            self._thread, self._mode, self._held = threading.get_ident(), "held", False

    def hold(self) -> None:
        with self._lock:
            self._mode = "held"
            self._take_back()  # the code ended first: too late for it

    def allow(self) -> None:
        with self._lock:
            self._mode = "raised"
            held, self._held = self._held, False
        if held:
            raise KeyboardInterrupt

    def drop(self) -> None:
        with self._lock:
            self._mode, self._held = "dropped", False
            self._take_back()

    def settle(self) -> None:
        """:meth:`drop`, even where the exception it takes back lands meanwhile (it stopped
        nothing): once this returns, nothing more is raised in this call."""
        while True:
            try:
                self.drop()
                return
            except KeyboardInterrupt:
                continue

    def end(self) -> None:
        """In the call's thread, after the call: no interrupt outlives it (one raised later in
        Ray's own code on this thread would end the task)."""
        self.settle()
        with self._lock:
            self._thread = None

    def interrupt(self) -> bool:
        """Interrupt the running call's code (at its next Python bytecode: a thread blocked in a
        collective does not notice); False when no call runs."""
        with self._lock:
            if self._thread is None:
                return False
            if self._mode == "raised":
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread),
                                                           ctypes.py_object(KeyboardInterrupt))
                self._set = True
            elif self._mode == "held":
                self._held = True
            return True

    @property
    def call_thread(self) -> int | None:
        return self._thread

    def _take_back(self) -> None:
        if self._set and self._thread is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread), None)
        self._set = False


class RankInterrupts:
    """A local rank's SIGINT handler and its mode; made in the rank's main thread."""

    def __init__(self) -> None:
        self._mode: Mode = "raised"  # the rank's set-up: an interrupt there ends it, as it always did
        # Whether a SIGINT came while held. Not its frame: a kept frame keeps its locals (the
        # call's arguments, the shared pages they were rebuilt over) alive after it returns
        # (wire/held_interrupts.py says what that cost the kernel).
        self._held = False
        self._code_handler: Callable[[int, FrameType | None], Any] | int | None = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, self._heard)

    def hold(self) -> None:
        """accelnb's own work around the code. Only the main thread switches modes: Python runs
        a signal's handler in the main thread at its next step, so a SIGINT that came while the
        rank waited between calls is handled (dropped) before the mode that follows."""
        self._mode = "held"

    def allow(self) -> None:
        """The code runs: a SIGINT held meanwhile is raised now."""
        self._mode = "raised"
        if self._held:
            self._held = False
            self._act(None)

    def drop(self) -> None:
        """The answer starts out: from here until the next call a SIGINT is too late. A handler
        the code set in its place is kept for the next calls, and ours goes back."""
        self._mode = "dropped"
        self._held = False
        current = handler_of(signal.SIGINT)  # every call: wire/signal_handlers.py says why
        if current != self._heard:
            self._code_handler = current
            set_handler(signal.SIGINT, self._heard)

    def _heard(self, signum: int, frame: FrameType | None) -> None:
        if self._mode == "held":
            self._held = True
        elif self._mode == "raised":
            self._act(frame)

    def _act(self, frame: FrameType | None) -> None:
        """What the rank's own handler does with a SIGINT."""
        deliver_sigint(self._code_handler, frame)

