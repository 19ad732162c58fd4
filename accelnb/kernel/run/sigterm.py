"""A SIGTERM to the kernel while a launch runs: a Stop press, then the kernel's own ending.

A pre-empted cloud machine, a batch scheduler and ``jupyter``'s own shutdown send SIGTERM, then
SIGKILL some seconds later. Dying at once would lose the run; so while a launch runs in the main
thread, SIGTERM is a Stop press by "SIGTERM" (``run_state.request_stop``): code that checks
``accelnb.stop_requested()`` saves and returns, other code is stopped at once, every rank is gone
either way. Then the handler that was there before is put back and the signal sent again, so the
kernel (or script) ends as the sender meant. A second SIGTERM is a second press: stop now.

A SIGTERM while no run is in progress (the ranks starting, a restart's delay) interrupts the
launch like the stop button, which also leaves nothing behind.

    >>> with sigterm_as_stop():                                       # doctest: +SKIP
    ...     run_attempts(...)
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from accelnb.kernel.run import run_state
from accelnb.kernel.run.group.stop_presses import SIGTERM_PRESS
from accelnb.wire.signal_handlers import handler_of, set_handler

# A Jupyter kernel's flush hands the cell's last lines to zmq, whose own I/O thread writes them to
# the socket afterwards; a process that dies of SIGTERM right after the flush loses them (the
# "stopped as asked" line, once in a full test run). The kernel waits this long before dying, as a
# zmq socket's linger would: well inside the seconds a sender of SIGTERM gives before SIGKILL.
# A script does not wait: its flush writes the lines itself.
LAST_LINES_LINGER_S = 0.5


@contextmanager
def sigterm_as_stop() -> Iterator[None]:
    """SIGTERM is a Stop press while the block runs, and is delivered again once it ended."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set a handler; the signal keeps its meaning
        return
    received: list[int] = []

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        if not run_state.request_stop(by=SIGTERM_PRESS):
            raise KeyboardInterrupt  # no run to ask: stop the launch as the stop button would

    # Every session call: wire/signal_handlers.py says why not signal.signal. The old handler is
    # read first and the new one set inside the try, so that a Ctrl-C landing at either call
    # leaves SIGTERM as it found it.
    previous = handler_of(signal.SIGTERM)
    try:
        set_handler(signal.SIGTERM, on_sigterm)
        yield
    finally:
        set_handler(signal.SIGTERM, previous)
        if received:
            for stream in (sys.stdout, sys.stderr):  # a kernel's streams are buffered: the cell's last lines
                with contextlib.suppress(Exception):
                    stream.flush()
            if _written_by_a_kernel(sys.stdout):
                time.sleep(LAST_LINES_LINGER_S)  # a script's flush has written them already
            os.kill(os.getpid(), signal.SIGTERM)  # the kernel's own handling, now that no rank is left


def _written_by_a_kernel(stream: object) -> bool:
    """The stream is ipykernel's, which zmq writes later from its own thread."""
    return type(stream).__module__.startswith("ipykernel.")
