"""A SIGINT that reaches a local rank after its call answered: dropped, not raised.

The kernel interrupts the call it waits for (Ctrl-C, the stop button) with SIGINT to every rank
that runs it. When a rank has just answered, the signal can still arrive: the kernel had not yet
read the answer when it sent it. Raised there, the ``KeyboardInterrupt`` ended the rank on its way
back to waiting (the session then lost it: "exited with code 70"), or interrupted the next call.
So from the moment a call's answer starts out until the next call arrives, SIGINT runs a handler
that does nothing; the call gets the rank's own handler back (Python's, or one an earlier call
set).

    >>> late = LateInterrupts()
    >>> late.drop()       # the answer goes out (main thread): SIGINT is too late from here
    >>> late.restore()    # the next call is here: SIGINT interrupts it again
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any


class LateInterrupts:
    """Drops SIGINT between a call's answer and the next call, in the main thread."""

    def __init__(self) -> None:
        self._calls_handler: Callable[[int, FrameType | None], Any] | int | None = None  # while dropping
        self._dropping = False

    def drop(self) -> None:
        """From now until :meth:`restore`; idempotent, and a no-op off the main thread (only it
        runs calls, and only it may set a handler)."""
        if not self._dropping and threading.current_thread() is threading.main_thread():
            self._calls_handler = signal.signal(signal.SIGINT, _too_late)
            self._dropping = True

    def restore(self) -> None:
        """The next call runs: SIGINT does to it what the rank's own handler does."""
        if self._dropping:
            signal.signal(signal.SIGINT, self._calls_handler)
            self._dropping = False


def _too_late(signum: int, frame: FrameType | None) -> None:
    """SIGINT between calls: meant for a call that had already answered here."""
