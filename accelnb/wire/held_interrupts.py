"""Hold a Ctrl-C while a new fd is being handed to its owner, or a call to the ranks, then deliver it.

CPython checks for signals right after a call into C returns. ``os.pipe()``, ``memfd_create``
and ``recvmsg`` hand back bare fds, so an interrupt can surface as ``KeyboardInterrupt`` before
the fds are stored anywhere that a ``finally`` could close: they leak, one or two per unlucky
Ctrl-C (seen as 2 fds left in the kernel by the 20-moment interrupt sweep of
``tests/faults/test_own_faults.py``). Inside :func:`held_interrupts` the interrupt is only
recorded; it is raised when the block ends, once the fds have an owner.

    >>> import os
    >>> with held_interrupts():
    ...     read_end, write_end = os.pipe()
    ...     owned = [read_end, write_end]        # an interrupt here waits until this line ran
    >>> for fd in owned: os.close(fd)

The kernel also holds a Ctrl-C while it writes a call to a session's ranks
(``kernel/run/group/rank_inboxes.py``): cut between two ranks' frames, the call would run on some
ranks only, and the session would have to be closed. Held, it interrupts the call once every rank
has it, and the session goes on.

Only the main thread gets ``KeyboardInterrupt`` (and ``signal.signal`` works only there): in any
other thread the block runs as it is. Workers use it too, for the same fds on their side.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def held_interrupts(second_one_goes_through: bool = False) -> Iterator[None]:
    """Defer SIGINT's handler to the end of the block (main thread only).

    ``second_one_goes_through``: for a block that is quick unless something else is stuck
    (writing a call to ranks that read it): a second Ctrl-C while the first is held raises at once,
    so a user can always get out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[FrameType | None] = []

    def remember(signum: int, frame: FrameType | None) -> None:
        came.append(frame)
        if second_one_goes_through and len(came) == 2:
            signal.signal(signal.SIGINT, previous)
            _deliver(previous, frame)

    previous = signal.signal(signal.SIGINT, remember)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is remember:
            signal.signal(signal.SIGINT, previous)
            if came:
                _deliver(previous, came[0])


def _deliver(handler: object, frame: FrameType | None) -> None:
    """What SIGINT would have done under ``handler``: raise, run it, ignore, or die."""
    if callable(handler):
        handler(signal.SIGINT, frame)
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)
    # SIG_IGN (or None: a handler set from C): nothing would have happened
