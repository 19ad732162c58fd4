"""A rank's Python stacks on fd 2, when the kernel asks for them (``wire/stack_signals.py``).

faulthandler prints them from inside a signal handler, walking every thread's frames while those
threads go on running: a thread that returns from a function meanwhile changes or frees the frames
being read, and the rank dies of a segfault in the middle of the dump. That ended a rank at a
``timeout=`` in a fresh clone's run (its flusher thread was leaving an ``Event.wait``), and a
thread that calls functions in a loop crashes a plain script so within a tenth of a second of
dumps. So the rank's signal watcher writes the stacks instead (:func:`write_stacks`), holding
the GIL (``sys._current_frames``), in faulthandler's format, which ``kernel/stacks`` reads.

faulthandler stays armed for what only it can do: a rank that crashes (a segfault's traceback),
and the kernel's second signal, sent only to a rank whose watcher could not run, where no thread
can be running Python (:func:`arm`).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from types import FrameType

from accelnb.wire.stack_signals import ASK_FOR_STACKS, STACKS_WITHOUT_THE_GIL

# faulthandler's own limits, so that both dumps read alike
MAX_FRAMES = 100
MAX_THREADS = 100


def arm() -> None:
    """In the rank's main thread, once its fd 2 is the kernel's pipe: crashes print their
    tracebacks, ``ASK_FOR_STACKS`` reaches the signal watcher (through Python's wakeup fd, whose
    handler must be Python's), and ``STACKS_WITHOUT_THE_GIL`` makes faulthandler dump."""
    faulthandler.enable(file=2, all_threads=True)
    # Python's handler does nothing in the main thread: its C part has already woken the watcher.
    signal.signal(ASK_FOR_STACKS, lambda signum, frame: None)
    faulthandler.register(STACKS_WITHOUT_THE_GIL, file=2, all_threads=True, chain=False)


def write_stacks(fd: int = 2) -> None:
    """Every thread's Python stack but the caller's, most recent call first, as faulthandler
    prints them, in one write (the kernel holds the rank's stderr while it reads a dump)."""
    me = threading.get_ident()
    # Taken with the GIL held, and each frame then holds its own: nothing changes under us.
    threads = [(ident, frame) for ident, frame in sys._current_frames().items() if ident != me]
    blocks = [_thread_block(ident, frame) for ident, frame in threads[:MAX_THREADS]]
    if len(threads) > MAX_THREADS:
        blocks.append("...\n")
    data = "".join(blocks).encode("utf-8", "backslashreplace")
    while data:
        data = data[os.write(fd, data):]


def _thread_block(ident: int, frame: FrameType) -> str:
    # The main thread runs the user's code: it is named, as faulthandler names the thread that
    # took the signal (the main one, mostly) "Current thread".
    kind = "Main thread" if ident == threading.main_thread().ident else "Thread"
    lines = [f"{kind} 0x{ident:016x} (most recent call first):\n"]
    current: FrameType | None = frame
    while current is not None and len(lines) <= MAX_FRAMES:
        code = current.f_code
        line = current.f_lineno if current.f_lineno is not None else "???"
        lines.append(f'  File "{code.co_filename}", line {line} in {code.co_name}\n')
        current = current.f_back
    if current is not None:
        lines.append("  ...\n")
    lines.append("\n")
    return "".join(lines)
